"""The embedded stack as real processes: one request is one trace across every service, and
SIGTERM stops everything with no orphan process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.integration.otlp_receiver import OtlpReceiver

pytestmark = [pytest.mark.integration, pytest.mark.slow]

MODEL = "sim/llama-3.1-8b"


def _start_up(
    tmp_path: Path, env: dict[str, str], workers: int = 2, *extra: str
) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "thunderagent.cli.main", "up", "--workers", str(workers),
         "--run-dir", str(tmp_path / "run"), "--speedup", "20", *extra],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
    )  # fmt: skip
    lines = []
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        if line.strip().startswith("NATS"):
            return proc, line.split()[-1]
    proc.kill()
    raise AssertionError("thunderagent up did not start:\n" + "".join(lines))


def _descendants(pid: int) -> set[int]:
    out = subprocess.run(["ps", "-eo", "pid=,ppid=,pgid=,sid="], capture_output=True, text=True)
    rows = [tuple(int(x) for x in line.split()) for line in out.stdout.splitlines() if line.strip()]
    children: dict[int, list[int]] = {}
    for p, pp, *_ in rows:
        children.setdefault(pp, []).append(p)
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie is dead for our purpose
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().split()[2] != "Z"


def _client_env(tmp_path: Path, env: dict[str, str]) -> dict[str, str]:
    """`up` authenticates every connection: the client reads the logins it wrote."""
    return {**env, "THUNDERAGENT_NATS_CREDS": str(tmp_path / "run" / "creds")}


def _request(nats_url: str, env: dict[str, str], prompt: str, *flags: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-m", "thunderagent.cli.main", "request", "--nats", nats_url,
         "--model", MODEL, "--max-tokens", "8", "--json", *flags, prompt],
        capture_output=True, text=True, env=env, timeout=60,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_sigterm_stops_every_process(tmp_path):
    proc, nats_url = _start_up(tmp_path, dict(os.environ))
    try:
        env = _client_env(tmp_path, dict(os.environ))
        prompt = "hello from the process test, long enough to fill a KV block or two"
        final = _request(nats_url, env, prompt)
        assert final["type"] == "final"
        assert final["text"], final  # --json asks for the answer whole: its text is in it
        assert _request(nats_url, env, prompt)["usage"]["cached_tokens"] > 0
        salted = _request(nats_url, env, prompt, "--cache-salt", "tenant-a")
        assert salted["usage"]["cached_tokens"] == 0, "a tenant shares no other's KV"
        children = _descendants(proc.pid)
        # nats, redis, index, scheduler, router, 2 x (engine + adapter)
        assert len(children) >= 9, children
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    time.sleep(0.5)
    left = [pid for pid in children if _alive(pid)]
    assert not left, f"orphans after SIGTERM: {left}"


def test_up_with_sglang_pd_engines_pairs_a_prefill_and_a_decode_worker(tmp_path):
    """`up --prefill-workers 1`: engine 0 in SGLang's PD prefill mode, engine 1 in decode mode,
    the scheduler pairing them; the decode worker answers, having taken the prompt's KV."""
    proc, nats_url = _start_up(tmp_path, dict(os.environ), 2, "--prefill-workers", "1")
    try:
        env = _client_env(tmp_path, dict(os.environ))
        prompt = "a prompt for two engines, long enough to fill a few KV blocks of sixteen tokens"
        final = _request(nats_url, env, prompt)
        assert final["worker_id"] == "w1", final
        assert final["usage"]["cached_tokens"] >= 64, final  # the prefill engine's KV
        # the same through the OpenAI gateway (its URL is the banner's next line)
        gateway = proc.stdout.readline().split()[1]
        asked = [{"role": "user", "content": prompt + ", asked over HTTP"}]
        body = {"model": "sim/llama-3.1-8b", "max_tokens": 8, "messages": asked}
        post = urllib.request.Request(f"{gateway}/chat/completions", json.dumps(body).encode(),
                                      {"content-type": "application/json"})  # fmt: skip
        with urllib.request.urlopen(post, timeout=30) as resp:
            answer, worker = json.loads(resp.read()), resp.headers["x-thunderagent-worker"]
        assert worker == "w1" and answer["choices"][0]["message"]["content"], answer
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


def test_sigkill_of_up_leaves_no_orphans(tmp_path):
    proc, _ = _start_up(tmp_path, dict(os.environ), workers=1)
    children = _descendants(proc.pid)
    assert children
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and any(_alive(p) for p in children):
        time.sleep(0.2)
    assert not [p for p in children if _alive(p)]


def test_one_request_is_one_trace_across_processes(tmp_path):
    with OtlpReceiver() as receiver:
        env = dict(os.environ)
        env["OTEL_EXPORTER_OTLP_ENDPOINT"] = receiver.endpoint
        env["OTEL_BSP_SCHEDULE_DELAY"] = "100"
        proc, nats_url = _start_up(tmp_path, env)
        try:
            final = _request(nats_url, _client_env(tmp_path, env), "trace me through every service")
            request_id = final["request_id"]
            deadline = time.monotonic() + 20
            wanted = {
                "thunderagent-client",
                "thunderagent-router",
                "thunderagent-scheduler",
                "thunderagent-worker-w0",
                "thunderagent-worker-w1",
                "thunderagent-simengine",
            }
            trace = []
            while time.monotonic() < deadline:
                spans = receiver.snapshot()
                roots = [s for s in spans if s.service == "thunderagent-client"]
                if roots:
                    trace_id = roots[-1].trace_id
                    trace = [s for s in spans if s.trace_id == trace_id]
                    services = {s.service for s in trace}
                    ids = {s.span_id for s in trace}
                    # each process exports on its own schedule: wait until every parent is in
                    complete = all(not s.parent_span_id or s.parent_span_id in ids for s in trace)
                    if complete and {"thunderagent-router", "thunderagent-scheduler",
                        "thunderagent-simengine"} <= services and services & {
                            "thunderagent-worker-w0", "thunderagent-worker-w1"}:  # fmt: skip
                        break
                time.sleep(0.2)
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=30)
    assert request_id
    services = {s.service for s in trace}
    assert "thunderagent-client" in services
    assert {"thunderagent-router", "thunderagent-scheduler", "thunderagent-simengine"} <= services
    assert services & wanted - {"thunderagent-client"}
    ids = {s.span_id for s in trace}
    roots = [s for s in trace if not s.parent_span_id]
    assert len(roots) == 1 and roots[0].service == "thunderagent-client", roots
    orphans = [s for s in trace if s.parent_span_id and s.parent_span_id not in ids]
    assert not orphans, f"spans whose parent is not in the trace: {orphans}"


def _child(up_pid: int, command: str) -> int | None:
    """The pid of ``up``'s child running ``thunderagent <command>``, if there is one now."""
    for pid in _descendants(up_pid):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
        except OSError:
            continue
        if "thunderagent.cli.main" in argv[:-1]:
            if argv[argv.index("thunderagent.cli.main") + 1] == command:
                return pid
    return None


def test_a_child_that_dies_is_restarted_and_the_stack_keeps_serving(tmp_path):
    """`up` used to stop every process when any one child exited (a router replica, an
    engine), although the services are built to ride out a peer's restart."""
    proc, nats_url = _start_up(tmp_path, dict(os.environ), workers=1)
    env = _client_env(tmp_path, dict(os.environ))
    try:
        assert _request(nats_url, env, "before")["type"] == "final"
        router = _child(proc.pid, "router")
        assert router is not None
        os.kill(router, signal.SIGKILL)
        restarted = None
        deadline = time.monotonic() + 30
        while restarted is None and time.monotonic() < deadline:
            time.sleep(0.2)
            pid = _child(proc.pid, "router") if proc.poll() is None else None
            restarted = pid if pid not in (None, router) else None
        assert proc.poll() is None and restarted is not None
        assert _request(nats_url, env, "after the router's restart")["type"] == "final"
        engine = _child(proc.pid, "simengine")
        assert engine is not None
        os.kill(engine, signal.SIGKILL)  # its adapter is restarted after it (new KV ports)
        deadline = time.monotonic() + 30
        while _child(proc.pid, "simengine") in (None, engine) and time.monotonic() < deadline:
            time.sleep(0.2)
        final = _request(nats_url, env, "after the engine's restart")
        assert final["type"] == "final" and final["worker_id"] == "w0"
        proc.send_signal(signal.SIGTERM)
        out = proc.communicate(timeout=30)[0]
        assert proc.returncode == 0
        assert "router-0 exited (-9)" in out and "restarting router-0" in out
        assert "engine-0 exited (-9)" in out and "restarting engine-0" in out
    finally:
        if proc.poll() is None:
            proc.kill()


def test_up_with_data_parallel_engines_serves_each_rank_as_a_worker(tmp_path):
    """``up --dp-size 2``: one engine of two ranks is two workers to the fleet, each reached
    under its own id by the adapter's per-worker login, and a prompt comes back to its rank's
    cache."""
    proc, nats_url = _start_up(tmp_path, dict(os.environ), 1, "--dp-size", "2")
    env = _client_env(tmp_path, dict(os.environ))
    prompt = "a shared document, long enough for several KV blocks. " * 20
    try:
        first = _request(nats_url, env, prompt + "first question")
        again = _request(nats_url, env, prompt + "second question")
        assert first["worker_id"] in {"w0-dp0", "w0-dp1"}
        assert again["worker_id"] == first["worker_id"]
        assert again["usage"]["cached_tokens"] >= len(prompt) // 16 * 16 - 16
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=30)
