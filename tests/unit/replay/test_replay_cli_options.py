"""``bench replay``'s options that shape a run's engines, answers and per-request output:
``--engine-pricing``, ``--max-output``, ``--requests-jsonl``, ``--handoff-ms``, on a tiny Mooncake
trace."""

import json
from pathlib import Path

import pytest


def tiny_trace(tmp_path: Path, rows: list[dict]) -> Path:
    """``rows`` written as a Mooncake trace (4-token blocks with the ``tiny`` profile)."""
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return trace


def test_cli_engine_pricing_reaches_the_engines_and_keeps_the_slo(tmp_path: Path) -> None:
    """``--engine-pricing dynamo-mocker`` prices the engines' steps as Dynamo's mocker (a prefill
    by its new tokens, a shared page read once per decode step); the SLO stays the profile's."""
    from thunderagent.bench.replay import main

    rows = [{"timestamp": 5 * i, "input_length": 28, "output_length": 6,
             "hash_ids": [0, 1, 2, 3, 4, 5, 100 + i]} for i in range(24)]  # fmt: skip
    trace = tiny_trace(tmp_path, rows)
    common = ["--trace", str(trace), "--profile", "tiny", "--block-size", "4", "--workers", "2",
              "--policies", "thunder", "--speed", "1", "--quiet"]  # fmt: skip
    docs = {}
    for pricing in ("profile", "dynamo-mocker"):
        out = tmp_path / f"{pricing}.json"
        main([*common, "--engine-pricing", pricing, "--json", str(out)])
        docs[pricing] = json.loads(out.read_text())
    paid, mocker = docs["profile"], docs["dynamo-mocker"]
    assert (paid["engine_pricing"], mocker["engine_pricing"]) == ("profile", "dynamo-mocker")
    assert paid["slo_ttft_p99_ms"] == mocker["slo_ttft_p99_ms"]
    a, b = paid["results"][0], mocker["results"][0]
    assert a["prefix_hit_ratio"] > 0.5 and b["prefix_hit_ratio"] > 0.5
    assert b["ttft_ms"]["mean"] < a["ttft_ms"]["mean"]  # 4 new tokens after 24 cached: cheaper
    assert b["e2e_ms"]["mean"] < a["e2e_ms"]["mean"]  # and decoding sharers read 24 once


def test_cli_max_output_caps_what_each_request_generates(tmp_path: Path) -> None:
    """``--max-output`` replays what ``bench live`` sends: every answer cut at the cap."""
    from thunderagent.bench.replay import parse_args, run

    rows = [{"timestamp": 50 * i, "input_length": 28, "output_length": 3 + i % 5,
             "hash_ids": [0, 1, 2, 3, 4, 5, 100 + i]} for i in range(12)]  # fmt: skip
    trace = tiny_trace(tmp_path, rows)
    common = ["--trace", str(trace), "--profile", "tiny", "--block-size", "4", "--workers", "2",
              "--policies", "round_robin", "--speed", "1", "--quiet"]  # fmt: skip
    for flags, expected in (([], [3 + i % 5 for i in range(12)]), (["--max-output", "4"], None)):
        doc, results = run(parse_args([*common, *flags]))
        got = [r.completion_tokens for r in next(iter(results.values())).records]
        assert got == (expected or [min(3 + i % 5, 4) for i in range(12)])
        assert doc["max_output"] == (4 if flags else None)


def test_cli_requests_jsonl_has_every_request_of_every_run(tmp_path: Path) -> None:
    """``--requests-jsonl``: one line per request per (policy, speed), each request's life in
    order (arrival, then its dispatch, then its first token), its records' own figures."""
    from thunderagent.bench.replay import main

    rows = [{"timestamp": 5 * i, "input_length": 28, "output_length": 4,
             "hash_ids": [0, 1, 2, 3, 4, 5, 100 + i]} for i in range(10)]  # fmt: skip
    trace = tiny_trace(tmp_path, rows)
    out, doc = tmp_path / "req.jsonl", tmp_path / "r.json"
    main(["--trace", str(trace), "--profile", "tiny", "--block-size", "4", "--workers", "2",
          "--policies", "thunder,round_robin", "--speed", "1,4", "--quiet",
          "--requests-jsonl", str(out), "--json", str(doc)])  # fmt: skip
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(lines) == 4 * 10
    runs = {(x["policy"], x["speed"]) for x in lines}
    assert runs == {(p, s) for p in ("thunder", "round_robin") for s in (1.0, 4.0)}
    for x in lines:
        assert x["status"] == "completed" and x["worker"] in (0, 1) and x["routed_to"] in (0, 1)
        assert x["arrival"] <= x["dispatched"] <= x["first_token"] <= x["finish"]
    results = json.loads(doc.read_text())["results"]
    for e in results:  # the lines are the runs' own records: the same hit ratio
        mine = [x for x in lines if (x["policy"], x["speed"]) == (e["policy"], e["speed"])]
        hit = sum(x["cached_tokens"] for x in mine) / sum(x["prompt_tokens"] for x in mine)
        assert hit == pytest.approx(e["prefix_hit_ratio"])


def test_cli_handoff_ms_delays_every_hand_off_to_a_worker(tmp_path: Path) -> None:
    """``--handoff-ms``: a request handed to its worker (on credit or by the scheduler) reaches
    the engine, and the router hears it was taken, that much later (live: the adapter's ack);
    the router counts an offer's prompt as in flight there from the offer. Every request is
    still accounted."""
    from thunderagent.bench.replay import main

    rows = [{"timestamp": 5 * i, "input_length": 28, "output_length": 4,
             "hash_ids": [0, 1, 2, 3, 4, 5, 100 + i]} for i in range(12)]  # fmt: skip
    trace = tiny_trace(tmp_path, rows)
    waits = {}
    for handoff in ("0", "50"):
        out, doc = tmp_path / f"req{handoff}.jsonl", tmp_path / f"r{handoff}.json"
        extra = ["--handoff-ms", handoff] if handoff != "0" else []
        main(["--trace", str(trace), "--profile", "tiny", "--block-size", "4", "--workers", "2",
              "--policies", "thunder", "--speed", "1", "--quiet", *extra,
              "--requests-jsonl", str(out), "--json", str(doc)])  # fmt: skip
        result = json.loads(doc.read_text())["results"][0]
        assert result["requests"] == result["completed"] == 12
        assert json.loads(doc.read_text())["handoff_ms"] == float(handoff)
        lines = [json.loads(x) for x in out.read_text().splitlines()]
        waits[handoff] = [x["dispatched"] - x["arrival"] for x in lines]
    assert min(waits["0"]) == 0.0  # the first ones go at once
    assert min(waits["50"]) >= 0.05 - 1e-9
