"""bench tune: the candidate grid, the ranking rule, and a small run end to end."""

from __future__ import annotations

import argparse
import json
import math

import pytest

from thunderagent.bench import gen, tune


def test_one_parameter_names_its_values_and_a_scheduler_knob_goes_to_the_scheduler() -> None:
    assert tune.candidates([tune._values("thunder.recompute_gain=2,4")]) == [
        ("thunder@2", {"recompute_gain": 2.0}, {}),
        ("thunder@4", {"recompute_gain": 4.0}, {}),
    ]
    assert tune.candidates([tune._values("scheduler.kv_watermark=0.9")]) == [
        ("scheduler@0.9", {}, {"kv_watermark": 0.9}),
    ]


def test_repeated_parameters_make_every_combination() -> None:
    got = tune.candidates(
        [tune._values("thunder.recompute_gain=2,4"), tune._values("scheduler.kv_watermark=0.9,1")]
    )
    assert [(route["recompute_gain"], sched["kv_watermark"]) for _, route, sched in got] == [
        (2.0, 0.9),
        (2.0, 1.0),
        (4.0, 0.9),
        (4.0, 1.0),
    ]
    assert got[1][0] == "thunder.recompute_gain=2,scheduler.kv_watermark=1"
    assert len({name for name, _, _ in got}) == 4


@pytest.mark.parametrize("text", ["recompute_gain=2", "router.recompute_gain=2", "thunder.=1"])
def test_a_parameter_without_its_owner_is_refused(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match=r"expected thunder\.FIELD"):
        tune._values(text)


@pytest.mark.parametrize(
    "flags, words",
    [
        (["--param", "thunder.recompute_gain=abc"], "argument --param: "),
        (["--param", "thunder.recompute_gain=2,2"], "argument --param: "),
        (["--speeds", "0"], "argument --speeds: "),
        (["--speeds", "1,-1"], "argument --speeds: "),
        (["--speeds", "1,inf"], "argument --speeds: "),
        (["--peers", "nosuch"], "argument --peers: unknown 'nosuch'"),
    ],
)
def test_bad_values_are_one_line_before_any_run(flags, words, capsys) -> None:
    """Each was a ValueError traceback (the speeds and peers only after thunder's runs)."""
    with pytest.raises(SystemExit) as info:
        tune.main(["--traces", "t.jsonl", "--param", "thunder.recompute_gain=1", *flags])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: thunderagent bench tune") and words in err


def test_ranking_is_worst_capacity_ratio_then_misses_then_goodput() -> None:
    def workload(caps: dict, p99: dict, goodput: dict, best: float) -> dict:
        return {
            "slo_ms": 1000.0,
            "capacity": caps,
            "best_peer_capacity": best,
            "ttft_p99_ms": p99,
            "goodput": goodput,
        }

    # speeds 1, 2: the peer meets the SLO at both (500, 900 ms)
    w = workload(
        {"a": 2.0, "b": 2.0, "c": 1.0, "peer": 2.0},
        {"a": [520, 960], "b": [515, 900], "c": [400, 2000], "peer": [500, 900]},
        {"a": [1.0, 2.0], "b": [1.0, 1.0], "c": [5.0, 5.0], "peer": [1.0, 2.0]},
        2.0,
    )
    # a: 520 <= 1.05 x 500, 960 > 945: one miss; b: none; c: 2000 > 945: one, and half the
    # capacity
    assert [tune.p99_misses(w, n, ["peer"]) for n in "abc"] == [1, 0, 1]
    scores = {n: tune.scores({"t": w}, n, ["peer"]) for n in "abc"}
    assert scores == {
        "a": (1.0, -1, 0.0, 3.0),
        "b": (1.0, 0, 0.0, 2.0),
        "c": (0.5, -1, math.log(0.5), 10.0),
    }
    assert max("abc", key=scores.__getitem__) == "b"


def test_a_tie_on_the_worst_ratio_and_misses_goes_to_capacity_before_goodput() -> None:
    """One workload where every candidate is level with the best peer must not leave goodput
    to decide: the capacity ratios elsewhere do, once worst ratio and misses tie."""

    def workload(caps: dict, goodput: float) -> dict:
        return {
            "slo_ms": 1000.0,
            "capacity": {**caps, "peer": 2.0},
            "best_peer_capacity": 2.0,
            "ttft_p99_ms": {n: [900] for n in (*caps, "peer")},
            "goodput": {n: [goodput if n == "a" else 1.0] for n in (*caps, "peer")},
        }

    level = workload({"a": 2.0, "b": 2.0}, goodput=9.0)  # both 1.00 x, a with more goodput
    apart = workload({"a": 2.0, "b": 3.0}, goodput=1.0)  # a 1.00 x, b 1.50 x
    scores = {n: tune.scores({"level": level, "apart": apart}, n, ["peer"]) for n in "ab"}
    assert scores["a"][:3] == (1.0, 0, 0.0)
    assert scores["b"][:3] == (1.0, 0, pytest.approx(math.log(1.5)))
    assert max("ab", key=scores.__getitem__) == "b"


def test_a_grid_runs_end_to_end_and_every_candidate_reaches_the_router(tmp_path, capsys) -> None:
    trace = tmp_path / "b.jsonl"
    made = gen.main(["--kind", "bursty", "--out", str(trace), "--seed", "3", "--duration", "20"])
    assert made == 0
    out = tmp_path / "tune.json"
    tune.main(
        [
            "--traces", str(trace), "--speeds", "1,4", "--peers", "dynamo_kv",
            "--param", "thunder.recompute_gain=2,4", "--param", "thunder.busy_kv_share=0.2,0.7",
            "--json", str(out),
        ]
    )  # fmt: skip
    report = json.loads(out.read_text())
    assert len(report["candidates"]) == 4
    assert report["recommended"] in report["candidates"]
    w = report["workloads"]["b"]
    assert set(w["capacity"]) == {*report["candidates"], "dynamo_kv"}
    assert all(len(v) == 2 for v in w["ttft_p99_ms"].values())
    # an out-of-range value fails in the policy, which is built from the grid's values before
    # any run: one line naming the candidate, not a traceback after the peers' runs
    capsys.readouterr()
    with pytest.raises(SystemExit) as info:
        tune.main(
            ["--traces", str(trace), "--speeds", "1", "--peers", "dynamo_kv",
             "--param", "thunder.busy_kv_share=1.5"]
        )  # fmt: skip
    assert info.value.code == 2
    assert "--param (thunder@1.5): thunder.busy_kv_share=1.5" in capsys.readouterr().err


def test_the_worker_count_reaches_every_run(tmp_path, monkeypatch) -> None:
    """A default chosen where caches fill (fewer workers) is tuned with the same command."""
    seen: list[int] = []
    real = tune.Replay

    class Spy(real):  # type: ignore[misc, valid-type]
        def __init__(self, config, block_size: int) -> None:
            seen.append(config.workers)
            super().__init__(config, block_size)

    monkeypatch.setattr(tune, "Replay", Spy)
    trace = tmp_path / "b.jsonl"
    made = gen.main(["--kind", "bursty", "--out", str(trace), "--seed", "3", "--duration", "10"])
    assert made == 0
    out = tmp_path / "tune.json"
    tune.main(
        ["--traces", str(trace), "--speeds", "1,2", "--peers", "dynamo_kv", "--workers", "3",
         "--param", "thunder.recompute_gain=4", "--json", str(out)]
    )  # fmt: skip
    assert seen == [3, 3, 3, 3]  # thunder and the peer, at each speed
    assert json.loads(out.read_text())["workers"] == 3
