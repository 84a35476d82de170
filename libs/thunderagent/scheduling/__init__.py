"""Scheduling policies (pure, clock injected): when and in what order requests go to workers.

The same objects run inside the scheduler service (wall clock) and inside the virtual-time
replay benchmark; both drive them only through the protocol in ``api``.
"""

from thunderagent.scheduling.api import (
    Action,
    Dispatch,
    Preempt,
    Reject,
    SchedRequest,
    Scheduler,
    WorkerRoom,
)
from thunderagent.scheduling.direct import DirectScheduler
from thunderagent.scheduling.params import ParamError, SchedParams
from thunderagent.scheduling.registry import SCHEDULERS
from thunderagent.scheduling.thunder import ThunderScheduler

__all__ = [
    "SCHEDULERS",
    "Action",
    "DirectScheduler",
    "Dispatch",
    "ParamError",
    "Preempt",
    "Reject",
    "SchedParams",
    "SchedRequest",
    "Scheduler",
    "ThunderScheduler",
    "WorkerRoom",
]
