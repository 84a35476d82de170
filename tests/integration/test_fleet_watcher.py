"""The fleet watcher over real NATS: a service callback that raises is logged, and the watcher
goes on applying registrations (it used to end the service's task group)."""

from __future__ import annotations

import asyncio
import time

import msgspec
import pytest

from thunderagent.bus import Bus, connect
from thunderagent.fleet import WorkerRegistry
from thunderagent.schemas import WorkerRegistration, subjects
from thunderagent.shell import FleetWatcher
from thunderagent.shell.fleet import workers_bucket

pytestmark = pytest.mark.integration


def _registration(worker_id: str) -> bytes:
    reg = WorkerRegistration(worker_id=worker_id, model="m", engine_url="http://127.0.0.1:1",
                             block_size=16, kv_capacity_blocks=100, lease_s=30.0,
                             registered_at=time.time())  # fmt: skip
    return msgspec.json.encode(reg)


async def test_a_failing_fleet_callback_does_not_stop_the_watcher(nats_server):
    nc = await connect(nats_server.url, name="fleet-test")
    bus = Bus(nc, service="fleet-test")
    seen: list[str] = []

    def on_change(worker_id: str, what: str) -> None:
        seen.append(f"{worker_id} {what}")
        if worker_id == "w0":
            raise RuntimeError("a bug in the service's callback")

    registry = WorkerRegistry()
    watcher = FleetWatcher(bus, registry, on_change=on_change)
    stop = asyncio.Event()
    task = asyncio.create_task(watcher.run(stop))
    try:
        await asyncio.wait_for(watcher.ready.wait(), 10)
        bucket = await workers_bucket(bus)
        await bucket.put(subjects.worker_key("w0"), _registration("w0"))
        await bucket.put(subjects.worker_key("w1"), _registration("w1"))
        for _ in range(200):
            if "w1" in registry:
                break
            await asyncio.sleep(0.02)
        assert not task.done(), "the watcher must outlive its callback's failure"
        assert seen == ["w0 registered", "w1 registered"]
        assert "w0" in registry and "w1" in registry
    finally:
        stop.set()
        await asyncio.wait_for(task, 5)
        await nc.close()
