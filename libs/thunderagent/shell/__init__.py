"""What every service process shares: the run loop (uvloop, signals, telemetry) and the
fleet watcher that feeds a :class:`~thunderagent.fleet.WorkerRegistry` from NATS."""

from thunderagent.shell.fleet import FleetWatcher
from thunderagent.shell.runner import ServiceContext, run_service
from thunderagent.shell.tasks import TaskSet

__all__ = ["FleetWatcher", "ServiceContext", "TaskSet", "run_service"]
