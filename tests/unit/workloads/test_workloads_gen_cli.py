"""``thunderagent bench gen``: the files it writes load as traces and match their sidecar."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from thunderagent.bench import gen
from thunderagent.bench.cli import BENCHES
from thunderagent.replay import TraceError, load_trace

ARGS = {
    "agent": ["--scale", "0.1"],
    "bursty": ["--scale", "0.2", "--burst-size", "30"],
    "hotspot": ["--duration", "150", "--hot-start", "50", "--hot-duration", "30"],
}


@pytest.mark.parametrize("kind", sorted(ARGS))
def test_gen_writes_a_loadable_trace_and_its_meta(kind: str, tmp_path: Path, capsys) -> None:
    out = tmp_path / f"{kind}.jsonl"
    assert gen.main(["--kind", kind, "--out", str(out), "--seed", "7", *ARGS[kind]]) == 0
    meta = json.loads((tmp_path / f"{kind}.meta.json").read_text())
    trace = load_trace(out)
    assert meta["kind"] == kind and meta["seed"] == 7 and meta["requests"] == len(trace)
    assert abs(trace[-1].arrival - meta["span_s"]) < 1e-6
    assert 0.0 < meta["pooled_hit_ratio"] <= meta["ideal_hit_ratio"] < 1.0
    assert meta["params"]["block_size"] == 512 and meta["pooled_capacity"]["workers"] == 8
    ceiling = meta["work_ceiling"]  # what ``bench replay`` of this file reports
    assert ceiling["workers"] == 8 and ceiling["span_s"] == pytest.approx(meta["span_s"], abs=1e-3)
    assert ceiling["none"]["speed"] <= ceiling["pooled"]["speed"] <= ceiling["ideal"]["speed"]
    line = capsys.readouterr().out
    assert f"{meta['requests']} requests" in line and "pooled hit" in line
    assert "work ceiling" in line
    if kind == "agent":
        assert all(r.session is not None and r.step is not None for r in trace)
    if kind == "hotspot":
        assert meta["hot_start_s"] == 50.0 and meta["hot_end_s"] == 80.0
        hot = [r for r in trace if r.hot]
        assert len(hot) == meta["hot_requests"] > 0
        assert all(50.0 <= r.arrival < 80.0 for r in hot)
        n = meta["hot_prefix_blocks"]
        assert len({tuple(r.block_ids[:n]) for r in hot}) == 1


def test_same_arguments_same_bytes(tmp_path: Path) -> None:
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    for out in (a, b):
        gen.main(["--kind", "bursty", "--out", str(out), "--scale", "0.1", "--seed", "3"])
    assert a.read_bytes() == b.read_bytes()
    gen.main(["--kind", "bursty", "--out", str(b), "--scale", "0.1", "--seed", "4"])
    assert a.read_bytes() != b.read_bytes()


def test_block_size_and_param_reach_the_generator(tmp_path: Path) -> None:
    out = tmp_path / "t.jsonl"
    gen.main(["--kind", "agent", "--out", str(out), "--block-size", "64", "--param", "programs=5"])
    meta = json.loads(gen.meta_path(out).read_text())
    assert meta["params"]["programs"] == 5 and meta["block_size"] == 64
    for r in load_trace(out, block_size=64):
        assert len(r.block_ids) == -(-r.prompt_len // 64)
    with pytest.raises(TraceError, match="per 512-token block"):  # read at the wrong size
        load_trace(out)


@pytest.mark.parametrize(
    "argv",
    [
        ["--kind", "agent", "--duration", "10"],  # bursty/hotspot only
        ["--kind", "hotspot", "--param", "hot_clients=-1"],
        ["--kind", "bursty", "--param", "burst_rate_per_s"],
    ],
)
def test_bad_arguments_exit_with_a_message(argv: list[str], tmp_path: Path, capsys) -> None:
    out = tmp_path / "x.jsonl"
    with pytest.raises(SystemExit) as err:
        gen.main([*argv, "--out", str(out)])
    assert err.value.code == 2  # a usage error, whether argparse or the generator finds it
    assert capsys.readouterr().err.splitlines()[-1].startswith("thunderagent bench gen: error: ")
    assert not out.exists()


def test_registered_as_a_bench() -> None:
    assert BENCHES["gen"][0] == "thunderagent.bench.gen"
    assert gen.meta_path(Path("d/x.jsonl")) == Path("d/x.meta.json")
    assert gen.meta_path(Path("d/x.json")) == Path("d/x.json.meta.json")
