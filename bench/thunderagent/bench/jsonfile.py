"""Benchmark results written as strict JSON: a figure that is not a finite number (the
percentile of nothing, the TTFT of a request a bounded run left unanswered) is written as
``null``, which every JSON reader accepts, where ``json.dumps`` would write ``NaN`` or
``Infinity`` (Python reads those back, ``jq`` and most other readers refuse them)."""

from __future__ import annotations

import json
import math
from pathlib import Path


def finite(obj: object) -> object:
    """``obj`` with every non-finite float replaced by None (containers copied)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [finite(v) for v in obj]
    return obj


def dumps(doc: object, indent: int | None = 2) -> str:
    """``doc`` as strict JSON text: what the benchmarks print and write."""
    return json.dumps(finite(doc), indent=indent, allow_nan=False)


def write_json(path: str | Path, doc: object, indent: int = 2) -> None:
    """Write ``doc`` to ``path`` (folders made) as strict JSON, one trailing newline."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(dumps(doc, indent) + "\n")
