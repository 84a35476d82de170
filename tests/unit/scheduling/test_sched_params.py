"""Scheduler knobs: a bad override is refused with the knob's name, whatever its type."""

import pytest

from thunderagent.scheduling import SCHEDULERS
from thunderagent.scheduling.params import ParamError, SchedParams


@pytest.mark.parametrize(
    ("override", "reason"),
    [
        ({"kv_watermark": "abc"}, "must be a number"),
        ({"kv_watermark": None}, "must be a number"),
        ({"kv_watermark": True}, "must be a number"),
        ({"max_running": 2.5}, "must be an integer"),
        ({"cold_prefill_queue_tokens": "32768"}, "must be an integer"),
        ({"grouping": 1}, "must be true or false"),
        ({"order": 3}, "must be a string"),
        ({"kv_watermark": 2}, "must be in (0, 1]"),
        ({"order": "lifo"}, "must be one of"),
    ],
)
def test_bad_override_names_the_knob(override: dict, reason: str) -> None:
    (name,) = override
    with pytest.raises(ParamError) as err:
        SchedParams(**override).validate()
    assert err.value.field == name
    assert reason in str(err.value)


def test_an_integer_stands_for_a_float_and_defaults_validate() -> None:
    assert SchedParams(kv_watermark=1, spill_after_s=2).validate().kv_watermark == 1
    SchedParams().validate()


def test_the_registry_refuses_the_same_way() -> None:
    with pytest.raises(ValueError, match="kv_watermark='abc': must be a number"):
        SCHEDULERS.create("thunder", kv_watermark="abc")
