"""bench live-hot: the window and its requests, the two modes' stack settings, and the same
requests replayed through the replay's cores."""

import json

import pytest

from thunderagent.bench import live_hot
from thunderagent.replay.traces import TraceRequest


def hot_rows() -> list[TraceRequest]:
    doc = list(range(1, 9))  # an 8-block document every hot row starts with
    rows = [TraceRequest(f"c{i}", 1.0 + i, 600, 500, [100 + i, 150 + i]) for i in range(4)]
    rows += [TraceRequest(f"h{i}", 10.0 + 0.5 * i, 8 * 512 + 40, 300, [*doc, 200 + i], hot=True)
             for i in range(12)]  # fmt: skip
    return rows


def test_the_window_is_the_hot_period_from_its_first_lead_request(tmp_path) -> None:
    trace = tmp_path / "hot.jsonl"
    meta = {"hot_start_s": 240.0, "hot_end_s": 360.0, "params": {"hot_lead_s": 60}}
    trace.with_suffix(".meta.json").write_text(json.dumps(meta))
    assert live_hot.window_of(trace, None) == (179.0, 360.0)
    parse = live_hot._parser().parse_args
    assert live_hot.window_of(trace, parse(["--trace", "t", "--window", "5,20"]).window) == (5, 20)
    for bad in ("5", "20,5", "a,b"):
        with pytest.raises(SystemExit):
            parse(["--trace", "t", "--window", bad])
    with pytest.raises(SystemExit, match="no hot period"):
        live_hot.window_of(tmp_path / "other.jsonl", None)


def test_rows_in_the_window_start_at_its_start_with_outputs_capped() -> None:
    rows = live_hot.rows_in(hot_rows(), (2.0, 12.0), max_output=64)
    assert [r.request_id for r in rows] == ["c1", "c2", "c3", *(f"h{i}" for i in range(4))]
    assert [r.arrival for r in rows[:5]] == [0.0, 1.0, 2.0, 8.0, 8.5]
    assert {r.output_len for r in rows} == {64} and [r.hot for r in rows].count(True) == 4
    requests = live_hot.live_requests(rows)
    assert [len(r.token_ids) for r in requests] == [r.prompt_len for r in rows]
    assert requests[3].token_ids[: 8 * 512] == requests[4].token_ids[: 8 * 512]  # the document


def test_off_runs_no_planner_and_no_pull_and_copies_take_the_full_bytes_time() -> None:
    args = live_hot._parser().parse_args(["--trace", "t.jsonl", "--kv-pool-scale", "100"])
    off, nixl = live_hot.stack_config(args, "off"), live_hot.stack_config(args, "nixl")
    assert (off.pull_min_tokens, off.migration_args) == (0, ["--orders-only"])
    assert (nixl.pull_min_tokens, nixl.migration_args) == (None, [])
    for cfg in (off, nixl):  # the same engines either way
        assert cfg.kv_pool and cfg.kv_pool_scale == 100
        assert cfg.engine_args == ["--kv-pull-gbps", "0.25"]  # 25 GB/s over a 100x smaller pool


def test_the_replay_twin_runs_the_same_requests_and_accounts_for_each() -> None:
    rows = live_hot.rows_in(hot_rows(), (0.0, 30.0), max_output=64)
    for mode in ("off", "nixl"):
        out = live_hot.replayed(rows, workers=2, profile="llama-3.1-8b-h100", mode=mode)
        assert out["requests"] == out["completed"] == len(rows)
        assert out["hot"]["ttft_p99_ms"] >= out["hot"]["ttft_p50_ms"] > 0


def test_copies_are_summed_over_the_services_metrics() -> None:
    """As the services' OpenTelemetry Prometheus exporter writes them."""

    def counter(name: str, *samples: str) -> str:
        lines = [f"# HELP {name}_total copies", f"# TYPE {name}_total counter"]
        return "\n".join([*lines, *(f"{name}_total{s}" for s in samples)]) + "\n"

    workers = [counter("thunderagent_dispatch_pulls", '{outcome="done"} 2.0',
                       '{outcome="refused"} 1.0'),
               counter("thunderagent_dispatch_pulls", '{outcome="done"} 1.0')]  # fmt: skip
    migration = counter(
        "thunderagent_migrations", '{mode="replicate",outcome="done",transport="nixl"} 5.0'
    ) + counter("thunderagent_migration_bytes", " 1.0e9")
    assert live_hot.count_copies([*workers, migration]) == {
        "pulls": {"done": 3, "refused": 1},
        "moves": {"replicate done": 5},
    }
    assert live_hot.count_copies([]) == {"pulls": {}, "moves": {}}
