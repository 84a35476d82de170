"""Soak in CI: the embedded stack as processes for 60 s at 20 requests/s (``thunderagent bench
soak`` runs the same for 600 s by default). Every request ends answered, and no process's memory
or file descriptors grow after the warm-up (bounds in ``thunderagent.bench.soak``)."""

from __future__ import annotations

import json
import os

import pytest

from thunderagent.bench.soak import SoakConfig, run, table

pytestmark = [pytest.mark.soak, pytest.mark.integration, pytest.mark.slow]

DURATION_S = float(os.environ.get("THUNDERAGENT_SOAK_S") or 60)


@pytest.mark.timeout(DURATION_S * 2 + 120)
def test_soak_holds_memory_descriptors_and_every_request(tmp_path, capsys):
    result = run(SoakConfig(duration_s=DURATION_S, rate=20.0, sample_s=2.0))
    (tmp_path / "soak.json").write_text(json.dumps(result, indent=1))
    with capsys.disabled():
        print("\n" + table(result))
    r = result["requests"]
    assert r["sent"] >= 0.95 * DURATION_S * 20, "the load generator fell behind the rate"
    assert r["lost"] == 0, f"{r['lost']} requests never answered"
    assert r["balanced"], r
    assert r["completed"] >= 0.99 * r["sent"], r
    assert not result["dead_processes"], result["dead_processes"]
    bad = {name: v for name, v in result["processes"].items() if not v["ok"]}
    assert not bad, f"memory or descriptors grew: {bad}"
    assert len(result["processes"]) >= 10  # nats, redis, 4 services, 2 x (engine + adapter), us
    services = {"index", "scheduler", "router-0", "migration", "worker-w0", "worker-w1"}
    assert services <= set(result["gc"]), result["gc"]  # every service reported its GC pauses
