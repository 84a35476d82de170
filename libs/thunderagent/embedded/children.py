"""Child processes that cannot outlive their parent.

Each child runs in its own session and gets ``PR_SET_PDEATHSIG = SIGTERM`` (Linux), so even a
parent killed with SIGKILL leaves no orphan; a normal stop sends SIGTERM, then SIGKILL after a
grace period.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    # Own process group: a terminal's Ctrl-C reaches only the parent, which then stops the
    # children in order (services before the servers they need) instead of all at once.
    os.setsid()
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


@dataclass
class ChildProcess:
    name: str
    popen: subprocess.Popen
    log_path: Path | None = None
    env: dict[str, str] | None = None
    """What ``spawn`` added to the environment (``respawn`` gives the same)."""

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def stop(self, grace_s: float = 5.0) -> int | None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(grace_s)
            except subprocess.TimeoutExpired:
                log.warning("%s (pid %d) ignored SIGTERM; killing", self.name, self.pid)
                self.popen.kill()
                self.popen.wait()
        return self.popen.returncode

    def respawn(self) -> ChildProcess:
        """The same command again (same log, appended), once this one has exited."""
        return spawn(self.name, list(self.popen.args), log_path=self.log_path, env=self.env)

    def tail(self, lines: int = 20) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])


def spawn(
    name: str,
    argv: list[str],
    *,
    log_path: Path | None = None,
    env: dict[str, str] | None = None,
) -> ChildProcess:
    """Start ``argv``; stdout and stderr go to ``log_path`` (or are inherited when None)."""
    out = open(log_path, "ab") if log_path is not None else None
    try:
        popen = subprocess.Popen(
            argv,
            stdout=out,
            stderr=subprocess.STDOUT if out else None,
            stdin=subprocess.DEVNULL,
            env={**os.environ, **(env or {})},
            preexec_fn=_die_with_parent,
        )
    finally:
        if out is not None:
            out.close()
    return ChildProcess(name=name, popen=popen, log_path=log_path, env=env)
