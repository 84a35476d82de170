"""Scheduler registry: name -> factory(**knobs) -> Scheduler (``thunderagent.plugins``).

Presets are ``ThunderScheduler`` with knobs set; any knob can still be overridden by keyword
(``SCHEDULERS.create("preempt", preempt_gain_ratio=3.0)``). ``direct`` is the engine-queue
baseline and takes no knobs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from thunderagent.plugins import Registry
from thunderagent.scheduling.api import Scheduler
from thunderagent.scheduling.direct import DirectScheduler
from thunderagent.scheduling.params import SchedParams
from thunderagent.scheduling.thunder import ThunderScheduler

SCHEDULERS: Registry[Scheduler] = Registry("scheduler")

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


@SCHEDULERS.register("direct")
def _direct(**params: Any) -> Scheduler:
    if params:
        raise ValueError(f"scheduler 'direct' takes no params, got {sorted(params)}")
    return DirectScheduler()


def _preset(name: str, knobs: dict[str, Any]) -> Callable[..., Scheduler]:
    def factory(**params: Any) -> Scheduler:
        unknown = sorted(set(params) - set(SchedParams.__dataclass_fields__))
        if unknown:
            known = ", ".join(sorted(SchedParams.__dataclass_fields__))
            missing = ", ".join(map(repr, unknown))
            raise ValueError(
                f"scheduler {name!r} has no parameter {missing}; its parameters: {known}"
            )
        return ThunderScheduler(SchedParams(**{**knobs, **params}), name=name)

    return factory


for _name, _knobs in PRESETS.items():
    SCHEDULERS.register(_name)(_preset(_name, _knobs))
