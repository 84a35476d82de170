"""Fixtures that start real servers on free loopback ports (and stop them)."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from thunderagent.embedded import NatsServer, RedisServer


@pytest.fixture
def nats_server(tmp_path: Path) -> Iterator[NatsServer]:
    server = NatsServer(tmp_path / "nats").start()
    yield server
    server.stop()


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    if shutil.which("redis-server") is None:
        pytest.fail(
            "redis-server is not installed (apt-get install redis-server); .ci/run installs it"
        )
    server = RedisServer(tmp_path / "redis").start()
    yield server
    server.stop()
