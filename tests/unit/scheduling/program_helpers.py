"""The scheduler the agent-program tests drive: programs on, no window, two workers."""

from __future__ import annotations

from thunderagent.scheduling import Dispatch, SchedRequest, ThunderScheduler, WorkerRoom


def sched(total=0, **params) -> ThunderScheduler:
    """Two workers ``w0``/``w1`` with ``total`` KV blocks each, every other knob ``params``."""
    s = ThunderScheduler(
        programs=True, window="none", kv_watermark=1.0, program_resume_watermark=0.75, **params
    )
    for w in ("w0", "w1"):
        s.update_worker(WorkerRoom(w, 0, 0, 0, total, 8), 0.0)
    return s


def run(s: ThunderScheduler, r: SchedRequest, now: float) -> list[Dispatch]:
    """Submit ``r`` and poll once: the dispatches that came out."""
    s.submit(r, now)
    return [a for a in s.poll(now) if isinstance(a, Dispatch)]
