"""GC pause accounting: the pure counter with a fake clock, and the metrics a process exports."""

from __future__ import annotations

import subprocess
import sys

from thunderagent.telemetry.gcpause import GcPauses


def test_pauses_add_up_per_generation_and_the_longest_is_taken_once() -> None:
    now = [0.0]
    pauses = GcPauses(clock=lambda: now[0])
    for generation, start, end in ((0, 1.0, 1.001), (2, 2.0, 2.2), (0, 3.0, 3.004), (2, 4.0, 4.1)):
        now[0] = start
        pauses.on_gc("start", {"generation": generation})
        now[0] = end
        pauses.on_gc("stop", {"generation": generation, "collected": 0, "uncollectable": 0})
    assert [round(s, 6) for s in pauses.total_s] == [0.005, 0.0, 0.3]
    assert [round(s, 6) for s in pauses.take_longest()] == [0.004, 0.0, 0.2]
    assert pauses.take_longest() == [0.0, 0.0, 0.0]
    assert [round(s, 6) for s in pauses.total_s] == [0.005, 0.0, 0.3]


PROBE = """
import gc, urllib.request
from thunderagent.telemetry.setup import setup_telemetry
tel = setup_telemetry("thunderagent-probe", metrics_port=0)
junk = [[i] for i in range(200_000)]  # a full collection walks these
gc.collect()
print(urllib.request.urlopen(f"http://127.0.0.1:{tel.metrics_port}/metrics").read().decode())
tel.shutdown()
"""


def test_a_service_with_metrics_exports_its_gc_pauses() -> None:
    text = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=60, check=True
    ).stdout
    rows = {}
    for line in text.splitlines():
        if line.startswith("thunderagent_gc_pause") and 'generation="2"' in line:
            assert 'service="probe"' in line
            rows[line.split("{", 1)[0]] = float(line.rsplit(" ", 1)[1])
    assert rows["thunderagent_gc_pause_seconds_total"] > 0
    assert (
        0 < rows["thunderagent_gc_pause_max_seconds"] <= rows["thunderagent_gc_pause_seconds_total"]
    )
