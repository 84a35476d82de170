"""CPU time of the processes under test, read from the kernel: what each service spends per
request, independent of how the latency came out.

``/proc/<pid>/task/<tid>/schedstat`` gives each thread's time on a CPU in nanoseconds (the
``utime``/``stime`` ticks of ``/proc/<pid>/stat`` are 10 ms coarse); a process's figure is the sum
over its threads and over its children (a launcher that forks the real server counts whole).
Threads or children that exit between two readings take their time with them, so the services
measured here are long-lived ones.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import psutil


def thread_schedstat(pid: int) -> tuple[int, int]:
    """(on-CPU nanoseconds, times put on a CPU) of every live thread of ``pid`` ((0, 0) when it
    is gone). The second is the kernel's count of timeslices: each wake-up to handle a message
    is one, so per request it counts how often the process was woken."""
    ns = runs = 0
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return 0, 0
    for tid in tids:
        try:
            fields = Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()
            ns, runs = ns + int(fields[0]), runs + int(fields[2])
        except (OSError, ValueError, IndexError):
            continue
    return ns, runs


def tree_pids(pid: int) -> list[int]:
    """``pid`` and its descendants."""
    try:
        proc = psutil.Process(pid)
        return [pid, *(c.pid for c in proc.children(recursive=True))]
    except psutil.Error:
        return [pid]


def tree_schedstat(pid: int) -> tuple[int, int]:
    """``thread_schedstat`` summed over ``pid`` and its descendants."""
    ns = runs = 0
    for p in tree_pids(pid):
        n, r = thread_schedstat(p)
        ns, runs = ns + n, runs + r
    return ns, runs


def user_sys_ticks(pid: int) -> tuple[int, int]:
    """(user, kernel) clock ticks of ``pid`` and its descendants (``/proc/<pid>/stat``): only
    their ratio is used, the ticks being coarse."""
    user = system = 0
    for p in tree_pids(pid):
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
            user, system = user + int(fields[11]), system + int(fields[12])
        except (OSError, ValueError, IndexError):
            continue
    return user, system


@dataclass
class CpuMeter:
    """CPU nanoseconds per named process tree between :meth:`start` and :meth:`stop`."""

    pids: Mapping[str, int]
    own: bool = True
    """Also measure this process (the load generator) as ``"loadgen"``."""
    _start: dict[str, int] = field(default_factory=dict)
    _ticks: dict[str, tuple[int, int]] = field(default_factory=dict)
    used_ns: dict[str, int] = field(default_factory=dict)
    kernel_share: dict[str, float] = field(default_factory=dict)
    """Share of each process's CPU time spent in the kernel (syscalls: sockets, epoll)."""
    _start_runs: dict[str, int] = field(default_factory=dict)
    runs: dict[str, int] = field(default_factory=dict)
    """Times each process was put on a CPU (``thread_schedstat``), the load generator too."""

    def _read(self) -> tuple[dict[str, int], dict[str, int]]:
        """(CPU ns, times put on a CPU) per process, each read once from the kernel."""
        stats = {name: tree_schedstat(pid) for name, pid in self.pids.items()}
        if self.own:
            stats["loadgen"] = (time.process_time_ns(), tree_schedstat(os.getpid())[1])
        return {k: v[0] for k, v in stats.items()}, {k: v[1] for k, v in stats.items()}

    def start(self) -> None:
        self._ticks = {name: user_sys_ticks(pid) for name, pid in self.pids.items()}
        self._start, self._start_runs = self._read()

    def stop(self) -> dict[str, int]:
        end, runs = self._read()
        self.used_ns = {name: max(0, end[name] - self._start.get(name, 0)) for name in end}
        self.runs = {name: max(0, runs[name] - self._start_runs.get(name, 0)) for name in runs}
        for name, pid in self.pids.items():
            user, system = user_sys_ticks(pid)
            u0, s0 = self._ticks.get(name, (0, 0))
            total = (user - u0) + (system - s0)
            self.kernel_share[name] = round((system - s0) / total, 2) if total > 0 else 0.0
        return self.used_ns


def per_request(
    used: Mapping[str, float],
    requests: int,
    *,
    idle_per_s: Mapping[str, float] | None = None,
    seconds: float = 0.0,
    unit: float = 1.0,
    digits: int = 2,
) -> dict[str, float]:
    """Each process's count per request (in ``unit``s), less what it does idle over the same
    ``seconds`` (load reports, leases, timers) when an idle rate is given."""
    idle = idle_per_s or {}
    return {
        name: round(max(0.0, n - idle.get(name, 0.0) * seconds) / max(1, requests) / unit, digits)
        for name, n in used.items()
    }


def per_request_us(
    used_ns: Mapping[str, int],
    requests: int,
    *,
    idle_ns_per_s: Mapping[str, float] | None = None,
    seconds: float = 0.0,
) -> dict[str, float]:
    """CPU µs per request of each process, less its idle CPU (``per_request``)."""
    return per_request(
        used_ns, requests, idle_per_s=idle_ns_per_s, seconds=seconds, unit=1e3, digits=1
    )


def group(per_process: Mapping[str, float], groups: Iterable[tuple[str, str]]) -> dict:
    """Sum processes into services by name prefix: ``[("worker", "worker-"), ...]``; a process
    no prefix matches keeps its own name."""
    out: dict[str, float] = {}
    rules = list(groups)
    for name, value in per_process.items():
        key = next((g for g, prefix in rules if name.startswith(prefix)), name)
        out[key] = round(out.get(key, 0.0) + value, 1)
    return out
