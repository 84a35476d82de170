"""End-to-end replay on the tiny profile: invariants, determinism, scheduler actions, CLI."""

import json
import random
from dataclasses import dataclass, field, replace
from pathlib import Path

import pytest

from thunderagent.bench.replay_args import scheduler_for
from thunderagent.engine import TimingModel, get_profile
from thunderagent.replay import SCHEDULERS, Replay, ReplayConfig, TraceRequest
from thunderagent.replay.metrics import gpu_seconds_floor
from thunderagent.replay.summary import summarize
from thunderagent.routing import POLICIES
from thunderagent.scheduling import Dispatch, Reject
from thunderagent.scheduling.api import _Base

TINY = get_profile("tiny")  # block 4 tokens, 32 blocks, chunk 32 tokens, 8 running
BS = TINY.engine.block_size


def make_trace(n: int = 48, seed: int = 1, conversations: int = 4) -> list[TraceRequest]:
    """Conversations with their own first block; each turn extends its conversation."""
    rng = random.Random(seed)
    convs: list[list[int]] = [[s] for s in range(conversations)]
    out = []
    for i in range(n):
        conv = rng.choice(convs)
        conv.extend(rng.randrange(10**6) for _ in range(rng.randint(1, 3)))
        del conv[10:]
        prompt = len(conv) * BS - rng.randint(0, BS - 1)
        out.append(TraceRequest(str(i), i * 0.01, prompt, rng.randint(1, 12), list(conv)))
    return out


def run(policy: str, trace: list[TraceRequest], scheduler: str = "direct", seed: int = 3) -> dict:
    cfg = ReplayConfig(profile=TINY, policy=policy, workers=3, scheduler=scheduler, seed=seed)
    result = Replay(cfg, BS).run(trace, speed=2.0)
    entry = summarize(
        result,
        policy=policy,
        speed=2.0,
        timing=TimingModel(TINY),
        chunk=TINY.engine.chunked_prefill_size,
        ideal=0.0,
        pooled=0.0,
        wall_s=0.0,
    )
    entry["_records"] = result.records
    return entry


@pytest.mark.parametrize("policy", POLICIES.names())
def test_every_policy_completes_the_trace_with_sane_records(policy: str) -> None:
    trace = make_trace()
    entry = run(policy, trace)
    assert entry["requests"] == entry["completed"] == len(trace)
    assert entry["rejected"] == 0
    for rec, req in zip(entry["_records"], trace, strict=True):
        assert rec.arrival == pytest.approx(req.arrival / 2.0)
        assert rec.arrival < rec.first_token <= rec.finish
        assert rec.completion_tokens == req.output_len
        assert 0 <= rec.cached_tokens <= (req.prompt_len - 1) // BS * BS
    assert 0 <= entry["prefix_hit_ratio"] < 1
    assert 0 <= entry["prefill_recompute_ratio"] < 1
    assert entry["load_imbalance"] >= 1.0
    assert entry["ttft_ms"]["p50"] <= entry["ttft_ms"]["p99"] <= entry["e2e_ms"]["p99"]


@pytest.mark.parametrize("policy", ["round_robin", "thunder", "dynamo_kv"])
def test_engines_never_work_less_than_the_floor(policy: str) -> None:
    """``gpu_seconds_floor`` is a floor of the engine model: every run's busy time, summed over
    its engines, is at least the floor of what it served (each request's own cached tokens)."""
    entry = run(
        policy, make_trace(n=80, seed=5), scheduler="thunder" if policy == "thunder" else "direct"
    )
    floor = gpu_seconds_floor(
        TimingModel(TINY),
        [(r.prompt_tokens, r.completion_tokens, r.cached_tokens) for r in entry["_records"]],
    )
    assert floor > 0
    assert sum(entry["busy_s"]) >= floor


def test_cache_aware_policies_hit_more_than_round_robin() -> None:
    trace = make_trace(80, conversations=6)
    rr = run("round_robin", trace)["prefix_hit_ratio"]
    assert run("dynamo_kv", trace)["prefix_hit_ratio"] > rr
    assert run("sglang_cache_aware", trace)["prefix_hit_ratio"] > rr


def test_without_kv_events_the_adapters_announce_what_their_engines_cached() -> None:
    """Engines that publish no KV events: thunder's index learns each cache from what the
    adapters infer and announce (``CacheShadow``), close to what the events would say, while
    ``dynamo_kv`` keeps its own record (Dynamo's approximate mode) and its index stays empty.
    A request every 20 s of replayed time: the in-flight overlay's 30 s cover little."""
    trace = make_trace(80, conversations=6)

    def replayed(policy: str, **settings) -> tuple[Replay, dict]:
        scheduler = scheduler_for(policy, None)
        cfg = ReplayConfig(profile=TINY, policy=policy, workers=3, scheduler=scheduler, seed=3,
                           **settings)  # fmt: skip
        replay = Replay(cfg, BS)
        result = replay.run(trace, speed=0.0005)
        entry = summarize(result, policy=policy, speed=0.0005, timing=TimingModel(TINY),
                          chunk=TINY.engine.chunked_prefill_size, ideal=0.0, pooled=0.0,
                          wall_s=0.0)  # fmt: skip
        assert entry["requests"] == entry["completed"] + entry["rejected"] + entry["in_flight"]
        return replay, entry

    with_events = replayed("thunder")[1]["prefix_hit_ratio"]
    replay, entry = replayed("thunder", kv_events=False)
    assert replay.router.feeder.index.block_counts(), "the adapters' announcements"
    assert not replay.router.approximate.holds_any()
    assert entry["prefix_hit_ratio"] >= 0.9 * with_events
    peer, _ = replayed("dynamo_kv", kv_events=False)
    assert peer.router.feeder.index.block_counts() == {}
    assert peer.router.approximate.holds_any()


def test_same_seed_same_result() -> None:
    trace = make_trace()
    a, b = run("thunder", trace, seed=5), run("thunder", trace, seed=5)
    for e in (a, b):
        del e["_records"], e["wall_s"]
    assert json.dumps(a) == json.dumps(b)


def test_too_long_prompt_is_rejected_by_the_engine() -> None:
    trace = make_trace(6)
    trace.append(TraceRequest("big", 1.0, 200, 4, list(range(50))))
    entry = run("least_loaded", trace)
    assert (entry["completed"], entry["rejected"]) == (6, 1)


@dataclass
class _RejectOdd(_Base):
    """Test scheduler: dispatches even request ids to their first candidate, rejects odd ones."""

    name: str = "reject_odd"
    queue: list = field(default_factory=list)

    def submit(self, request, now):
        self.queue.append(request)

    def poll(self, now):
        out = [
            Reject(r.request_id, "odd")
            if int(r.request_id) % 2
            else Dispatch(r.request_id, r.candidates[0][0])
            for r in self.queue
        ]
        self.queue.clear()
        return out

    def waiting(self):
        return len(self.queue)


def test_scheduler_is_pluggable_and_rejects_are_counted(monkeypatch) -> None:
    monkeypatch.setitem(SCHEDULERS._factories, "reject_odd", _RejectOdd)
    entry = run("round_robin", make_trace(10), scheduler="reject_odd")
    assert (entry["completed"], entry["rejected"]) == (5, 5)


def test_cli_writes_json_and_report(tmp_path: Path, capsys) -> None:
    from thunderagent.bench.replay import main

    trace = tmp_path / "t.jsonl"
    rows = [
        {"timestamp": 10 * i, "input_length": 9 + i % 5, "output_length": 3, "hash_ids": [0, i]}
        for i in range(20)
    ]
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out, report = tmp_path / "r.json", tmp_path / "r.md"
    main(
        [
            "--trace",
            str(trace),
            "--profile",
            "tiny",
            "--block-size",
            "4",
            "--workers",
            "2",
            "--policies",
            "round_robin,thunder",
            "--speed",
            "1,2",
            "--quiet",
            "--json",
            str(out),
            "--report",
            str(report),
        ]
    )
    doc = json.loads(out.read_text())
    assert doc["cluster"] == {
        "workers": 2,
        "profile": "tiny",
        "kv_blocks_per_worker": 32,
        "block_size": 4,
    }
    assert [(e["policy"], e["speed"]) for e in doc["results"]] == [
        ("round_robin", 1.0),
        ("thunder", 1.0),
        ("round_robin", 2.0),
        ("thunder", 2.0),
    ]
    assert all(e["completed"] == 20 for e in doc["results"])
    for e in doc["results"][1::2]:  # thunder's scheduler: every request once, queued or on credit
        sched = e["scheduler"]
        assert sched["submitted"] == 20, sched
        assert sched["dispatched"] == sched["submitted"] - sched["rejected"]
        assert sched["direct"] == sched["direct_dispatches"] <= 20
    ceiling = doc["work_ceiling"]
    assert ceiling["workers"] == 2 and ceiling["span_s"] == 0.19  # Mooncake timestamps are ms
    assert ceiling["none"]["speed"] <= ceiling["pooled"]["speed"] <= ceiling["ideal"]["speed"]
    assert ceiling["none"]["engine_s"] > ceiling["ideal"]["engine_s"] > 0
    assert "| thunder | 2 | 20 |" in report.read_text()
    assert "every speed up to it meeting it |" in report.read_text()
    assert "Work ceiling" in report.read_text()
    printed = capsys.readouterr().out
    heading = next(i for i, line in enumerate(printed.splitlines()) if "Capacity at" in line)
    assert printed.splitlines()[heading + 2].startswith("| policy | scheduler |")
    assert printed.index("Work ceiling") < printed.index("Capacity at")
    assert "thunder" in printed


def test_cli_sched_params_reach_the_scheduler_and_bad_ones_are_refused(tmp_path: Path) -> None:
    from thunderagent.bench.replay import _sched_params, main

    assert _sched_params({"order": "fcfs"}, "thunder", None) == {"order": "fcfs"}
    assert _sched_params({"order": "fcfs"}, "round_robin", None) == {}  # peers ship as direct
    assert _sched_params({"order": "fcfs"}, "round_robin", "fcfs") == {"order": "fcfs"}
    trace = tmp_path / "t.jsonl"
    rows = [
        {"timestamp": 10 * i, "input_length": 9, "output_length": 3, "hash_ids": [0, i]}
        for i in range(6)
    ]
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "r.json"
    common = ["--trace", str(trace), "--profile", "tiny", "--block-size", "4", "--workers", "2"]
    common += ["--policies", "round_robin,thunder", "--quiet"]
    main([*common, "--sched-param", "order=fcfs", "--json", str(out)])
    doc = json.loads(out.read_text())
    assert doc["scheduler_params"] == {"order": "fcfs"}
    assert all(e["completed"] == 6 for e in doc["results"])
    for bad in ("order=lifo", "no_such_knob=1", "max_running=-1"):
        with pytest.raises(SystemExit):
            main([*common, "--sched-param", bad])


def test_cli_params_for_a_policy_the_run_does_not_replay_are_refused(capsys) -> None:
    """``--param scheduler.grouping=false`` used to be dropped without a word."""
    from thunderagent.bench.replay import parse_args

    base = ["--trace", "t.jsonl", "--policies", "thunder"]
    assert parse_args([*base, "--param", "thunder.evict_weight=0"]).params == {
        "thunder": {"evict_weight": 0}
    }
    for bad, said in (
        ("scheduler.grouping=false", "--sched-param"),
        ("dynamo_kv.x=1", "dynamo_kv"),
    ):
        with pytest.raises(SystemExit):
            parse_args([*base, "--param", bad])
        assert said in capsys.readouterr().err


def test_a_trace_arriving_at_once_has_no_work_ceiling(tmp_path: Path) -> None:
    from thunderagent.bench.replay import main

    trace = tmp_path / "t.jsonl"
    row = {"timestamp": 0, "input_length": 9, "output_length": 3, "hash_ids": [0, 1]}
    trace.write_text(json.dumps(row) + "\n")
    out = tmp_path / "r.json"
    main(["--trace", str(trace), "--profile", "tiny", "--block-size", "4", "--workers", "2",
          "--policies", "round_robin", "--speed", "1", "--quiet", "--json", str(out)])  # fmt: skip
    doc = json.loads(out.read_text())  # strict JSON: no Infinity
    assert doc["work_ceiling"]["none"]["speed"] is None
    assert doc["work_ceiling"]["none"]["engine_s"] > 0


def test_capacity_names_the_highest_speed_met_and_the_highest_met_throughout() -> None:
    from thunderagent.bench.replay import capacity

    def entry(policy: str, speed: float, met: bool) -> dict:
        return {
            "policy": policy,
            "speed": speed,
            "slo_met": met,
            "goodput_rps": 1.0,
            "ttft_p99_all_ms": 1.0,
        }

    lucky = [entry("a", s, m) for s, m in [(16, True), (18, False), (20, True), (22, False)]]
    steady = [entry("b", s, m) for s, m in [(16, True), (18, True), (20, False), (22, False)]]
    never = [entry("c", s, False) for s in (16, 18)]
    late = [entry("d", s, m) for s, m in [(16, False), (18, True)]]
    out = capacity(lucky + steady + never + late, ["a", "b", "c", "d"])
    assert (out["a"]["max_speed_meeting_slo"], out["a"]["sustained_speed"]) == (20, 16)
    assert (out["b"]["max_speed_meeting_slo"], out["b"]["sustained_speed"]) == (18, 18)
    assert (out["c"]["max_speed_meeting_slo"], out["c"]["sustained_speed"]) == (None, None)
    assert (out["d"]["max_speed_meeting_slo"], out["d"]["sustained_speed"]) == (18, None)


@pytest.mark.parametrize(
    "flags, words",
    [
        (["--speed", "inf"], "argument --speed: must be a finite positive number, got inf"),
        (["--speed", "1,,2"], "argument --speed: an empty item in '1,,2'"),
        (["--speed", "2,1,2"], "argument --speed: 2 given twice"),
        (["--policies", "thunder,thunder"], "argument --policies: thunder given twice"),
        (["--policies", "nosuch"], "argument --policies: unknown 'nosuch'"),
    ],
)
def test_cli_sweep_lists_run_each_item_once(flags, words, capsys) -> None:
    """A repeated speed or policy ran twice and its capacity was reported once; ``inf`` swept
    nothing; an empty item vanished."""
    from thunderagent.bench.replay import parse_args

    assert parse_args(["--trace", "t.jsonl"]).policy_list == POLICIES.names()
    with pytest.raises(SystemExit) as info:
        parse_args(["--trace", "t.jsonl", *flags])
    assert info.value.code == 2
    assert words in capsys.readouterr().err


def test_cli_help_shows_the_sweep_defaults(capsys) -> None:
    from thunderagent.bench.replay import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "or all (default: all)" in help_text and "comma list (default: 1)" in help_text


@pytest.mark.parametrize(
    "flags, words",
    [
        (
            ["--policies", "round_robin", "--sched-param", "kv_watermark=0.5"],
            "--sched-param: no run here uses the thunder scheduler (policies round_robin, "
            "scheduler as deployed",
        ),
        (
            ["--policies", "thunder", "--scheduler", "direct", "--sched-param", "order=fcfs"],
            "(policies thunder, scheduler direct",
        ),
        (["--migration-param", "horizon_s=10"], "--migration-param: --migration is off"),
        (["--kv-events", "off", "--migration", "nixl"], "with --kv-events off it has none"),
    ],
)
def test_cli_overrides_no_run_would_use_are_refused(flags, words, capsys) -> None:
    """They used to be recorded in the JSON's settings and change nothing."""
    from thunderagent.bench.replay import parse_args

    with pytest.raises(SystemExit) as info:
        parse_args(["--trace", "t.jsonl", *flags])
    assert info.value.code == 2
    assert words in capsys.readouterr().err


def test_cli_overrides_some_run_uses_are_kept() -> None:
    from thunderagent.bench.replay import parse_args

    base = ["--trace", "t.jsonl", "--sched-param", "order=fcfs"]
    assert parse_args([*base, "--policies", "round_robin,thunder"]).sched_params == {
        "order": "fcfs"
    }
    assert parse_args([*base, "--policies", "round_robin", "--scheduler", "fcfs"]).sched_params


def test_cli_output_paths_are_checked_before_the_run(tmp_path: Path, capsys) -> None:
    """A --plot on a file or a --json under a file was a traceback after the whole run."""
    from thunderagent.bench.replay import parse_args

    a_file = tmp_path / "afile"
    a_file.write_text("")
    for flags, words in (
        (["--plot", str(a_file)], "argument --plot: "),
        (["--json", str(a_file / "x.json")], "argument --json: "),
        (["--report", str(tmp_path)], "argument --report: "),
    ):
        with pytest.raises(SystemExit) as info:
            parse_args(["--trace", "t.jsonl", *flags])
        assert info.value.code == 2
        assert words in capsys.readouterr().err


def test_cli_writes_the_json_before_printing(tmp_path: Path, monkeypatch) -> None:
    """``... | head -5`` closes stdout: the tables fail to print, the JSON is already written."""
    from thunderagent.bench.replay import main

    class ClosedPipe:
        def write(self, text: str) -> int:
            raise BrokenPipeError

        def flush(self) -> None:
            pass

    trace = tmp_path / "t.jsonl"
    row = {"timestamp": 0, "input_length": 9, "output_length": 3, "hash_ids": [0, 1]}
    trace.write_text(json.dumps(row) + "\n")
    out = tmp_path / "r.json"
    monkeypatch.setattr("sys.stdout", ClosedPipe())
    with pytest.raises(BrokenPipeError):
        main(["--trace", str(trace), "--profile", "tiny", "--block-size", "4", "--workers", "2",
              "--policies", "round_robin", "--quiet", "--json", str(out)])  # fmt: skip
    assert json.loads(out.read_text())["results"]


def test_each_policy_sees_load_reports_as_it_ships_unless_overridden(tmp_path: Path) -> None:
    """SMG polls an HTTP worker's load every 10 s; the replay gave it the adapters' 0.1 s. And
    the replay gave ThunderAgent 0.1 s while its live adapter reports every 0.2 s. The poll is
    SMG's own setting (a policy parameter the router core applies), not the reports' interval."""
    from thunderagent.bench.replay import main
    from thunderagent.bench.replay_args import loads_seen_every, report_interval
    from thunderagent.worker.adapter import AdapterConfig

    # ThunderAgent and the peers that read its reports get them at the live adapter's beat.
    adapter_beat = AdapterConfig(worker_id="w", engine_url="http://x").load_interval_s
    assert adapter_beat == ReplayConfig(profile=get_profile("tiny"), policy="thunder").load_interval
    assert loads_seen_every("thunder", {}, None) == adapter_beat
    assert loads_seen_every("dynamo_kv", {}, None) == adapter_beat
    assert loads_seen_every("smg_cache_aware", {}, None) == 10.0
    assert loads_seen_every("smg_cache_aware", {}, 0.5) == 10.0
    assert loads_seen_every("smg_cache_aware", {"load_monitor_interval_s": 0}, 0.5) == 0.5
    # llm-d scrapes each engine every 50 ms itself: its replay builds reports that often
    assert loads_seen_every("llm_d", {}, None) == report_interval("llm_d", {}, None) == 0.05
    assert report_interval("llm_d", {}, 0.01) == 0.01  # a finer beat asked for: every report
    assert report_interval("smg_cache_aware", {}, None) == adapter_beat  # the core skips the rest
    assert report_interval("thunder", {}, 0.5) == 0.5
    trace = tmp_path / "t.jsonl"
    rows = [{"timestamp": 10 * i, "input_length": 9, "output_length": 3, "hash_ids": [0, i]}
            for i in range(20)]  # fmt: skip
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    common = ["--trace", str(trace), "--profile", "tiny", "--block-size", "4", "--workers", "2",
              "--policies", "thunder,smg_cache_aware", "--speed", "1", "--quiet"]  # fmt: skip
    shipped, forced = tmp_path / "a.json", tmp_path / "b.json"
    report = tmp_path / "a.md"
    main([*common, "--json", str(shipped), "--report", str(report)])
    main([*common, "--load-interval", "0.5", "--param", "smg_cache_aware.load_monitor_interval_s=0",
          "--json", str(forced)])  # fmt: skip
    assert json.loads(shipped.read_text())["load_interval_s"] == {
        "thunder": adapter_beat,
        "smg_cache_aware": 10.0,
    }
    said = f"load reports every {adapter_beat:g} s (smg_cache_aware every 10 s)"
    assert said in report.read_text()
    assert set(json.loads(forced.read_text())["load_interval_s"].values()) == {0.5}


def _arriving_in_groups(group: int = 6) -> list[TraceRequest]:
    """``make_trace``'s conversations behind one block every prompt shares, arriving ``group``
    at one instant (as the Mooncake conversation trace's 3 s timestamps have them)."""
    return [
        replace(
            r, arrival=(i // group) * 0.5, prompt_len=r.prompt_len + BS, block_ids=[7, *r.block_ids]
        )
        for i, r in enumerate(make_trace(60, seed=2, conversations=8))
    ]


@pytest.mark.parametrize("policy", ["thunder", "dynamo_kv"])
def test_the_routers_index_holds_what_the_engines_hold_after_requests_arrive_together(
    policy: str,
) -> None:
    """Requests batched on a prefix in flight are false hits; the index still follows the KV
    events. (A false hit used to drop the shared first block from the index, and with it every
    prefix under it: the router lost sight of that worker's cache for the rest of the run.)"""
    trace = _arriving_in_groups()
    cfg = ReplayConfig(
        profile=TINY, policy=policy, workers=3, scheduler=scheduler_for(policy, None), seed=1
    )
    replay = Replay(cfg, BS)
    result = replay.run(trace, speed=1.0)
    assert len(result.records) == len(trace)
    assert all(r.status == "completed" for r in result.records)
    index = replay.router.feeder.gpu_index
    checked = 0
    for rid, hashes in replay.keys.items():
        held = index.overlap(hashes.primary, hashes.check)
        for w, core in enumerate(replay.cores):
            engine = core.cache.match(list(hashes.primary)).gpu
            assert held.get(replay.ids[w], 0) == engine, (rid, w)
            checked += engine > 0
    assert checked > len(trace)  # most prompts are still cached somewhere
