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

__all__ = [
    "Action",
    "DirectScheduler",
    "Dispatch",
    "Preempt",
    "Reject",
    "SchedRequest",
    "Scheduler",
    "WorkerRoom",
]
