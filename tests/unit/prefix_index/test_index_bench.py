"""The index benchmark runs end to end on a tiny workload, and agrees with Dynamo if present."""

from __future__ import annotations

import json
from pathlib import Path

from thunderagent.bench.index import build_workload, main


def test_workload_is_deterministic_and_chained() -> None:
    a, b = build_workload(500, 50, seed=3), build_workload(500, 50, seed=3)
    assert a.events == b.events and a.queries == b.queries
    assert len(a.events) == 500 and len(a.queries) == 50
    assert a.blocks == sum(len(e[2]) for e in a.events)
    seqs: dict[int, int] = {}
    for worker, seq, primary, check, _parent, ids in a.events:
        assert seq == seqs.get(worker, -1) + 1
        seqs[worker] = seq
        assert len(primary) == len(check) == len(ids) > 0
    assert all(len(q[0]) == len(q[1]) == 64 for q in a.queries)


def test_bench_smoke(tmp_path: Path, capsys) -> None:
    out = tmp_path / "bench.json"
    assert main(["--events", "2000", "--queries", "100", "--rounds", "1", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    for key in ("ingest_blocks_per_s", "query_p50_us", "query_p99_us", "workload", "dynamo"):
        assert key in result
    assert result["ingest_blocks_per_s"] > 0
    assert result["ours"]["index_stats"]["query_collisions"] == 0
    if "skipped" not in result["dynamo"]:
        assert result["dynamo"]["answers_differ"] == 0
    assert "query p50 us" in capsys.readouterr().out
