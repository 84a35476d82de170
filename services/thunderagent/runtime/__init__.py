"""What every service process shares: the run loop (uvloop, signals, telemetry) and the
fleet watcher that feeds a :class:`~thunderagent.registry.WorkerRegistry` from NATS."""

from thunderagent.runtime.fleet import FleetWatcher
from thunderagent.runtime.runner import ServiceContext, run_service

__all__ = ["FleetWatcher", "ServiceContext", "run_service"]
