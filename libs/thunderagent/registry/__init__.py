"""Live view of the fleet: registered workers, leases and latest load (pure, clock injected)."""

from thunderagent.registry.workers import WorkerRegistry, WorkerState

__all__ = ["WorkerRegistry", "WorkerState"]
