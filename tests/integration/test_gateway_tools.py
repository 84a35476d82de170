"""Tools people point at an OpenAI endpoint: ``curl`` (the README's examples, run as written)
and ``locust`` (headless, a fixed request count, its own CSV report), against the gateway of a
real stack."""

from __future__ import annotations

import asyncio
import json
import shutil
import sys
from pathlib import Path

import pytest

from tests.integration.inproc import MODEL
from tests.integration.test_gateway_sdk import gateway_stack

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
LOCUSTFILE = ROOT / "bench" / "thunderagent" / "bench" / "gateway_locustfile.py"

CURL_EXAMPLES = {
    "models": "curl -s $URL/v1/models",
    "chat": """curl -s $URL/v1/chat/completions -H 'Content-Type: application/json' \\
  -H 'x-request-id: hello-1' -H 'x-session-id: agent-1' -H 'x-priority: 0' \\
  -d '{"model": "sim/llama-3.1-8b", "max_tokens": 16,
       "messages": [{"role": "user", "content": "Hello, ThunderAgent"}]}'""",
    "stream": """curl -sN $URL/v1/chat/completions -H 'Content-Type: application/json' \\
  -d '{"model": "sim/llama-3.1-8b", "max_tokens": 16, "stream": true,
       "stream_options": {"include_usage": true},
       "messages": [{"role": "user", "content": "Hello, ThunderAgent"}]}'""",
    "completions": """curl -s $URL/v1/completions -H 'Content-Type: application/json' \\
  -d '{"model": "sim/llama-3.1-8b", "prompt": "Once upon a time", "max_tokens": 16}'""",
    "workers": "curl -s $URL/workers",
}
"""The README's examples, verbatim but for the model name the test stack serves."""


async def _sh(command: str, url: str, timeout: float = 60) -> str:  # noqa: ASYNC109
    proc = await asyncio.create_subprocess_exec(
        "bash", "-c", command.replace("sim/llama-3.1-8b", MODEL),
        env={"URL": url, "PATH": "/usr/bin:/bin"},
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )  # fmt: skip
    out, _ = await asyncio.wait_for(proc.communicate(), timeout)
    assert proc.returncode == 0, out.decode()
    return out.decode()


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
async def test_curl_examples(nats_server):
    async with gateway_stack(nats_server.url) as run:
        models = json.loads(await _sh(CURL_EXAMPLES["models"], run.url))
        assert [m["id"] for m in models["data"]] == [MODEL]
        for _ in range(2):  # pasted twice: its request id is free again once it has ended
            chat = json.loads(await _sh(CURL_EXAMPLES["chat"], run.url))
            assert chat["id"] == "chatcmpl-hello-1", chat
            assert chat["usage"]["completion_tokens"] == 16
            assert chat["choices"][0]["message"]["content"]
        stream = await _sh(CURL_EXAMPLES["stream"], run.url)
        frames = [f for f in stream.split("\n\n") if f]
        assert all(f.startswith("data: ") for f in frames)
        assert frames[-1] == "data: [DONE]"
        usage = json.loads(frames[-2].removeprefix("data: "))
        assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 16
        text = json.loads(await _sh(CURL_EXAMPLES["completions"], run.url))
        assert text["object"] == "text_completion" and text["choices"][0]["text"]
        fleet = json.loads(await _sh(CURL_EXAMPLES["workers"], run.url))
        assert fleet["total"] == 1 and len(fleet["workers"]) == 1
        worker = fleet["workers"][0]
        assert worker["registration"]["model"] == MODEL
        assert worker["load"]["worker_id"] == worker["registration"]["worker_id"]
        assert worker["load"]["kv_total_blocks"] > 0 and 0 <= worker["load_age_s"] < 5


@pytest.mark.slow
async def test_locust_headless_run_has_no_failures(nats_server, tmp_path):
    async with gateway_stack(nats_server.url, workers=2) as run:
        report = tmp_path / "locust"
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless",
            "-u", "8", "-r", "8", "--host", run.url, "-t", "60s",
            "--model", MODEL, "--requests", "50", "--max-tokens", "8",
            "--json-file", str(report), cwd=tmp_path,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        )  # fmt: skip
        out, _ = await asyncio.wait_for(proc.communicate(), 90)
    log = out.decode()
    assert proc.returncode == 0, log
    # locust writes its final CSV only on its next 1 s tick; the JSON report at shutdown
    rows = json.loads(Path(f"{report}.json").read_text())  # noqa: ASYNC240 - after the run
    posts = [r for r in rows if r["method"] == "POST"]
    assert sum(r["num_requests"] for r in posts) == 50, log
    assert all(r["num_failures"] == 0 for r in rows), rows
    streamed = {r["method"] for r in rows if r["name"] == "chat stream"}
    assert {"POST", "TTFT", "E2E"} <= streamed, rows
