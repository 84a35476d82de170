"""``thunderagent up`` starts the gateway and prints its URL next to NATS; one HTTP request is one
trace from the gateway to the engine (every process exports to a real OTLP receiver)."""

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
HTTP_SPAN = "gateway POST /v1/chat/completions"
"""The gateway also has a consumer span per load report it reads; the request's is this one."""


def _start_up(
    tmp_path: Path, env: dict[str, str], *extra: str
) -> tuple[subprocess.Popen, dict[str, str]]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "thunderagent.cli.main", "up", "--workers", "1",
         "--run-dir", str(tmp_path / "run"), "--speedup", "20", *extra],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
    )  # fmt: skip
    lines, found = [], {}
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and "OpenAI" not in found:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        words = line.split()
        if words and words[0] in ("NATS", "OpenAI"):
            found[words[0]] = words[1]
    if "OpenAI" not in found or "NATS" not in found:
        proc.kill()
        raise AssertionError("thunderagent up did not print both URLs:\n" + "".join(lines))
    return proc, found


def _chat(base: str) -> tuple[dict, dict]:
    body = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "trace me"}]}
    req = urllib.request.Request(
        base + "/chat/completions", data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )  # fmt: skip
    with urllib.request.urlopen(req, timeout=30) as resp:
        return json.loads(resp.read()), dict(resp.headers)


def _whole_trace(receiver: OtlpReceiver, wanted: set[str]) -> list:
    deadline = time.monotonic() + 20
    trace: list = []
    while time.monotonic() < deadline:
        spans = receiver.snapshot()
        roots = [s for s in spans if s.name == HTTP_SPAN and not s.parent_span_id]
        if roots:
            trace = [s for s in spans if s.trace_id == roots[-1].trace_id]
            ids = {s.span_id for s in trace}
            complete = all(not s.parent_span_id or s.parent_span_id in ids for s in trace)
            if complete and wanted <= {s.service for s in trace}:
                return trace
        time.sleep(0.2)
    return trace


@pytest.mark.parametrize("embed_router", [False, True], ids=["router-service", "embedded"])
def test_up_serves_http_and_one_request_is_one_trace(tmp_path, embed_router):
    """With ``--gateway-embed-router`` the gateway routes in its own process: the trace has the
    router's span, exported by the gateway, and no router service on the path."""
    with OtlpReceiver() as receiver:
        env = dict(os.environ)
        env["OTEL_EXPORTER_OTLP_ENDPOINT"] = receiver.endpoint
        env["OTEL_BSP_SCHEDULE_DELAY"] = "100"
        extra = ("--gateway-embed-router",) if embed_router else ()
        proc, urls = _start_up(tmp_path, env, *extra)
        try:
            assert urls["NATS"].startswith("nats://")
            base = urls["OpenAI"]
            assert base.startswith("http://127.0.0.1:") and base.endswith("/v1")
            done, headers = _chat(base)
            assert done["usage"]["completion_tokens"] == 4
            assert headers["x-request-id"] == done["id"].removeprefix("chatcmpl-")
            wanted = {"thunderagent-gateway", "thunderagent-scheduler",
                      "thunderagent-worker-w0", "thunderagent-simengine"}  # fmt: skip
            if not embed_router:
                wanted.add("thunderagent-router")
            trace = _whole_trace(receiver, wanted)
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=30)
    services = {s.service for s in trace}
    assert wanted <= services, services
    roots = [s for s in trace if not s.parent_span_id]
    assert len(roots) == 1 and roots[0].service == "thunderagent-gateway", roots
    assert roots[0].name == HTTP_SPAN
    ids = {s.span_id for s in trace}
    assert all(s.parent_span_id in ids for s in trace if s.parent_span_id)
    routed_by = {s.service for s in trace if s.name == "router route"}
    assert routed_by == {"thunderagent-gateway" if embed_router else "thunderagent-router"}
