"""Live view of the fleet: registered workers, leases and latest load (pure, clock injected)."""

from thunderagent.fleet.workers import WorkerRegistry, WorkerState

__all__ = ["WorkerRegistry", "WorkerState"]
