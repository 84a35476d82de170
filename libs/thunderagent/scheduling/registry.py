"""Scheduler registry: name -> factory(**params) -> Scheduler. One registration path.

Presets are ``ThunderScheduler`` with knobs set; any knob can still be overridden by keyword
(``make_scheduler("preempt", preempt_gain_ratio=3.0)``). ``direct`` is the engine-queue
baseline and takes no knobs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from thunderagent.scheduling.api import Scheduler
from thunderagent.scheduling.direct import DirectScheduler
from thunderagent.scheduling.params import SchedParams
from thunderagent.scheduling.thunder import ThunderScheduler

SCHEDULERS: dict[str, Callable[..., Scheduler]] = {}

_BASE: dict[str, Any] = {"window": "none", "grouping": False, "deadlines": False}
PRESETS: dict[str, dict[str, Any]] = {
    "fcfs": {**_BASE, "order": "fcfs"},
    "priority_srpt": {**_BASE, "order": "priority_srpt"},
    "preempt": {**_BASE, "order": "priority_srpt", "preemption": True},
    "window_none": {"window": "none", "deadlines": False},
    "window_fixed": {"window": "fixed", "deadlines": False},
    "window_adaptive": {"window": "adaptive", "deadlines": False},
    "pd_capped": {"pd_mode": "disaggregated", "pd_max_inflight": 8},
    "pd_uncapped": {"pd_mode": "disaggregated", "pd_max_inflight": 0},
    "programs": {"programs": True},
    "thunder": {"preemption": True, "programs": True},
}
"""``thunder`` is everything on: adaptive window, grouping, priority+SRPT, preemption, programs,
deadlines (PD follows ``pd_mode``). The others isolate one feature for the benchmark."""


def register(name: str, factory: Callable[..., Scheduler]) -> None:
    if name in SCHEDULERS:
        raise ValueError(f"scheduler {name!r} registered twice")
    SCHEDULERS[name] = factory


def _preset(name: str, knobs: dict[str, Any]) -> Callable[..., Scheduler]:
    def factory(**params: Any) -> Scheduler:
        return ThunderScheduler(SchedParams(**{**knobs, **params}), name=name)

    return factory


def _direct(**params: Any) -> Scheduler:
    if params:
        raise ValueError(f"scheduler 'direct' takes no params, got {sorted(params)}")
    return DirectScheduler()


register("direct", _direct)
for _name, _knobs in PRESETS.items():
    register(_name, _preset(_name, _knobs))


def make_scheduler(name: str, **params: Any) -> Scheduler:
    try:
        factory = SCHEDULERS[name]
    except KeyError:
        raise ValueError(f"unknown scheduler {name!r}; known: {sorted(SCHEDULERS)}") from None
    return factory(**params)
