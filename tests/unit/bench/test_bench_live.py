"""bench live: baseline selection, the routers' launch lines (shipped defaults, nothing tuned),
deterministic request building and the report's shape (old keys kept, new ones added)."""

import argparse

import pytest

from thunderagent.bench import baseline_routers as routers
from thunderagent.bench import live
from thunderagent.replay.traces import TraceRequest


def test_parse_baselines_accepts_a_comma_separated_list() -> None:
    assert routers.parse_baselines("sglang-router,smg") == ["sglang-router", "smg"]
    assert routers.parse_baselines(" smg , smg ") == ["smg"]
    for bad in ("nginx", "smg,nginx", ",", ""):
        with pytest.raises(argparse.ArgumentTypeError, match="choose from sglang-router, smg,"):
            routers.parse_baselines(bad)
    args = live._parser().parse_args(["--trace", "t", "--baseline", "sglang-router,smg"])
    assert args.baseline == ["sglang-router", "smg"] and args.client_connections == "both"
    assert live._parser().parse_args(["--trace", "t"]).baseline == []


@pytest.mark.parametrize("baseline", ["sglang-router", "smg", "smg-dp-aware"])
def test_router_argv_is_cache_aware_with_defaults(baseline: str) -> None:
    argv = routers.router_argv(baseline, 8000, 9000, ["http://e0", "http://e1"])
    assert argv[argv.index("--policy") + 1] == "cache_aware"
    assert argv[argv.index("--worker-urls") + 1 :] == ["http://e0", "http://e1"]
    flags = {a for a in argv if a.startswith("--")}
    # only where to listen is set, and the one setting a name says: every other routing knob
    # keeps its shipped default
    named = {"--dp-aware"} if baseline == "smg-dp-aware" else set()
    assert flags == {
        "--host", "--port", "--prometheus-host", "--prometheus-port", "--policy", "--worker-urls",
        *named,
    }  # fmt: skip
    assert (argv[argv.index("--port") + 1], argv[argv.index("--prometheus-port") + 1]) == (
        "8000",
        "9000",
    )


def test_dynamo_runs_our_proxy_around_its_selection_core_with_nothing_set() -> None:
    assert routers.parse_baselines("smg,dynamo") == ["smg", "dynamo"]
    argv = routers.router_argv("dynamo", 8000, 9000, ["http://e0", "http://e1"])
    assert argv[1:3] == ["-m", "thunderagent.bench.dynamo_router"]
    assert argv[argv.index("--worker-urls") + 1 :] == ["http://e0", "http://e1"]
    # no routing knob on the line: the selection core applies KvRouterConfig's defaults
    assert {a for a in argv if a.startswith("--")} == {"--host", "--port", "--worker-urls"}


def test_system_names_keep_the_plain_name_for_keepalive() -> None:
    assert routers.system_name("sglang-router", "keepalive") == "sglang-router"
    assert routers.system_name("smg", "fresh") == "smg/fresh-connections"


def test_build_requests_equal_blocks_equal_tokens() -> None:
    trace = [
        TraceRequest("a", 0.0, prompt_len=1024, output_len=50, block_ids=[7, 8]),
        TraceRequest("b", 1.0, prompt_len=1500, output_len=3, block_ids=[7, 8, 9]),
        TraceRequest("c", 2.0, prompt_len=512, output_len=5, block_ids=[1]),
    ]
    reqs = live.build_requests(trace, rate=1.0, duration=2.0, tokens_per_block=8, max_out=16)
    assert [r.at for r in reqs] == [0.0, 1.0]  # rate x duration caps the count
    assert len(reqs[0].token_ids) == 16 and len(reqs[1].token_ids) == 1500 * 8 // 512
    assert reqs[1].token_ids[:16] == reqs[0].token_ids  # shared blocks, shared prefix
    assert [r.max_tokens for r in reqs] == [16, 3]
    assert live.block_tokens(7, 8) == live.block_tokens(7, 8) != live.block_tokens(8, 8)


def summary(ttft: float, hit: float) -> dict:
    dist = {"p50": ttft, "p90": ttft, "p99": 2 * ttft, "mean": ttft}
    return {"ttft_ms": dist, "e2e_ms": dist, "added_latency_ms": dist, "prefix_hit_ratio": hit}


def test_report_adds_ratios_for_every_baseline_and_keeps_the_old_key() -> None:
    args = live._parser().parse_args(["--trace", "/x/trace.jsonl", "--baseline", "smg"])
    systems = {
        "thunderagent": summary(10.0, 0.2),
        "sglang-router": summary(20.0, 0.4),
        "smg/fresh-connections": summary(5.0, 0.1),
        "smg": {"skipped": "smg is not installed"},
    }
    report = live.build_report(args, systems)
    assert report["trace"] == "trace.jsonl" and report["systems"] is systems
    assert report["client"] == {"tcp_nodelay": True, "connections": "both"}
    assert report["ratios_thunderagent_over_sglang_router"]["ttft_ms.p50"] == 0.5
    assert set(report["ratios_thunderagent_over"]) == {"sglang-router", "smg/fresh-connections"}
    assert report["ratios_thunderagent_over"]["smg/fresh-connections"]["prefix_hit_ratio"] == 2.0
    only_ours = live.build_report(args, {"thunderagent": summary(1.0, 0.1)})
    assert "ratios_thunderagent_over" not in only_ours
    assert "ratios_thunderagent_over_sglang_router" not in only_ours


def test_summary_separates_the_engines_time_and_counts_token_messages() -> None:
    outcomes = [
        live.Outcome(ttft_ms=10.0, e2e_ms=20.0, engine_ttft_ms=4.0, prompt_tokens=100,
                cached_tokens=50, token_messages=3),
        live.Outcome(ttft_ms=30.0, e2e_ms=40.0, engine_ttft_ms=20.0, prompt_tokens=100,
                cached_tokens=0, token_messages=5),
        live.Outcome(error="HTTP 503: busy"),
        live.Outcome(error="overloaded: router overloaded: 64 requests already wait"),
        live.Outcome(error="overloaded: router overloaded: 65 requests already wait"),
    ]  # fmt: skip
    summary = live.SystemResult("s", outcomes, wall_s=1.0).summary()
    assert summary["requests"] == summary["completed"] + summary["errors"] == 5
    assert summary["error_codes"] == {"HTTP 503": 1, "overloaded": 2}
    assert summary["engine_ttft_ms"]["mean"] == 12.0
    assert summary["added_latency_ms"]["mean"] == 8.0  # (6 + 10) / 2
    assert summary["token_messages_per_request"] == 4.0
    assert summary["prefix_hit_ratio"] == 0.25


def test_sched_params_reach_the_stacks_scheduler_and_bad_ones_are_refused(capsys) -> None:
    args = live.parse_args(["--trace", "t.jsonl", "--sched-param", "order=fcfs"])
    assert live.stack_config(args).scheduler_args == ["--param=order=fcfs"]
    assert live.stack_config(live.parse_args(["--trace", "t.jsonl"])).scheduler_args == []
    with pytest.raises(SystemExit):
        live.parse_args(["--trace", "t.jsonl", "--sched-param", "no_such_knob=1"])
    assert "no parameter 'no_such_knob'" in capsys.readouterr().err


def test_router_replicas_reach_the_stack_unless_the_gateway_routes(capsys) -> None:
    two = live.parse_args(["--trace", "t.jsonl", "--routers", "2"])
    assert live.stack_config(two).routers == 2
    embedded = live.parse_args(
        ["--trace", "t.jsonl", "--routers", "2", "--via", "gateway-embedded"]
    )
    assert live.stack_config(embedded).routers == 0 and live.stack_config(embedded).gateways == 1
    with pytest.raises(SystemExit):
        live.parse_args(["--trace", "t.jsonl", "--routers", "0"])
    assert "--routers" in capsys.readouterr().err
