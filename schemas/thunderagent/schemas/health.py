"""Liveness probe reply."""

from __future__ import annotations

from msgspec import Struct


class Health(Struct, frozen=True, kw_only=True):
    """Answer to a request on ``thunderagent.health.<service>``."""

    service: str
    """Service name (``router``, ``scheduler``, ``index``, ``worker-<id>``)."""
    pid: int
    """Process id."""
    started_at: float
    """Unix seconds when the process started."""
    dead_letters: int = 0
    """Messages this process has rejected so far."""
