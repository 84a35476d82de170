"""bench profile / throughput: the pieces that turn raw measurements into figures (profiler
output, spans, CPU readings, the rate sweep's verdicts) and the open-loop generator."""

from __future__ import annotations

import argparse
import asyncio
import os
import time

import pytest

from thunderagent.bench import loadgen, perf, procs, pyspy, throughput
from thunderagent.bench.spans import Span, breakdown, critical_path

COLLAPSED = """\
<module> (/x/runner.py:1);Runner.run (/usr/lib/python3.11/asyncio/runners.py:118) 50
<module> (/x/runner.py:1);process (/w/libs/thunderagent/bus/bus.py:160) 20
<module> (/x/runner.py:1);Parser.parse (/v/site-packages/nats/protocol/parser.py:80) 20
<module> (/x/runner.py:1);start_as_current_span (/v/site-packages/opentelemetry/trace/__init__.py:9) 10
garbage line without a count
"""  # noqa: E501


def test_pyspy_self_time_leaves_the_loop_out_of_the_step_shares() -> None:
    prof = pyspy.parse_collapsed(COLLAPSED)
    assert prof.samples == 100 and prof.outside_python_pct == 50.0
    assert prof.steps == {
        "bus (msgspec encode/decode, dispatch)": 40.0,
        "nats-py (parser, messages, subscription queues, socket writes)": 40.0,
        "tracing": 20.0,
    }
    assert prof.top[0] == ("process (thunderagent/bus/bus.py)", 40.0)
    assert pyspy.parse_collapsed("").samples == 0


@pytest.mark.parametrize(
    ("path", "step"),
    [
        ("/v/site-packages/aiohttp/client.py", "HTTP (aiohttp, yarl, multidict)"),
        ("/usr/lib/python3.11/asyncio/tasks.py", "asyncio (tasks, futures, timeouts, events)"),
        ("/w/libs/thunderagent/routing/cost.py", "index / route / rank"),
        ("/w/libs/thunderagent/hashing/blocks.py", "hash"),
        ("/somewhere/else.py", "other"),
    ],
)
def test_pyspy_steps_by_file(path: str, step: str) -> None:
    assert pyspy.step_of(path) == step


def test_perf_groups_by_shared_object() -> None:
    assert perf.group_of("[kernel.kallsyms]").startswith("kernel")
    assert perf.group_of("libpython3.11.so.1.0") == "Python interpreter"
    assert perf.group_of("_core.cpython-311-x86_64-linux-gnu.so") == "msgspec"
    assert perf.group_of("nats-server") == "nats-server (Go)"
    assert perf.group_of("libfoo.so") == "other"


def _span(name, sid, parent, start, end, trace="t1") -> Span:
    return Span("svc", name, trace, sid, parent, start * 1000, end * 1000)


def test_spans_follow_the_critical_path_whichever_way_it_went() -> None:
    trace = [
        _span("client generate", "c", "", 0, 1000),
        _span("router requests", "r", "c", 100, 400),
        _span("router route", "rr", "r", 120, 390),
        _span("migration route", "m", "rr", 150, 160),  # an observer: off the path
        _span("worker-w3 worker", "w", "rr", 300, 900),
        _span("engine generate", "e", "w", 500, 550),
    ]
    chain = critical_path(trace)
    assert [s.name for s in chain] == [
        "client generate", "router requests", "router route", "worker-w3 worker", "engine generate"
    ]  # fmt: skip
    out = breakdown([*trace, _span("engine generate", "x", "gone", 0, 1, trace="t2")])
    assert out["sampled_traces"] == 1, "a trace with a missing parent is left out"
    stages = out["stages_us"]
    assert stages["router route -> worker worker"]["p50"] == 180.0
    assert stages["worker worker -> engine generate"]["p50"] == 200.0
    assert stages["engine end -> client's final reply"]["p50"] == 450.0
    assert stages["total (client span)"]["p50"] == 1000.0


def test_cpu_per_request_less_idle_and_grouped() -> None:
    used = {"router-0": 3_000_000, "worker-w0": 1_000_000, "worker-w1": 1_500_000}
    per = procs.per_request_us(used, 1000, idle_ns_per_s={"router-0": 500_000}, seconds=2.0)
    assert per == {"router-0": 2.0, "worker-w0": 1.0, "worker-w1": 1.5}
    assert procs.group(per, [("worker", "worker-")]) == {"router-0": 2.0, "worker": 2.5}


def test_cpu_meter_reads_this_process() -> None:
    meter = procs.CpuMeter({"me": os.getpid()})
    meter.start()
    sum(i * i for i in range(300_000))
    used = meter.stop()
    assert used["me"] > 0 and used["loadgen"] > 0
    assert 0.0 <= meter.kernel_share["me"] <= 1.0
    assert set(meter.runs) == {"me", "loadgen"}


def test_the_meter_counts_wake_ups() -> None:
    """A thread woken 50 times is put on a CPU about 50 times (the kernel's timeslice count):
    a count, not the nanoseconds waited. A wake-up may find the waker's set before the wait
    and skip the sleep (49 seen on a loaded VM at stop 67), so the floor has room."""
    import threading

    ready, done = threading.Event(), threading.Event()

    def sleeper() -> None:
        for _ in range(50):
            ready.wait()
            ready.clear()
        done.set()

    t = threading.Thread(target=sleeper)
    t.start()
    meter = procs.CpuMeter({"me": os.getpid()}, own=False)
    meter.start()
    while not done.is_set():
        ready.set()
        time.sleep(0.002)
    meter.stop()
    t.join()
    # a count, not nanoseconds: ~50 wake-ups each side, not the thousands of ns they waited
    assert 40 <= meter.runs["me"] < 1000, meter.runs


def _row(rate, p99, achieved=None, errors=0) -> dict:
    system = {"errors": errors, "achieved_rate": achieved if achieved is not None else rate}
    return {"rate": rate, "added_p99_ms": p99, "system": system}


def test_the_sweep_holds_steps_on_and_stops() -> None:
    bound = 10.0
    rows = [_row(100, 2.0), _row(200, -0.4), _row(400, 25.0), _row(700, 80.0, achieved=600)]
    assert [throughput.held(r, bound) for r in rows] == [True, True, False, False]
    assert [throughput.keep_going(r, bound) for r in rows] == [True, True, True, False]
    assert not throughput.held(_row(100, 1.0, errors=1), bound)
    assert not throughput.held(_row(100, None), bound)
    stalled = _row(200, -199.0)  # the run straight to the engines stalled, not the system
    assert throughput.reference_disturbed(stalled, bound) and not throughput.held(stalled, bound)
    assert throughput.keep_going(stalled, bound), "the next rate is measured afresh"
    assert throughput.max_rate([rows[0], stalled], bound) == 100
    assert throughput.max_rate(rows, bound) == 200
    assert throughput.max_rate([], bound) == 0.0
    assert throughput.parse_rates("400, 100,200") == [100.0, 200.0, 400.0]
    for bad in ("", "a,b", "100,-5"):
        with pytest.raises(argparse.ArgumentTypeError):
            throughput.parse_rates(bad)


def test_prompts_share_a_prefix_and_differ_in_their_tail() -> None:
    ps = loadgen.prompts(3, 64, 16)
    assert all(len(p) == 64 for p in ps)
    assert ps[0][:48] == ps[1][:48] == ps[2][:48]
    assert len({tuple(p[48:]) for p in ps}) == 3
    assert loadgen.prompts(3, 64, 16) == ps, "deterministic"
    assert loadgen.prompts(3, 64, 16, seed=1) != ps


async def test_open_loop_sends_them_all_at_the_rate() -> None:
    seen: list[int] = []

    async def send(i: int, sample: loadgen.Sample) -> None:
        seen.append(i)
        sample.ttft_ms = sample.e2e_ms = 0.1

    result = await loadgen.open_loop(500.0, 100, send)
    assert sorted(seen) == list(range(100))
    assert 0.19 <= result.wall_s < 1.5, "100 requests at 500/s take about 0.2 s"
    summary = result.summary()
    assert summary["completed"] == 100 and summary["errors"] == 0
    await asyncio.sleep(0)


def test_bench_messages_names_every_subject_kind_the_stack_uses():
    from thunderagent.bench.messages import KINDS, kind
    from thunderagent.schemas import subjects as s

    assert kind(s.requests("sim/llama-3.1-8b")) == "requests"
    assert kind(s.worker_generate("w0")) == "worker.generate"
    assert kind(s.worker_load("w0")) == "worker.load"
    assert kind(s.sched_direct("m")) == "sched.direct"
    assert kind(s.sched_submit("m")) == "sched.submit"
    assert kind(s.progress("w0", ended=True)) == "progress"
    assert kind(s.progress("w0", ended=False)) == "progress"
    assert kind(s.ROUTE_DECISIONS) == "route.decisions"
    assert kind(s.router_credits("r1")) == "router.credits"
    assert kind(s.router_dispatched("r1")) == "router.dispatched"
    assert kind(s.ROUTER_PRESENCE) == "router.presence"
    assert kind(s.kv_events("w1")) == "kv.events"
    assert kind("$JS.ACK.THUNDERAGENT_KV.index.1.2.3.4.5") == "js.ack"
    assert kind("_INBOX.abc.1") == "replies"
    assert kind("$JS.API.STREAM.INFO.X") == "jetstream api"
    named = ["requests", "worker.generate", "sched.direct", "progress", "kv.events", "replies"]
    assert set(named) <= set(KINDS)


def test_bench_messages_rows_subtract_idle_traffic_and_account_for_every_request():
    from thunderagent.bench.messages import row

    result = loadgen.LoadResult(100.0, [loadgen.Sample(ttft_ms=1.0) for _ in range(3)])
    result.samples.append(loadgen.Sample(error="unavailable: x"))
    seen = {"requests": 4, "worker.load": 10}
    r = row(100.0, result, seen, {"worker.load": 2.0}, wall=5.0)  # 10 idle-rate loads in 5 s
    assert r["per_request"] == {"requests": 1.0, "worker.load": 0.0}
    assert (r["requests"], r["completed"], r["rejected"], r["in_flight"]) == (4, 3, 1, 0)
    assert r["requests"] == r["completed"] + r["rejected"] + r["in_flight"]


def test_completion_bodies_are_what_the_gateway_parses() -> None:
    """``bench throughput --via gateway`` sends the same prompts as the NATS path, as token ids
    in OpenAI completions the gateway accepts (one token, streamed)."""
    from thunderagent.gateway.protocol import parse_completion

    prompts = loadgen.prompts(3, 64, 16, seed=2)
    for ids, raw in zip(prompts, loadgen.completion_bodies(prompts, "m/x"), strict=True):
        parsed = parse_completion(raw, {}, request_id="r", now_ms=0.0)
        assert parsed.request.token_ids == ids
        assert parsed.request.model == "m/x"
        assert parsed.request.max_tokens == 1
        assert parsed.stream


def test_soak_tells_a_descriptor_leak_from_a_pool_that_breathes() -> None:
    """A keep-alive pool grows in a burst and shrinks after it: not a leak. Descriptors that
    keep rising, or stay up to the end, are."""
    from thunderagent.bench.soak import Series, SoakConfig, judge

    def verdict(fds: list[int]) -> dict:
        t = [float(i) for i in range(len(fds))]
        return judge(Series("p", 1, t, [50.0] * len(fds), fds), warmup_s=0.0, cfg=SoakConfig())

    burst = verdict([28, 28, 33, 33, 30, 28, 28, 29, 28, 28, 28, 28])
    assert burst["ok"] and burst["fds_max"] == 33 and burst["fd_growth"] == 0
    leak = verdict([28 + i // 2 for i in range(12)])
    assert not leak["ok"] and leak["fd_growth"] > 2
    kept = verdict([28, 28, 28, 28, 28, 28, 28, 28, 28, 31, 31, 31])
    assert not kept["ok"], "still up at the end"
