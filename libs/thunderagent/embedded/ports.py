"""Free loopback ports and readiness polling."""

from __future__ import annotations

import socket
import time


def free_port(host: str = "127.0.0.1") -> int:
    """A port the OS reports free now (a race with other processes is possible but rare)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def preferred_port(port: int, host: str = "127.0.0.1") -> int:
    """``port`` when it is free (so clients find the server at its usual address), else any."""
    return port if port_is_free(port, host) else free_port(host)


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
