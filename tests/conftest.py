"""Fixtures that start real servers on free loopback ports (and stop them)."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

from thunderagent.embedded import NatsServer, RedisServer
from thunderagent.embedded.ports import PORTS_ENV, ports_allowed


def _own_ports_per_runner() -> None:
    """Under pytest-xdist each runner picks ports from its own slice of the range (stacks it
    starts inherit it): a port one runner picked, not yet bound, looks free to the other."""
    runner = os.environ.get("PYTEST_XDIST_WORKER")
    runners = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if not runner or not runners or os.environ.get(PORTS_ENV):
        return
    low, high = 10_000, 32_768  # below the kernel's usual ephemeral range
    width = (high - low) // int(runners)
    first = low + int(runner.removeprefix("gw")) * width
    os.environ[PORTS_ENV] = f"{first}-{first + width}"
    ports_allowed()  # a malformed value fails here, not in the first test


_own_ports_per_runner()

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
