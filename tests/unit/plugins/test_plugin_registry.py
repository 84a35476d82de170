"""The plugin registry: names, factories, and what an unknown name or parameter says."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from thunderagent.plugins import Registry
from thunderagent.routing import POLICIES
from thunderagent.scheduling import SCHEDULERS


def test_create_passes_parameters_and_refuses_unknown_names_and_parameters() -> None:
    reg: Registry[object] = Registry("widget")

    @reg.register("plain")
    @dataclass
    class Plain:
        size: int = 1

    @reg.register("open")
    def open_factory(**params: object) -> dict:
        return dict(params)

    assert reg.create("plain", size=3) == Plain(3)
    assert reg.create("open", anything=1) == {"anything": 1}  # takes any keyword
    with pytest.raises(ValueError, match=r"unknown widget 'nope'; known: open, plain"):
        reg.create("nope")
    with pytest.raises(
        ValueError, match=r"widget 'plain' has no parameter 'colour'; its parameters: size"
    ):
        reg.create("plain", colour="red")
    with pytest.raises(ValueError, match="registered twice"):
        reg.register("plain")(Plain)


def test_the_built_in_registries_name_a_parameter_they_do_not_take() -> None:
    with pytest.raises(ValueError, match=r"routing policy 'thunder' has no parameter 'nosuch'"):
        POLICIES.create("thunder", nosuch=1)
    with pytest.raises(
        ValueError,
        match=r"scheduler 'fcfs' has no parameter 'nosuch'; its parameters: .*kv_watermark",
    ):
        SCHEDULERS.create("fcfs", nosuch=1)
    assert POLICIES.create("thunder", recompute_gain=2.0).recompute_gain == 2.0
