"""Bring docker-compose.yml up for real, send one request through it, tear it down.

Needs a Docker engine with the compose plugin; skipped (with the reason) where none answers.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from thunderagent.embedded import free_port

pytestmark = [pytest.mark.docker, pytest.mark.slow, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[2]
CLIENT_PASSWORD = "client-dev-password"  # docker-compose.yml's default for NATS_CLIENT_PASSWORD


def _docker_unavailable() -> str | None:
    if shutil.which("docker") is None:
        return "no Docker engine: the `docker` CLI is not installed"
    for argv in (["docker", "info"], ["docker", "compose", "version"]):
        try:
            probe = subprocess.run(argv, capture_output=True, text=True, timeout=20)
        except (OSError, subprocess.TimeoutExpired) as err:
            return f"no Docker engine: `{' '.join(argv)}` failed: {err}"
        if probe.returncode != 0:
            detail = (probe.stderr or probe.stdout).strip().splitlines()
            return f"no Docker engine: `{' '.join(argv)}` failed: {detail[0] if detail else ''}"
    return None


@pytest.fixture
def compose_stack() -> Iterator[tuple[list[str], int]]:
    reason = _docker_unavailable()
    if reason:
        pytest.skip(reason)
    nats_port = free_port()
    env = {**os.environ, "NATS_HOST_PORT": str(nats_port),
           "NATS_MONITOR_HOST_PORT": str(free_port()),
           "NATS_CLIENT_PASSWORD": CLIENT_PASSWORD}  # fmt: skip
    base = ["docker", "compose", "-f", str(ROOT / "docker-compose.yml"),
            "-p", f"thunderagent-test-{uuid.uuid4().hex[:8]}"]  # fmt: skip
    up = subprocess.run([*base, "up", "-d", "--build"], env=env, cwd=ROOT,
                        capture_output=True, text=True, timeout=600)  # fmt: skip
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        yield base, nats_port
    finally:
        logs = subprocess.run([*base, "logs", "--no-color", "--tail", "50"], env=env, cwd=ROOT,
                              capture_output=True, text=True, timeout=60)  # fmt: skip
        print(logs.stdout[-20000:])
        subprocess.run([*base, "down", "-v", "--remove-orphans"], env=env, cwd=ROOT,
                       capture_output=True, timeout=300)  # fmt: skip


def test_compose_stack_answers_a_request(compose_stack):
    _, nats_port = compose_stack
    url = f"nats://client:{CLIENT_PASSWORD}@127.0.0.1:{nats_port}"
    final = asyncio.run(_one_request(url))
    assert final.worker_id in {"w0", "w1"}
    assert final.usage.completion_tokens == 8


async def _one_request(url: str):
    from thunderagent.client import RequestFailed, ThunderClient
    from thunderagent.schemas import ErrorCode, FinalReply, GenerateRequest

    give_up_at = time.monotonic() + 180
    while True:  # the services retry NATS themselves; the client may be early too
        try:
            client = await ThunderClient.connect(url, idle_timeout_s=30)
            break
        except ConnectionError:
            if time.monotonic() > give_up_at:
                raise
            await asyncio.sleep(1)
    try:
        while True:
            request = GenerateRequest(model="sim/llama-3.1-8b", text="Hello, ThunderAgent",
                                      max_tokens=8)  # fmt: skip
            try:
                done = await client.generate(request)
            except RequestFailed as err:
                retry = (ErrorCode.UNKNOWN_MODEL, ErrorCode.UNAVAILABLE)
                if err.error.code not in retry or time.monotonic() > give_up_at:
                    raise
                await asyncio.sleep(1)
                continue
            assert isinstance(done.final, FinalReply)
            return done.final
    finally:
        await client.close()
