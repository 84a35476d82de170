"""Background tasks: a failure is logged when it happens, with its traceback, and counted."""

from __future__ import annotations

import asyncio
import logging

from thunderagent.shell import TaskSet


async def test_a_failing_task_is_logged_at_once_and_the_others_are_not() -> None:
    tasks = TaskSet("svc")
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    logger = logging.getLogger("thunderagent.shell.tasks")
    handler = Keep()
    logger.addHandler(handler)
    try:

        async def boom() -> None:
            raise ValueError("lost")

        done = asyncio.Event()

        async def fine() -> None:
            done.set()

        sleeper = tasks.spawn(asyncio.sleep(60), name="sleeper")
        tasks.spawn(boom(), name="boom")
        tasks.spawn(fine())
        await done.wait()
        await asyncio.sleep(0)
        assert len(tasks) == 1, "ended tasks are dropped; the sleeper is still held"
        tasks.cancel()
        await tasks.wait(1.0)
        assert sleeper.cancelled() and len(tasks) == 0
    finally:
        logger.removeHandler(handler)
    assert tasks.failed == 1
    assert len(records) == 1 and "boom" in records[0].getMessage()
    assert records[0].exc_info is not None and records[0].exc_info[0] is ValueError
