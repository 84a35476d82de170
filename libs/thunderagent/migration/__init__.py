"""Where hot prefixes should live: the migration planner (pure, clock passed in).

See README.md in this folder for the API the live service and the virtual-time replay drive.
"""

from thunderagent.migration.cost import Estimate, LinkBook, estimate
from thunderagent.migration.demand import DemandTracker
from thunderagent.migration.model import (
    Action,
    Drop,
    Migrate,
    Move,
    PlannerStats,
    Replicate,
    RouteSeen,
    WorkerSeen,
)
from thunderagent.migration.params import MigrationParams, ParamError
from thunderagent.migration.planner import Holders, MigrationPlanner

__all__ = [
    "Action",
    "DemandTracker",
    "Drop",
    "Estimate",
    "Holders",
    "LinkBook",
    "Migrate",
    "MigrationParams",
    "MigrationPlanner",
    "Move",
    "ParamError",
    "PlannerStats",
    "Replicate",
    "RouteSeen",
    "WorkerSeen",
    "estimate",
]
