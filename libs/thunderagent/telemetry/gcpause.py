"""How long the cyclic GC stops this process, per generation, as Prometheus metrics.

A full collection walks every tracked container, so its pause grows with whatever the process
keeps: before the prefix index's entries became ``gc=False`` structs, one took ~200 ms per
million indexed blocks, in the router as much as in the index service. Python exposes the number
of collections (``python_gc_collections_total``) but not their length; these fill that in.

The GC callback only adds to plain floats: it runs in whichever thread triggered the collection,
at any allocation, possibly inside the metrics SDK's own locked code, so recording into an
instrument from there could deadlock. The observable instruments read the sums at scrape time.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Iterable

from opentelemetry.metrics import CallbackOptions, Meter, Observation

GENERATIONS = (0, 1, 2)


class GcPauses:
    """Pause seconds per generation: the running total and the longest since the last read."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self._clock = clock
        self._started = 0.0
        self.total_s = [0.0] * len(GENERATIONS)
        self.longest_s = [0.0] * len(GENERATIONS)

    def on_gc(self, phase: str, info: dict) -> None:
        """A ``gc.callbacks`` entry."""
        if phase == "start":
            self._started = self._clock()
            return
        pause = self._clock() - self._started
        g = info["generation"]
        self.total_s[g] += pause
        if pause > self.longest_s[g]:
            self.longest_s[g] = pause

    def take_longest(self) -> list[float]:
        """The longest pause per generation since the previous call, and start over."""
        out, self.longest_s = self.longest_s, [0.0] * len(GENERATIONS)
        return out


def export_gc_pauses(meter: Meter, service: str) -> Callable[[], None]:
    """Count this process's GC pauses into ``thunderagent_gc_pause_seconds_total`` and
    ``thunderagent_gc_pause_max_seconds`` (labels ``service``, ``generation``); returns the
    function that stops it."""
    pauses = GcPauses()
    attrs = [{"service": service, "generation": str(g)} for g in GENERATIONS]

    def totals(_options: CallbackOptions) -> Iterable[Observation]:
        return [Observation(pauses.total_s[g], attrs[g]) for g in GENERATIONS]

    def longest(_options: CallbackOptions) -> Iterable[Observation]:
        return [Observation(s, attrs[g]) for g, s in enumerate(pauses.take_longest())]

    meter.create_observable_counter(
        "thunderagent_gc_pause_seconds",
        callbacks=[totals],
        unit="s",
        description="Time the process was stopped by cyclic GC collections",
    )
    meter.create_observable_gauge(
        "thunderagent_gc_pause_max_seconds",
        callbacks=[longest],
        description="Longest GC pause since the previous scrape",
    )
    gc.callbacks.append(pauses.on_gc)
    return lambda: gc.callbacks.remove(pauses.on_gc)
