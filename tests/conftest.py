"""Fixtures that start real servers on free loopback ports (and stop them)."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

from thunderagent.embedded import NatsServer, RedisServer

# CI machines are small and shared: no per-example deadline, a fixed example budget.
settings.register_profile(
    "ci", deadline=None, max_examples=100, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile("dev", deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))


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
