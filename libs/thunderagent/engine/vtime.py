"""Discrete-event simulator: N engine cores in virtual time, arrivals routed by a callable.

Two event sources, merged in time order: the sorted arrival list and a heap of step
completions (one in flight per busy engine). An arrival at the same instant as a step end is
handled first, so the engine's next step already sees it. Engines plan each step with
``until`` = the next arrival time, so decode-only stretches are crossed in one fused step.

The routing hook is a plain ``route(request, now) -> engine index``; a policy that needs load
closes over ``Simulator.cores`` (``core.load()``). ``on_step(engine, start, outcome)`` sees
every step at its completion time (KV events for an index, token counts for metrics).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from thunderagent.engine.core import EngineCore, FinishedRequest, Request, StepOutcome

Route = Callable[[Request, float], int]
OnComplete = Callable[["RequestRecord"], None]
OnStep = Callable[[int, float, StepOutcome], None]


@dataclass(slots=True)
class RequestRecord:
    """One request's life in virtual time (seconds)."""

    request_id: str
    worker: int
    arrival: float
    first_token_time: float = math.nan
    finish_time: float = math.nan
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    preemptions: int = 0
    finish_reason: str = ""

    @property
    def ttft(self) -> float:
        return self.first_token_time - self.arrival


class Simulator:
    """Owns the engines and the clock; ``run`` replays arrivals to completion."""

    def __init__(
        self,
        cores: Sequence[EngineCore],
        route: Route,
        on_complete: OnComplete | None = None,
        on_step: OnStep | None = None,
    ) -> None:
        self.cores = list(cores)
        self.route = route
        self.on_complete = on_complete
        self.on_step = on_step
        self.now = 0.0
        self.steps = 0
        self._records: dict[str, RequestRecord] = {}
        self._inflight: dict[int, tuple[float, StepOutcome]] = {}
        self._heap: list[tuple[float, int]] = []
        self._next_arrival = math.inf

    def run(self, arrivals: Iterable[tuple[float, Request]]) -> list[RequestRecord]:
        """Replay ``(time, request)`` pairs (sorted by time here) until every engine drains."""
        queue = sorted(arrivals, key=lambda pair: pair[0])
        done: list[RequestRecord] = []
        i = 0
        while i < len(queue) or self._heap:
            t_arrival = queue[i][0] if i < len(queue) else math.inf
            if self._heap and self._heap[0][0] < t_arrival:
                t, idx = heapq.heappop(self._heap)
                self.now = t
                self._next_arrival = t_arrival
                done.extend(self._complete(idx, t))
                self._kick(idx, t)
                continue
            t, request = queue[i]
            i += 1
            self.now = t
            self._next_arrival = queue[i][0] if i < len(queue) else math.inf
            rejected = self._arrive(request, t)
            if rejected is not None:
                done.append(rejected)
        return done

    def _arrive(self, request: Request, now: float) -> RequestRecord | None:
        idx = self.route(request, now)
        record = RequestRecord(request.request_id, idx, now, prompt_tokens=request.prompt_len)
        rejected = self.cores[idx].add(request, now)
        if rejected is not None:
            return self._close(record, rejected, now)
        self._records[request.request_id] = record
        if idx not in self._inflight:
            self._kick(idx, now)
        return None

    def _kick(self, idx: int, now: float) -> None:
        core = self.cores[idx]
        if not core.has_work:
            return
        outcome = core.step(now, until=self._next_arrival)
        if outcome.kind == "idle":
            raise RuntimeError(f"engine {idx} has work but planned an idle step at {now}")
        self.steps += 1
        self._inflight[idx] = (now, outcome)
        heapq.heappush(self._heap, (now + outcome.duration, idx))

    def _complete(self, idx: int, t: float) -> list[RequestRecord]:
        start, outcome = self._inflight.pop(idx)
        if self.on_step is not None:
            self.on_step(idx, start, outcome)
        for rid in outcome.first_token:
            self._records[rid].first_token_time = t
        return [self._close(self._records.pop(f.request_id), f, t) for f in outcome.finished]

    def _close(self, record: RequestRecord, fin: FinishedRequest, t: float) -> RequestRecord:
        record.finish_time = t
        record.cached_tokens = fin.cached_tokens
        record.completion_tokens = fin.completion_tokens
        record.preemptions = fin.preemptions
        record.finish_reason = fin.finish_reason
        if self.on_complete is not None:
            self.on_complete(record)
        return record


def round_robin(n: int) -> Route:
    """The simplest route: engines in turn, ignoring the request."""
    counter = iter(range(1 << 62))
    return lambda request, now: next(counter) % n
