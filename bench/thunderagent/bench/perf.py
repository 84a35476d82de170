"""On-CPU samples of a process with Linux ``perf record``: where its CPU time goes below Python
(the kernel's socket and scheduler work, the interpreter, uvloop, msgspec, libc, ZMQ).

py-spy sees Python frames but counts a runnable thread waiting for a core as busy; perf samples
only time actually on a CPU, so on a shared machine it is the honest split of the CPU time, and
py-spy says which Python code the interpreter's share belongs to.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

GROUPS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("kernel (syscalls: sockets, epoll, scheduler)", ("[kernel",)),
    ("Python interpreter", ("libpython", "python3")),
    ("uvloop / libuv", ("uvloop", "loop.cpython", "libuv")),
    ("msgspec", ("msgspec", "_core.cpython")),
    ("libc / libm", ("libc.so", "libc-", "libm.so", "ld-linux")),
    ("ZMQ", ("zmq", "libzmq")),
    ("aiohttp / yarl / multidict C parts", ("aiohttp", "_http_parser", "_websocket", "yarl",
                                           "multidict", "propcache")),
    ("xxhash / hashlib / OpenSSL", ("xxhash", "_hashlib", "libcrypto", "libssl")),
    ("nats-server (Go)", ("nats-server",)),
)  # fmt: skip
"""(group, fragments of the shared object's name); the first match names the group."""

_LINE = re.compile(r"^\s*(?P<pct>[\d.]+)%\s+(?P<rest>.+?)\s*$")


def available() -> str | None:
    return shutil.which("perf")


def group_of(dso: str) -> str:
    for group, fragments in GROUPS:
        if any(f in dso for f in fragments):
            return group
    return "other"


def start(exe: str, pid: int, seconds: float, out: Path, freq: int = 499) -> subprocess.Popen:
    argv = [exe, "record", "-F", str(freq), "-p", str(pid), "-o", str(out), "--quiet",
            "--", "sleep", f"{seconds:.1f}"]  # fmt: skip
    return subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def _report(exe: str, data: Path, sort: str) -> list[tuple[float, str]]:
    argv = [exe, "report", "-i", str(data), "--stdio", "--no-children", "--sort", sort,
            "--percent-limit", "0.3"]  # fmt: skip
    out = subprocess.run(argv, capture_output=True, text=True, timeout=120).stdout
    rows = []
    for line in out.splitlines():
        if line.startswith("#"):
            continue
        m = _LINE.match(line)
        if m:
            rows.append((float(m["pct"]), m["rest"]))
    return rows


def finish(exe: str, proc: subprocess.Popen, data: Path, timeout_s: float) -> dict:
    """Share of on-CPU samples per group and the top symbols; ``error`` when perf failed."""
    try:
        _, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        return {"error": "perf did not finish"}
    if not data.exists():
        lines = (err or b"").decode(errors="replace").strip().splitlines()
        return {"error": lines[-1] if lines else "perf wrote no data"}
    groups: dict[str, float] = {}
    for pct, dso in _report(exe, data, "dso"):
        key = group_of(dso)
        groups[key] = round(groups.get(key, 0.0) + pct, 1)
    top = [[" ".join(rest.split()), pct] for pct, rest in _report(exe, data, "dso,sym")[:15]]
    data.unlink(missing_ok=True)  # megabytes per process and run; the summary is what is kept
    return {
        "groups_pct": dict(sorted(groups.items(), key=lambda kv: -kv[1])),
        "top_symbols_pct": top,
    }
