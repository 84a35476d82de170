"""The one percentile helper every report uses (replay, benchmarks, the demo).

Percentiles are on the 0..100 scale and interpolate linearly between closest ranks (numpy's
default), so a p99 over 100 samples is not simply the largest one.
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100); NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    if ordered[hi] == ordered[lo]:  # also keeps inf (a request that never answered) as inf
        return ordered[lo]
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def summary(values: Sequence[float], scale: float = 1.0, digits: int | None = None) -> dict:
    """p50 / p90 / p99 / mean of ``values`` times ``scale`` (e.g. 1000: seconds -> ms),
    rounded to ``digits`` when given; NaN everywhere for no values."""
    scaled = [v * scale for v in values]
    out = {
        "p50": percentile(scaled, 50),
        "p90": percentile(scaled, 90),
        "p99": percentile(scaled, 99),
        "mean": sum(scaled) / len(scaled) if scaled else math.nan,
    }
    return {k: round(v, digits) for k, v in out.items()} if digits is not None else out
