"""Direct dispatch: every request goes to the router's first candidate at once, in arrival
order (FIFO). The engines' own queues do the waiting. The baseline the real scheduler is
measured against, and what the replay uses when scheduling is not under study."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from thunderagent.scheduling.api import Action, Dispatch, SchedRequest, _Base

UNBOUNDED = 1 << 20
"""Credit lent per worker when nothing is ever held: more than any burst between two grants."""


@dataclass
class DirectScheduler(_Base):
    name: str = "direct"
    _queue: deque[SchedRequest] = field(default_factory=deque)

    def submit(self, request: SchedRequest, now: float) -> None:
        self._queue.append(request)

    def rooms(self) -> dict[str, int]:
        """Unbounded: the engines' own queues do the waiting."""
        return dict.fromkeys(self.worker_rooms, UNBOUNDED) if not self._queue else {}

    def cancel(self, request_id: str, now: float) -> bool:
        for req in self._queue:
            if req.request_id == request_id:
                self._queue.remove(req)
                return True
        self.inflight.pop(request_id, None)
        return False

    def poll(self, now: float) -> list[Action]:
        actions: list[Action] = []
        while self._queue:
            req = self._queue.popleft()
            worker = req.candidates[0][0]
            self.inflight[req.request_id] = worker
            actions.append(Dispatch(req.request_id, worker))
        return actions

    def waiting(self) -> int:
        return len(self._queue)
