"""``bench replay --repeats N --arrival-jitter-ms J``: the sweep on jittered copies of the trace
and each cell's spread over them."""

import json
import math
from pathlib import Path

import pytest

from thunderagent.bench import replay_spread


def _entry(policy: str, speed: float, p99: float, hot: float | None = None) -> dict:
    e = {
        "policy": policy,
        "speed": speed,
        "ttft_ms": {"p50": p99 / 10, "p99": p99},
        "queue_ms": {"p99": p99 / 2},
        "prefix_hit_ratio": 0.5,
    }
    if hot is not None:
        e["hot"] = {"hot": {"ttft_p99_ms": hot}}
    return e


def _doc(entries: list[dict], capacity: dict) -> dict:
    return {
        "results": entries,
        "capacity": {p: {"max_speed_meeting_slo": s} for p, s in capacity.items()},
    }


def test_each_cell_gets_the_stats_of_its_figures_over_the_copies() -> None:
    docs = [
        _doc(
            [_entry("thunder", 1.0, 100.0, 10.0), _entry("thunder", 2.0, 300.0, 30.0)],
            {"thunder": 2.0},
        ),
        _doc(
            [_entry("thunder", 1.0, 110.0, 14.0), _entry("thunder", 2.0, 500.0, 50.0)],
            {"thunder": 1.0},
        ),
        _doc(
            [_entry("thunder", 1.0, 120.0, 12.0), _entry("thunder", 2.0, 400.0, 40.0)],
            {"thunder": None},
        ),
    ]
    out = replay_spread.spread(docs, [4, 5, 6], 0.5)
    assert out["seeds"] == [4, 5, 6] and out["arrival_jitter_ms"] == 0.5
    assert out["max_speed_meeting_slo"] == {"thunder": [2.0, 1.0, None]}
    one, two = out["cells"]
    assert (one["policy"], one["speed"], one["runs"]) == ("thunder", 1.0, 3)
    assert one["ttft_p99_ms"]["values"] == [100.0, 110.0, 120.0]
    assert one["ttft_p99_ms"]["mean"] == pytest.approx(110.0)
    assert one["ttft_p99_ms"]["sd"] == pytest.approx(10.0)  # the sample sd
    assert (two["ttft_p99_ms"]["min"], two["ttft_p99_ms"]["max"]) == (300.0, 500.0)
    assert two["wait_p99_ms"]["mean"] == pytest.approx(200.0)
    assert one["hot_ttft_p99_ms"]["mean"] == pytest.approx(12.0)
    table = replay_spread.table(out)
    assert "| thunder | 1 | 110 ± 10 (100-120) | 55 ± 5 (50-60) | 0.500 ± 0.000" in table
    assert "seeds 4-6" in table and "±0.5 ms" in table
    assert "| thunder | none swept | 1x | 2x in 1, 1x in 1, none swept in 1 |" in table


def test_capacity_over_copies_names_what_every_copy_and_half_of_them_meet() -> None:
    docs = [_doc([_entry("thunder", 5.0, 100.0)], {"thunder": s}) for s in (5.0, None, 5.0, 4.0)]
    table = replay_spread.table(replay_spread.spread(docs, [0, 1, 2, 3], 20.0))
    assert "| thunder | none swept | 5x | 5x in 2, 4x in 1, none swept in 1 |" in table
    docs = [_doc([_entry("llm_d", 4.0, 100.0)], {"llm_d": s}) for s in (4.0, 4.0, 3.0)]
    table = replay_spread.table(replay_spread.spread(docs, [0, 1, 2], 20.0))
    assert "| llm_d | 3x | 4x | 4x in 2, 3x in 1 |" in table


def test_a_figure_missing_from_any_copy_is_left_out_and_one_copy_has_no_spread() -> None:
    out = replay_spread.spread(
        [_doc([_entry("dynamo_kv", 1.0, 80.0)], {"dynamo_kv": 1.0})], [0], None
    )
    (cell,) = out["cells"]
    assert "hot_ttft_p99_ms" not in cell
    assert cell["ttft_p99_ms"]["sd"] == 0.0 and out["arrival_jitter_ms"] == 0.0
    (row,) = [r for r in replay_spread.table(out).splitlines() if r.startswith("| dynamo_kv | 1 |")]
    assert row.endswith("| – |")


def test_the_cli_runs_every_copy_and_reports_the_spread(tmp_path: Path, capsys) -> None:
    from thunderagent.bench.replay import main

    trace = tmp_path / "t.jsonl"
    rows = [
        {"timestamp": 7 * i, "input_length": 9 + i % 5, "output_length": 3, "hash_ids": [0, i]}
        for i in range(30)
    ]
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out, report = tmp_path / "r.json", tmp_path / "r.md"
    argv = ["--trace", str(trace), "--profile", "tiny", "--block-size", "4", "--workers", "2"]
    argv += ["--policies", "round_robin,thunder", "--speed", "1,3", "--quiet", "--seed", "7"]
    argv += [
        "--repeats",
        "3",
        "--arrival-jitter-ms",
        "2",
        "--json",
        str(out),
        "--report",
        str(report),
    ]
    main(argv)
    doc = json.loads(out.read_text())
    assert doc["seed"] == 7 and doc["arrival_jitter_ms"] == 2.0
    rep = doc["repeats"]
    assert rep["seeds"] == [7, 8, 9]
    assert [(c["policy"], c["speed"], c["runs"]) for c in rep["cells"]] == [
        ("round_robin", 1.0, 3),
        ("thunder", 1.0, 3),
        ("round_robin", 3.0, 3),
        ("thunder", 3.0, 3),
    ]
    for e in doc["results"]:  # the first copy's runs, each request accounted for
        assert e["requests"] == e["completed"] + e["rejected"] + e["in_flight"] == 30
    first = {(e["policy"], e["speed"]): e["ttft_ms"]["p99"] for e in doc["results"]}
    for c in rep["cells"]:
        s = c["ttft_p99_ms"]
        assert s["values"][0] == first[(c["policy"], c["speed"])]
        assert s["min"] <= s["mean"] <= s["max"] and all(math.isfinite(v) for v in s["values"])
    assert set(rep["max_speed_meeting_slo"]) == {"round_robin", "thunder"}
    printed = capsys.readouterr().out
    assert "Over 3 copies (seeds 7-9" in printed and "12 runs" in printed
    assert "Over 3 copies" in report.read_text()
    for policy, speeds in rep["max_speed_meeting_slo"].items():  # the capacity over copies
        every = min(speeds, key=lambda v: -1.0 if v is None else v)
        shown = "none swept" if every is None else f"{every:g}x"
        assert f"| {policy} | {shown} |" in printed


def test_repeats_and_jitter_are_checked_when_parsed(capsys) -> None:
    from thunderagent.bench.replay import parse_args

    for flags, name in (
        (["--repeats", "0"], "--repeats"),
        (["--arrival-jitter-ms", "-1"], "--arrival-jitter-ms"),
    ):
        with pytest.raises(SystemExit):
            parse_args(["--trace", "t.jsonl", *flags])
        assert f"argument {name}" in capsys.readouterr().err
