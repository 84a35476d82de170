"""Sample running service processes with ``py-spy record`` (PyPI ``py-spy``) and boil the
collapsed stacks down to self time: the top functions of each process and the share of each
step of the request path (decode, tracing, nats-py, HTTP, asyncio, hashing, routing ...).

A step is named from the innermost Python frame of a sample. Time inside a C extension (msgspec,
xxhash) counts for the Python function that called it, so ``bus`` covers msgspec encoding and
decoding, and a socket write counts for nats-py's ``writelines``. nats-py talks to its socket
through asyncio streams and hands messages to subscriptions through asyncio queues: both count
as nats-py.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

STEPS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("tracing", ("opentelemetry/trace", "opentelemetry/sdk/trace", "opentelemetry/propagat",
                 "opentelemetry/context", "opentelemetry/baggage", "opentelemetry/util",
                 "thunderagent/telemetry/")),
    ("metrics", ("opentelemetry/sdk/metrics", "opentelemetry/metrics", "prometheus_client/")),
    ("nats-py (parser, messages, subscription queues, socket writes)",
     ("/nats/", "asyncio/streams.py", "asyncio/queues.py")),
    ("HTTP (aiohttp, yarl, multidict)", ("/aiohttp/", "/yarl/", "/multidict/")),
    ("asyncio (tasks, futures, timeouts, events)", ("/asyncio/", "/uvloop/")),
    ("stdlib json", ("/json/",)),
    ("logging", ("/logging/",)),
    ("tokenize", ("thunderagent/tokenizer/",)),
    ("hash", ("thunderagent/hashing/", "thunderagent/sglang/kv_wire", "hashlib")),
    ("index / route / rank", ("thunderagent/prefix_index/", "thunderagent/routing/",
                              "thunderagent/router_core/", "thunderagent/plugins/")),
    ("schedule", ("thunderagent/scheduling/",)),
    ("bus (msgspec encode/decode, dispatch)", ("thunderagent/bus/",)),
    ("client reply mux", ("thunderagent/client/",)),
    ("simulated engine", ("thunderagent/engine/", "thunderagent/simengine/", "/zmq/")),
    ("fleet view", ("thunderagent/fleet/", "thunderagent/shell/")),
    ("worker adapter", ("thunderagent/worker/",)),
    ("router shell", ("thunderagent/router/",)),
    ("scheduler shell", ("thunderagent/scheduler/",)),
    ("index service", ("thunderagent/index/",)),
    ("migration service", ("thunderagent/migrator/", "thunderagent/migration/")),
    ("redis client", ("/redis/",)),
    ("schemas", ("thunderagent/schemas/",)),
)  # fmt: skip
"""(step, path fragments of the innermost frame's file); the first match names the step."""

_FRAME = re.compile(r"^(?P<func>.*) \((?P<file>.*):(?P<line>\d+)\)$")


def available() -> str | None:
    """The py-spy executable next to this Python, or on PATH; None when missing."""
    here = Path(sys.executable).with_name("py-spy")
    return str(here) if here.exists() else shutil.which("py-spy")


def step_of(file: str) -> str:
    path = file.replace("\\", "/")
    for step, fragments in STEPS:
        if any(f in path for f in fragments):
            return step
    return "other"


def _short(func: str, file: str) -> str:
    """``func (package/module.py)``: the last three path parts are enough to find it."""
    parts = file.replace("\\", "/").split("/")
    if "site-packages" in parts:
        parts = parts[parts.index("site-packages") + 1 :]
    elif "thunderagent" in parts:
        parts = parts[len(parts) - 1 - parts[::-1].index("thunderagent") :]
    return f"{func} ({'/'.join(parts[-3:])})"


OUTSIDE_PYTHON = ("Runner.run", "run_until_complete", "run_forever")
"""Innermost frames that mean no Python code was running: uvloop's C loop (its socket I/O and
callbacks' bookkeeping), a syscall, or (py-spy counts a runnable thread as busy) waiting for a
core. perf splits that time; these samples are left out of the step shares."""


@dataclass
class Profile:
    samples: int
    top: list[tuple[str, float]]
    """(function, % of Python samples as the innermost frame), largest first."""
    steps: dict[str, float]
    """step -> % of the samples with Python code running."""
    outside_python_pct: float = 0.0
    """% of all samples with no Python frame running (see ``OUTSIDE_PYTHON``)."""

    def as_json(self) -> dict:
        return {
            "samples": self.samples,
            "outside_python_pct": self.outside_python_pct,
            "steps_pct": self.steps,
            "top_self_pct": [[name, pct] for name, pct in self.top],
        }


def parse_collapsed(text: str, top: int = 12) -> Profile:
    """Self time per function and per step from py-spy's ``--format raw`` output."""
    by_func: Counter[str] = Counter()
    by_step: Counter[str] = Counter()
    total = outside = 0
    for line in text.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        total += n
        leaf = stack.rsplit(";", 1)[-1]
        m = _FRAME.match(leaf)
        func, file = (m["func"], m["file"]) if m else (leaf, "")
        if func in OUTSIDE_PYTHON:
            outside += n
            continue
        by_func[_short(func, file)] += n
        by_step[step_of(file)] += n
    inside = total - outside
    if not inside:
        return Profile(total, [], {}, 100.0 if total else 0.0)

    def pct(n: int) -> float:
        return round(100 * n / inside, 1)

    return Profile(
        samples=total,
        top=[(name, pct(n)) for name, n in by_func.most_common(top)],
        steps={step: pct(n) for step, n in by_step.most_common()},
        outside_python_pct=round(100 * outside / total, 1),
    )


def start(exe: str, pid: int, seconds: float, out: Path, rate: int) -> subprocess.Popen:
    """``py-spy record`` on ``pid`` for ``seconds`` (non-blocking: the target is not paused)."""
    argv = [exe, "record", "--pid", str(pid), "--duration", str(max(1, round(seconds))),
            "--rate", str(rate), "--format", "raw", "--full-filenames", "--nonblocking",
            "--output", str(out)]  # fmt: skip
    return subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def finish(proc: subprocess.Popen, out: Path, timeout_s: float) -> Profile | str:
    """The profile, or why there is none (py-spy's own error line)."""
    try:
        _, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        return "py-spy did not finish"
    if not out.exists():
        lines = (err or b"").decode(errors="replace").strip().splitlines()
        return lines[-1] if lines else "py-spy wrote no output"
    return parse_collapsed(out.read_text(errors="replace"))
