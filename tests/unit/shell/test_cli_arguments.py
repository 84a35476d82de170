"""Flags out of range are refused when the command line is parsed, naming the flag, before any
server or engine starts (a block size of 0 used to divide by zero inside the engine; a negative
worker count started none; an unknown profile or policy was a traceback from a child)."""

from __future__ import annotations

import argparse

import pytest

from thunderagent.cli.main import build_parser
from thunderagent.shell.argtypes import (
    at_least,
    http_url,
    name_list,
    positive,
    positive_list,
    zmq_endpoint,
)


def test_at_least_and_positive() -> None:
    assert at_least(0)("0") == 0 and at_least(1)("7") == 7
    assert positive("0.5") == 0.5
    for parse, text, words in [
        (at_least(1), "0", "at least 1"),
        (at_least(0), "-1", "at least 0"),
        (at_least(0), "1.5", "an integer"),
        (positive, "0", "positive"),
        (positive, "-2", "positive"),
        (positive, "nan", "positive"),
        (positive, "inf", "positive"),
        (positive, "x", "a number"),
    ]:
        with pytest.raises(argparse.ArgumentTypeError, match=words):
            parse(text)


def test_list_flags_refuse_empty_repeated_and_non_finite_items() -> None:
    assert positive_list("2, 1,0.5") == [2.0, 1.0, 0.5]  # the order given: a sweep's order
    assert name_list(["a", "b"])("b,a") == ["b", "a"]
    for parse, text, words in [
        (positive_list, "1,,2", "an empty item"),
        (positive_list, "1,", "an empty item"),
        (positive_list, "inf", "finite positive"),
        (positive_list, "1,-1", "finite positive"),
        (positive_list, "abc", "expected a number"),
        (positive_list, "2,1,2", "2 given twice"),
        (positive_list, "1,1.0", "given twice"),
        (name_list(["a", "b"]), "a,c", "unknown 'c'; choose from a, b"),
        (name_list(["a", "b"]), "a,a", "a given twice"),
    ]:
        with pytest.raises(argparse.ArgumentTypeError, match=words):
            parse(text)


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["up", "--workers", "-1"], "--workers"),
        (["up", "--block-size", "0"], "--block-size"),
        (["up", "--speedup", "0"], "--speedup"),
        (["up", "--profile", "nosuch"], "--profile"),
        (["up", "--policy", "nosuch"], "--policy"),
        (["up", "--kv-blocks", "0"], "--kv-blocks"),
        (["demo", "--requests", "0"], "--requests"),
        (["simengine", "--page-size", "0"], "--page-size"),
        (["simengine", "--profile", "nosuch"], "--profile"),
        (["simengine", "--speedup", "-1"], "--speedup"),
        (["request", "hi", "--max-tokens", "0"], "--max-tokens"),
        (["worker", "--worker-id", "w.0", "--engine-url", "http://e:1"], "--worker-id"),
        (["worker", "--worker-id", "w0", "--engine-url", "localhost:30000"], "--engine-url"),
        (
            ["worker", "--worker-id", "w0", "--engine-url", "http://e:1", "--lease-s", "0"],
            "--lease-s",
        ),
        (
            ["worker", "--worker-id", "w0", "--engine-url", "http://e:1", "--kv-events", "e:5557"],
            "--kv-events",
        ),
        (["request", "hi", "--priority", "12"], "--priority"),
        (["gateway", "--default-max-tokens", "0"], "--default-max-tokens"),
        (["migration", "--link-gbps", "0"], "--link-gbps"),
        (["router", "--handoff-slow-ms", "0"], "--handoff-slow-ms"),
        # what a command reads, writes or connects to (stop 41)
        (["up", "--tls-cert", "/nonexistent/cert.pem"], "--tls-cert"),
        (["up", "--nats", "localhost:4222"], "--nats"),
        (["demo", "--compare", "round_robin,nosuch"], "--compare"),  # a traceback after a run
        (["demo", "--json", "/"], "--json"),
        (["request", "hi", "--nats", "notaurl"], "--nats"),
        (["schemas", "--out", "/etc/passwd"], "--out"),
    ],
)
def test_out_of_range_flags_are_refused_at_parse_time(argv, flag, capsys) -> None:
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(argv)
    assert info.value.code == 2
    assert f"argument {flag}" in capsys.readouterr().err


def test_worker_flags_in_the_forms_compose_and_kubernetes_use_parse() -> None:
    args = build_parser().parse_args(
        ["worker", "--worker-id", "worker-sim-7d9f8-abcde", "--engine-url", "http://engine-0:30000/",
         "--kv-events", "tcp://engine-0:5557"]
    )  # fmt: skip
    assert (args.worker_id, args.engine_url, args.kv_events) == (
        "worker-sim-7d9f8-abcde", "http://engine-0:30000", "tcp://engine-0:5557",
    )  # fmt: skip
    assert zmq_endpoint("ipc:///tmp/kv.sock") == "ipc:///tmp/kv.sock"
    assert http_url("https://gpu-3.internal/sglang") == "https://gpu-3.internal/sglang"


def test_the_defaults_parse() -> None:
    up = build_parser().parse_args(["up"])
    assert (up.workers, up.block_size, up.speedup, up.policy) == (4, 16, 1.0, "thunder")
    engine = build_parser().parse_args(["simengine"])
    assert (engine.block_size, engine.speedup, engine.profile) == (16, 1.0, "llama-3.1-8b-h100")


@pytest.mark.parametrize(
    "argv, words",
    [
        (["router", "--policy", "nosuch"], "unknown routing policy 'nosuch'"),
        (["router", "--param", "recompute_gain=-1"], "recompute_gain=-1"),
        (["gateway", "--embed-router", "--policy", "nosuch"], "unknown routing policy"),
        (["scheduler", "--policy", "nosuch"], "unknown scheduler 'nosuch'"),
        (["scheduler", "--param", "kv_watermark=2"], "kv_watermark=2"),
        (["migration", "--param", "nosuch=1"], "migration param nosuch=1"),
    ],
)
def test_a_bad_policy_or_param_stops_a_service_before_it_connects(argv, words, capsys) -> None:
    from thunderagent.cli.main import main

    with pytest.raises(SystemExit) as info:  # NATS at port 1: reaching it would time out
        main([*argv, "--nats", "nats://127.0.0.1:1"])
    assert info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"thunderagent {argv[0]}: error: ") and words in err
    assert "Traceback" not in err


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["replay", "--trace", "t.jsonl", "--block-size", "0"], "--block-size"),
        (["replay", "--trace", "t.jsonl", "--profile", "nosuch"], "--profile"),
        (["route", "--workers", "0"], "--workers"),
        (["index", "--events", "0"], "--events"),
        (["sched", "--programs", "0"], "--programs"),
        (["live", "--rate", "0"], "--rate"),
        (["gen", "--kind", "bursty", "--out", "t.jsonl", "--scale", "0"], "--scale"),
    ],
)
def test_a_benchmark_refuses_an_out_of_range_flag(argv, flag, capsys) -> None:
    import importlib

    from thunderagent.bench.cli import BENCHES

    main = importlib.import_module(BENCHES[argv[0]][0]).main  # what `thunderagent bench` runs
    with pytest.raises(SystemExit) as info:
        main(argv[1:])
    assert info.value.code == 2
    assert f"argument {flag}" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv",
    [
        ["index", "--json"],
        ["live", "--trace", "t.jsonl", "--json"],
        ["latency", "--json"],
        ["throughput", "--json"],
        ["profile", "--json"],
        ["messages", "--json"],
        ["transfer", "--json"],
        ["transfer", "--run-dir"],
        ["gateway", "--json"],
        ["soak", "--json"],
        ["bus", "--json"],
        ["sched", "--json"],
        ["gen", "--kind", "bursty", "--out"],
        ["tune", "--traces", "t.jsonl", "--param", "thunder.recompute_gain=1", "--json"],
        ["replay", "--trace", "t.jsonl", "--json"],
    ],
)
def test_a_benchmark_refuses_an_output_it_cannot_write_before_it_runs(argv, tmp_path, capsys):
    """An output under a file (or a folder named where a file goes) failed after the run, with a
    traceback, and lost what the run measured."""
    import importlib

    from thunderagent.bench.cli import BENCHES

    a_file = tmp_path / "afile"
    a_file.write_text("")
    main = importlib.import_module(BENCHES[argv[0]][0]).main
    with pytest.raises(SystemExit) as info:
        main([*argv[1:], str(a_file / "x")])
    assert info.value.code == 2
    assert f"argument {argv[-1]}: " in capsys.readouterr().err


@pytest.mark.parametrize(
    "flags, words",
    [
        (["--param", "thunder.nosuch=1"], "routing policy 'thunder' has no parameter 'nosuch'"),
        (["--param", "thunder.recompute_gain=-1"], "recompute_gain=-1"),
        (["--sched-param", "nosuch=1"], "scheduler 'thunder' has no parameter 'nosuch'"),
        (["--sched-param", "kv_watermark=2"], "kv_watermark=2"),
        # a malformed item names its own flag and format (it said --param 'scheduler.x', exit 1)
        (["--sched-param", "kv_watermark"], "--sched-param 'kv_watermark': expected FIELD=VALUE"),
        (["--param", "thunder.x"], "--param 'thunder.x': expected POLICY.FIELD=VALUE"),
        (["--param", "thunder.=1"], "--param 'thunder.=1': expected POLICY.FIELD=VALUE"),
    ],
)
def test_replay_checks_policy_and_scheduler_parameters_before_any_run(flags, words, capsys) -> None:
    from thunderagent.bench.replay import parse_args

    with pytest.raises(SystemExit) as info:
        parse_args(["--trace", "t.jsonl", "--policies", "thunder", *flags])
    assert info.value.code == 2
    assert words in capsys.readouterr().err


@pytest.mark.parametrize("name", ["index", "live", "latency", "replay", "route", "tune", "sched",
                                  "gateway", "transfer", "gen", "soak", "profile", "bus",
                                  "messages", "throughput"])  # fmt: skip
def test_a_benchmark_help_names_the_command_and_says_what_it_does_in_whole_sentences(name, capsys):
    """Most said ``usage: live.py`` and a description cut off mid-sentence."""
    import importlib

    from thunderagent.bench.cli import BENCHES

    main = importlib.import_module(BENCHES[name][0]).main
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: thunderagent bench {name} ")
    description = " ".join(out.split("\n\n")[1].split())
    assert description.endswith((".", ")")), description


@pytest.mark.parametrize(
    "argv, words",
    [
        # accepted and labelled "nosuch" (run unpinned); "both", which the help offered, refused
        (["index", "--modes", "nosuch"], "argument --modes: unknown 'nosuch'"),
        (["index", "--modes", "pinned,pinned"], "argument --modes: pinned given twice"),
        # said "argument --rates: --rates: could not convert ..."
        (["throughput", "--rates", "abc"], "argument --rates: expected a number, got 'abc'"),
        (["messages", "--rates", "1,,2"], "argument --rates: an empty item"),
    ],
)
def test_a_benchmark_list_flag_says_what_it_takes_once(argv, words, capsys) -> None:
    import importlib

    from thunderagent.bench.cli import BENCHES

    main = importlib.import_module(BENCHES[argv[0]][0]).main
    with pytest.raises(SystemExit) as info:
        main(argv[1:])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert words in err and err.count("--rates:") <= 1
