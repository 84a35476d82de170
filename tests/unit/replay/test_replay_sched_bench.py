"""``thunderagent bench sched --quick``: runs and writes the JSON shape the issue names."""

import json
from pathlib import Path

from thunderagent.bench import sched

SHAPE = {
    "priority": (
        ("fcfs", "priority_srpt", "preempt"),
        ("short_ttft_p50_ms", "short_ttft_p99_ms", "long_ttft_p99_ms", "long_e2e_p50_ms"),
    ),
    "window": (("none", "fixed_100ms", "adaptive"), ("ttft_p99_ms", "prefill_tokens_saved")),
    "pd": (
        ("uncapped", "capped", "sglang_uncapped", "sglang_capped"),
        ("output_tok_s", "ttft_p99_ms"),
    ),
    "programs": (
        ("unaware", "aware"),
        ("steps_per_min", "steps_per_min_95", "hit_ratio", "recomputed_tokens"),
    ),
}


def test_quick_run_writes_every_key(tmp_path: Path, capsys) -> None:
    out = tmp_path / "sched.json"
    assert sched.main(["--quick", "--workers", "4", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    for scenario, (variants, keys) in SHAPE.items():
        for variant in variants:
            row = doc[scenario][variant]
            for key in keys:
                assert isinstance(row[key], int | float), (scenario, variant, key)
            assert row["completed"] + row["rejected"] == row["requests"] > 0
    assert "preemptions" in doc["priority"]["preempt"]
    floor = doc["programs"]["makespan_floor_s"]
    spans = [doc["programs"][v]["makespan_s"] for v in ("unaware", "aware", "direct")]
    assert 0 < floor <= min(spans), (floor, spans)
    assert set(doc["targets"]) >= {
        "short_ttft_p99_gain",
        "programs_steps_per_min_gain",
        "programs_ceiling_gain",
    }
    printed = capsys.readouterr().out
    assert "### programs" in printed and "targets:" in printed


def test_rate_to_share_leaves_out_the_last_steps() -> None:
    from thunderagent.replay import Record

    done = [Record(f"r{i}", 0.0, 16, 1, finish=float(t)) for i, t in enumerate([10, 20, 30, 600])]
    assert sched._rate_to_share(done, 0.75) == 6.0  # 3 steps by 30 s
    assert sched._rate_to_share(done, 1.0) == 0.4  # the straggler sets the span
    assert sched._rate_to_share([], 0.95) == 0.0
