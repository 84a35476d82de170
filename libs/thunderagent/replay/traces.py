"""Trace loaders: Mooncake JSONL (prefix-structured) and the Azure 2023 CSV (lengths only).

Both give ``TraceRequest``s in arrival order (stable on equal timestamps), arrival times in
seconds from the first request. A malformed line raises ``TraceError`` naming the file and the
1-based line number; nothing is skipped silently.
"""

from __future__ import annotations

import csv
import json
import random
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Final

AZURE_ID_BASE: Final = 1 << 48
"""Azure traces carry no prefixes: each request gets fresh block ids from here up, far above any
Mooncake id, so no two requests ever share a block."""


class TraceError(ValueError):
    """A trace line could not be read; ``path`` and ``line`` (1-based; 0: the file itself) say
    where."""

    def __init__(self, path: Path | str, line: int, reason: str) -> None:
        super().__init__(f"{path}:{line}: {reason}" if line else f"{path}: {reason}")
        self.path = str(path)
        self.line = line
        self.reason = reason


@dataclass(slots=True)
class TraceRequest:
    """One request of a trace: what arrives when, and which prompt blocks it carries."""

    request_id: str
    arrival: float
    """Seconds since the trace's first request."""
    prompt_len: int
    output_len: int
    block_ids: list[int]
    """One id per ``block_size`` prompt tokens (the last may be partial); equal leading ids mean
    equal prefixes."""
    session: str | None = None
    """Program / session id when the trace has one (multi-turn agents)."""
    step: int | None = None
    priority: int = 0
    """Scheduling class (0 most urgent); generated workloads set it, trace files do not."""
    deadline: float | None = None
    """Absolute deadline on the replay clock (None: none)."""
    expected_output: int | None = None
    """The client's output-length estimate; None: the router's running mean is used."""
    hot: bool = False
    """Marked ``"hot": true`` in the trace (a generated hot-spot request); replay ignores it."""


def _int(row: dict, key: str, low: int) -> int:
    value = row[key]
    if isinstance(value, bool) or not isinstance(value, int | float) or value != int(value):
        raise ValueError(f"{key!r} must be an integer, got {value!r}")
    if value < low:
        raise ValueError(f"{key!r} must be >= {low}, got {value!r}")
    return int(value)


def _mooncake_row(i: int, row: object, block_size: int) -> TraceRequest:
    if not isinstance(row, dict):
        raise ValueError(f"expected a JSON object, got {type(row).__name__}")
    for key in ("timestamp", "input_length", "output_length", "hash_ids"):
        if key not in row:
            raise ValueError(f"missing field {key!r}")
    ts = row["timestamp"]
    if isinstance(ts, bool) or not isinstance(ts, int | float) or ts < 0:
        raise ValueError(f"'timestamp' must be a number >= 0 (ms), got {ts!r}")
    ids = row["hash_ids"]
    if not isinstance(ids, list) or not all(
        isinstance(h, int) and not isinstance(h, bool) and 0 <= h < 1 << 64 for h in ids
    ):
        raise ValueError("'hash_ids' must be a list of unsigned 64-bit integers")
    prompt = _int(row, "input_length", 1)
    if len(ids) > -(-prompt // block_size):  # every trace we know has exactly this many
        raise ValueError(
            f"{len(ids)} hash_ids for {prompt} prompt tokens: more than one per "
            f"{block_size}-token block (the replay's --block-size)"
        )
    session = row.get("program_id", row.get("session_id"))
    step = row.get("step")
    return TraceRequest(
        request_id=str(i),
        arrival=ts / 1000.0,
        prompt_len=prompt,
        output_len=max(1, _int(row, "output_length", 0)),
        block_ids=ids,
        session=None if session is None else str(session),
        step=None if step is None else int(step),
        hot=row.get("hot") is True,
    )


def load_mooncake(
    path: Path | str, limit: int | None = None, block_size: int = 512
) -> list[TraceRequest]:
    """Mooncake JSONL: ``timestamp`` (ms), ``input_length``, ``output_length``, ``hash_ids``
    (at most one per ``block_size`` prompt tokens); optional ``program_id``/``session_id`` and
    ``step``. Blank lines are skipped."""
    path = Path(path)
    out: list[TraceRequest] = []
    with path.open() as fh:
        for lineno, line in enumerate(fh, 1):
            if limit is not None and len(out) >= limit:
                break
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:  # its own "line 2" would count the newline
                reason = f"not JSON: {err.msg} at column {err.colno}"
                raise TraceError(path, lineno, reason) from None
            try:
                out.append(_mooncake_row(len(out), row, block_size))
            except (ValueError, TypeError) as err:
                raise TraceError(path, lineno, str(err)) from None
    return _ordered(out)


def _azure_time(text: str) -> float:
    """``2023-11-16 18:17:03.9799600`` (7 fractional digits; datetime takes at most 6)."""
    stamp, _, frac = text.strip().partition(".")
    base = datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S").replace(tzinfo=UTC).timestamp()
    if frac and not frac.isdigit():
        raise ValueError(f"bad fractional seconds in {text!r}")
    return base + (int(frac) / 10 ** len(frac) if frac else 0.0)


def load_azure(
    path: Path | str, limit: int | None = None, block_size: int = 512
) -> list[TraceRequest]:
    """Azure LLM inference trace 2023 CSV: ``TIMESTAMP, ContextTokens, GeneratedTokens``.
    No prefix information: every request gets its own block ids (nothing is shared)."""
    path = Path(path)
    out: list[TraceRequest] = []
    next_id = AZURE_ID_BASE
    t0: float | None = None
    with path.open(newline="") as fh:
        reader = csv.reader(fh)
        header = next(reader, None)
        want = ["TIMESTAMP", "ContextTokens", "GeneratedTokens"]
        if header is None or [h.strip() for h in header] != want:
            raise TraceError(path, 1, f"expected header {','.join(want)}, got {header!r}")
        for row in reader:
            if limit is not None and len(out) >= limit:
                break
            lineno = reader.line_num
            if not row or not "".join(row).strip():
                continue
            try:
                if len(row) != 3:
                    raise ValueError(f"expected 3 columns, got {len(row)}")
                t = _azure_time(row[0])
                prompt, output = int(row[1]), int(row[2])
                if prompt < 1 or output < 0:
                    raise ValueError(f"bad lengths {prompt}, {output}")
            except ValueError as err:
                raise TraceError(path, lineno, str(err)) from None
            t0 = t if t0 is None else t0
            n = -(-prompt // block_size)
            ids = list(range(next_id, next_id + n))
            next_id += n
            out.append(TraceRequest(str(len(out)), t - t0, prompt, max(1, output), ids))
    return _ordered(out)


def _ordered(requests: list[TraceRequest]) -> list[TraceRequest]:
    """Arrival order (stable), times shifted so the first request arrives at 0."""
    requests.sort(key=lambda r: r.arrival)
    if requests and requests[0].arrival:
        t0 = requests[0].arrival
        for r in requests:
            r.arrival -= t0
    return requests


def jitter_arrivals(trace: list[TraceRequest], jitter_s: float, seed: int) -> list[TraceRequest]:
    """``trace`` with every arrival moved by a uniform draw in ``[-jitter_s, jitter_s]`` (seeded),
    in arrival order again; a session's requests keep their order. A replay near a capacity edge
    is chaotic (one decision made differently re-deals every later one), so one run's p99 says
    little about a change: the spread over a few jittered copies of the same trace is the yardstick.
    """
    if jitter_s <= 0:
        return list(trace)
    rng = random.Random(seed)
    last: dict[str, float] = {}
    out = []
    for r in trace:
        t = max(0.0, r.arrival + rng.uniform(-jitter_s, jitter_s))
        if r.session is not None:
            t = last[r.session] = max(t, last.get(r.session, 0.0))
        out.append(replace(r, arrival=t))
    out.sort(key=lambda r: r.arrival)
    return out


def load_trace(
    path: Path | str, limit: int | None = None, block_size: int = 512
) -> list[TraceRequest]:
    """By extension: ``.csv`` is Azure, anything else Mooncake JSONL. A file that cannot be
    read (missing, a directory, not text) is a ``TraceError`` (line 0), like a bad line."""
    path = Path(path)
    try:
        if path.suffix.lower() == ".csv":
            return load_azure(path, limit, block_size)
        return load_mooncake(path, limit, block_size)
    except (OSError, UnicodeDecodeError) as err:
        reason = err.strerror if isinstance(err, OSError) and err.strerror else str(err)
        raise TraceError(path, 0, f"cannot read the trace: {reason}") from None
