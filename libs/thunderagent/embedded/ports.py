"""Free loopback ports and readiness polling."""

from __future__ import annotations

import os
import random
import socket
import time
from collections import deque
from pathlib import Path

_LOWEST = 10_000
_EPHEMERAL = Path("/proc/sys/net/ipv4/ip_local_port_range")
PORTS_ENV = "THUNDERAGENT_PORTS"
"""``LOW-HIGH``: every port this process and the stacks it starts choose for themselves comes
from ``[LOW, HIGH)``, the usual ones (NATS's 4222, the gateway's 8000) included. Two test runners
on one machine each get their own range (``tests/conftest.py``): a port one of them picked, not
yet bound, still looks free to the other."""

_handed_out: deque[int] = deque(maxlen=1024)
"""Ports this process handed out lately: a caller often takes several before it binds any (an
engine's two KV-event sockets, a stack's servers), and a port not bound yet still looks free,
so the same port could be handed out twice (one bind then failed "address already in use")."""


def free_port(host: str = "127.0.0.1") -> int:
    """A port free now, for a child process to bind later. Chosen below the kernel's ephemeral
    range: a port from that range (what binding port 0 gives) can be handed to another socket
    before the child binds it, e.g. an engine's KV-event socket bound to ``*`` or an outgoing
    connection, and a stack start then failed with "address already in use"."""
    confined = ports_allowed()
    low, top = confined or (_LOWEST, _ephemeral_start())
    pick = random.SystemRandom()
    for _ in range(100 if top > low + 1000 or confined else 0):
        port = pick.randrange(low, top)
        if port not in _handed_out and port_is_free(port, host):
            _handed_out.append(port)
            return port
    if confined:
        raise RuntimeError(f"no free port in {PORTS_ENV}={os.environ[PORTS_ENV]} after 100 tries")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def ports_allowed() -> tuple[int, int] | None:
    """``[low, high)`` from ``THUNDERAGENT_PORTS``, None when it is not set."""
    text = os.environ.get(PORTS_ENV, "").strip()
    if not text:
        return None
    try:
        low, high = (int(part) for part in text.split("-"))
    except ValueError:
        raise ValueError(f"{PORTS_ENV}={text!r}: expected LOW-HIGH, e.g. 20000-21000") from None
    if not 1024 <= low < high <= 65536:
        raise ValueError(f"{PORTS_ENV}={text!r}: expected 1024 <= LOW < HIGH <= 65536")
    return low, high


def _ephemeral_start() -> int:
    try:
        return int(_EPHEMERAL.read_text().split()[0])
    except (OSError, ValueError, IndexError):  # not Linux: the usual start of the range
        return 32_768


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def preferred_port(port: int, host: str = "127.0.0.1") -> int:
    """``port`` when it is free (so clients find the server at its usual address) and allowed
    (``THUNDERAGENT_PORTS``), else any."""
    confined = ports_allowed()
    allowed = confined is None or confined[0] <= port < confined[1]
    return port if allowed and port_is_free(port, host) else free_port(host)


def wait_for_port(port: int, *, host: str = "127.0.0.1", timeout_s: float = 15.0) -> None:
    """Block until something accepts TCP connections on ``host:port``."""
    give_up_at = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return
        except OSError:
            if time.monotonic() > give_up_at:
                raise TimeoutError(f"nothing listens on {host}:{port} after {timeout_s}s") from None
            time.sleep(0.02)
