"""`thunderagent bench pd` end to end, small: both PD paths through real stacks, every request
answered by the decode worker from the prompt's KV, the accounting in the JSON."""

from __future__ import annotations

import json

import pytest

from thunderagent.bench import pd

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_both_pd_paths_answer_from_the_decode_worker(tmp_path) -> None:
    out = tmp_path / "pd.json"
    pd.main(["--requests", "3", "--rounds", "1", "--prompt-tokens", "160", "--json", str(out)])
    report = json.loads(out.read_text())
    assert set(report["runs"]) == {"sglang", "workers"}
    for path, (row,) in report["runs"].items():
        assert (row["requests"], row["completed"], row["rejected"], row["in_flight"]) == (
            3,
            3,
            0,
            0,
        ), path
        assert row["answered_by_decode_worker"] == 3, path
        assert row["cached_tokens_mean"] >= 144, path  # the prefill side's KV, not recomputed
        assert row["ttft_ms"]["p50"] <= row["e2e_ms"]["p50"], path
