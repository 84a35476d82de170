"""A service process and the cyclic GC: its startup heap frozen, its pauses exported."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.integration.metrics_probe import scrape_after
from thunderagent.embedded.ports import free_port

pytestmark = pytest.mark.integration


def test_a_service_with_metrics_exports_its_gc_pauses() -> None:
    text = scrape_after("""
        import gc
        junk = [[i] for i in range(200_000)]  # a full collection walks these
        gc.collect()
    """)
    rows = {}
    for line in text.splitlines():
        if line.startswith("thunderagent_gc_pause") and 'generation="2"' in line:
            assert 'service="probe"' in line
            rows[line.split("{", 1)[0]] = float(line.rsplit(" ", 1)[1])
    assert rows["thunderagent_gc_pause_seconds_total"] > 0
    assert (
        0 < rows["thunderagent_gc_pause_max_seconds"] <= rows["thunderagent_gc_pause_seconds_total"]
    )


SERVICE = """
import gc, sys
from thunderagent.shell.runner import run_service

async def main(ctx):
    print("frozen", gc.get_freeze_count(), "tracked", len(gc.get_objects()), flush=True)

run_service("probe", sys.argv[1], main)
"""


def test_a_service_freezes_what_its_startup_built(nats_server) -> None:
    out = subprocess.run(
        [sys.executable, "-c", SERVICE, nats_server.url],
        capture_output=True, text=True, timeout=60, check=True,
    ).stdout  # fmt: skip
    words = out.split()
    frozen, tracked = int(words[words.index("frozen") + 1]), int(words[words.index("tracked") + 1])
    assert frozen > 10_000  # the imports: a full collection no longer walks them
    assert tracked < frozen // 10


UNREACHABLE = """
import functools, sys
from thunderagent.shell import runner

runner.connect = functools.partial(runner.connect, deadline_s=1.0)  # the test's patience

async def main(ctx):
    print("served", flush=True)

runner.run_service("probe", sys.argv[1], main)
"""


def test_a_service_that_cannot_reach_nats_exits_with_one_line_saying_so() -> None:
    port = free_port()  # nothing listens there
    done = subprocess.run(
        [sys.executable, "-c", UNREACHABLE, f"nats://127.0.0.1:{port}"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 1 and "served" not in done.stdout
    last = done.stderr.strip().splitlines()[-1]
    assert last == (
        f"probe: cannot connect to NATS at nats://127.0.0.1:{port}: "
        "no server answered in 1 s (is it running?)"
    )
    assert "Traceback" not in done.stderr
