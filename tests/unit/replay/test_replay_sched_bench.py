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
    "pd": (("uncapped", "capped"), ("output_tok_s", "ttft_p99_ms")),
    "programs": (("unaware", "aware"), ("steps_per_min", "hit_ratio", "recomputed_tokens")),
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
    assert set(doc["targets"]) >= {"short_ttft_p99_gain", "programs_steps_per_min_gain"}
    printed = capsys.readouterr().out
    assert "### programs" in printed and "targets:" in printed
