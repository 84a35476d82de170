"""The simulated engine's SGLang HTTP surface, and SGLang's own router in front of it."""

from __future__ import annotations

import asyncio
import json
import logging
import subprocess
import sys
import time

import aiohttp
import pytest

from tests.integration.inproc import inproc_stack
from thunderagent.embedded import free_port

pytestmark = pytest.mark.integration


async def sse(resp) -> list[dict]:
    out = []
    async for raw in resp.content:
        line = raw.strip()
        if line.startswith(b"data:") and line[5:].strip() != b"[DONE]":
            out.append(json.loads(line[5:]))
    return out


async def test_generate_info_load_and_flush(nats_server):
    async with inproc_stack(nats_server.url) as stack:
        url = await stack.start_engine("e0", kv_events=False)
        prompt = list(range(10, 10 + 40))  # 2 full blocks of 16
        body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 5}}
        async with aiohttp.ClientSession() as s:
            async with s.post(url + "/generate", json=body) as r:
                first = await r.json()
            async with s.post(url + "/generate", json={**body, "stream": True}) as r:
                chunks = await sse(r)
            async with s.post(url + "/generate", json={"text": "hi there", "rid": "x"}) as r:
                by_text = await r.json()
            info = await (await s.get(url + "/server_info")).json()
            info2 = await (await s.get(url + "/get_server_info")).json()
            model = await (await s.get(url + "/model_info")).json()
            load = await (await s.get(url + "/get_load")).json()
            flushed = await s.post(url + "/flush_cache")
            async with s.post(url + "/generate", json=body) as r:
                after_flush = await r.json()
            bad = [
                await s.post(url + "/generate", data=b"{nope"),
                await s.post(url + "/generate", json={"input_ids": []}),
                await s.post(
                    url + "/generate",
                    json={"input_ids": [1], "sampling_params": {"max_new_tokens": 0}},
                ),
                await s.post(url + "/generate", json={"input_ids": [-3]}),
                await s.post(url + "/generate", json={"input_ids": [1] * 100_000}),
            ]
    meta = first["meta_info"]
    assert (meta["prompt_tokens"], meta["cached_tokens"], meta["completion_tokens"]) == (40, 0, 5)
    assert meta["finish_reason"] == {"type": "length", "length": 5}
    assert len(first["output_ids"]) == 5 and first["text"]
    assert chunks[-1]["meta_info"]["cached_tokens"] == 32  # the first request cached 2 blocks
    # as SGLang's: every streamed output carries the prompt's accounting, not only the last
    assert len(chunks) > 1
    assert {(c["meta_info"]["prompt_tokens"], c["meta_info"]["cached_tokens"]) for c in chunks} == {
        (40, 32)
    }
    assert chunks[-1]["output_ids"] == first["output_ids"]  # cumulative, as SGLang streams
    assert [len(c["output_ids"]) for c in chunks] == sorted(len(c["output_ids"]) for c in chunks)
    assert by_text["meta_info"]["id"] == "x" and by_text["meta_info"]["prompt_tokens"] == 8
    assert info == info2 and info["page_size"] == 16 and info["max_total_num_tokens"] > 0
    assert model["is_generation"] is True
    assert isinstance(load, list) and {"num_reqs", "num_waiting_reqs", "num_tokens"} <= set(load[0])
    assert flushed.status == 200
    assert after_flush["meta_info"]["cached_tokens"] == 0
    assert [r.status for r in bad] == [400] * 5


async def test_server_info_describes_the_event_publisher_as_sglang_does(nats_server):
    """SGLang 0.5's ``kv_events``: the bound base port (rank r on base + r), the block size and
    the ranks, from the events config the engine reports; none without a publisher."""
    async with inproc_stack(nats_server.url) as stack:
        ranked = await stack.start_engine("e0", dp_size=2)
        silent = await stack.start_engine("e1", kv_events=False)
        async with aiohttp.ClientSession() as s:
            info = await (await s.get(ranked + "/server_info")).json()
            quiet = await (await s.get(silent + "/server_info")).json()
    described = info["kv_events"]
    config = json.loads(info["kv_events_config"])
    assert (
        config["endpoint"]
        == f"tcp://{described['endpoint_host']}:{described['endpoint_port_base']}"
    )
    assert (described["block_size"], described["dp_size"], described["topic"]) == (16, 2, "kv")
    assert quiet["kv_events"] is None


async def test_openai_endpoints(nats_server):
    async with inproc_stack(nats_server.url) as stack:
        url = await stack.start_engine("e0", kv_events=False)
        async with aiohttp.ClientSession() as s:
            comp = await (
                await s.post(url + "/v1/completions", json={"prompt": "x" * 40, "max_tokens": 3})
            ).json()
            comp2 = await (
                await s.post(url + "/v1/completions", json={"prompt": "x" * 40, "max_tokens": 3})
            ).json()
            hello = [{"role": "user", "content": "hello"}]
            chat_body = {"messages": hello, "max_tokens": 4}
            chat = await (await s.post(url + "/v1/chat/completions", json=chat_body)).json()
            async with s.post(url + "/v1/chat/completions", json={
                    "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4,
                    "stream": True}) as r:  # fmt: skip
                stream = await sse(r)
            bad = await s.post(url + "/v1/chat/completions", json={"messages": []})
    assert comp["object"] == "text_completion" and comp["usage"]["completion_tokens"] == 3
    assert comp2["usage"]["prompt_tokens_details"]["cached_tokens"] == 32
    assert chat["choices"][0]["message"]["role"] == "assistant"
    assert chat["usage"]["completion_tokens"] == 4
    text = "".join(c["choices"][0]["delta"]["content"] for c in stream)
    assert text == chat["choices"][0]["message"]["content"]
    assert stream[-1]["usage"]["completion_tokens"] == 4
    assert bad.status == 400


async def test_openai_endpoints_end_before_a_stop_string(nats_server):
    """The engine's own OpenAI routes took `stop` and ignored it (the gateway's honoured it)."""
    hello = [{"role": "user", "content": "hello"}]
    prompt = {"prompt": "x" * 40, "max_tokens": 20}
    async with inproc_stack(nats_server.url) as stack:
        url = await stack.start_engine("e0", kv_events=False)
        async with aiohttp.ClientSession() as s:

            async def post(path: str, body: dict):
                async with s.post(url + path, json=body) as r:
                    return r.status, await (sse(r) if body.get("stream") else r.json())

            _, comp = await post("/v1/completions", {**prompt, "stop": ["output", "nowhere"]})
            chat_body = {"messages": hello, "max_tokens": 20, "stop": "output"}
            _, chat = await post("/v1/chat/completions", chat_body)
            _, stream = await post("/v1/chat/completions", {**chat_body, "stream": True})
            _, unmet = await post("/v1/completions", {**prompt, "max_tokens": 3, "stop": "output"})
            bad = [await post("/v1/completions", {**prompt, "stop": v}) for v in (3, ["a", 1])]
    assert (comp["choices"][0]["text"], comp["choices"][0]["finish_reason"]) == (
        "Simulated ",
        "stop",
    )
    assert comp["usage"]["completion_tokens"] == len("Simulated ")
    assert chat["choices"][0]["message"]["content"] == "Simulated "
    assert chat["choices"][0]["finish_reason"] == "stop"
    assert "".join(c["choices"][0]["delta"]["content"] for c in stream) == "Simulated "
    assert stream[-1]["choices"][0]["finish_reason"] == "stop"
    assert unmet["choices"][0]["finish_reason"] == "length"  # "output" lies past 3 tokens
    assert [status for status, _ in bad] == [400] * 2
    assert all("stop must be" in body["error"]["message"] for _, body in bad)


@pytest.mark.slow
async def test_sglang_router_fronts_simulated_engines(nats_server, tmp_path):
    pytest.importorskip(
        "sglang_router", reason="pip install sglang-router==0.3.2 (extra: baseline)"
    )
    async with inproc_stack(nats_server.url) as stack:
        urls = [await stack.start_engine(f"e{i}", kv_events=False) for i in range(2)]
        port = free_port()
        log = open(tmp_path / "router.log", "wb")
        proc = subprocess.Popen(
            [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1",
             "--port", str(port), "--policy", "cache_aware", "--worker-urls", *urls],
            stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        try:
            served = []
            deadline = time.monotonic() + 60
            async with aiohttp.ClientSession() as s:
                while time.monotonic() < deadline:
                    try:
                        body = {"text": "route me " * 8, "sampling_params": {"max_new_tokens": 2}}
                        r = await s.post(f"http://127.0.0.1:{port}/generate", json=body)
                        if r.status == 200:
                            served.append(await r.json())
                            if len(served) == 4:
                                break
                    except aiohttp.ClientError:
                        pass
                    await _sleep(0.3)
        finally:
            proc.terminate()
            proc.wait(10)
            log.close()
    assert len(served) == 4, (tmp_path / "router.log").read_text()[-2000:]
    # cache_aware sends a repeated prompt where it went before: later copies hit the cache
    assert served[-1]["meta_info"]["cached_tokens"] > 0


async def _sleep(s: float) -> None:
    import asyncio

    await asyncio.sleep(s)


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/generate", {"input_ids": list(range(10, 50)), "stream": True,
                       "sampling_params": {"max_new_tokens": 400}}),
        ("/v1/completions", {"model": "m", "prompt": "hello there", "stream": True,
                             "max_tokens": 400}),
    ],
)  # fmt: skip
async def test_a_client_gone_mid_stream_aborts_the_run_quietly(nats_server, caplog, path, body):
    """Found by the subject fuzz (seed 15): a caller that closed its stream (the adapter, on
    an abort) made the engine's HTTP server log an error writing to the closed socket, and the
    run went on until the generator was collected. SGLang aborts such a request."""
    async with inproc_stack(nats_server.url) as stack:
        url = await stack.start_engine("e0", kv_events=False)
        if path.startswith("/v1"):
            body = {**body, "model": (await _served_model(url))}
        async with aiohttp.ClientSession() as s:
            r = await s.post(url + path, json=body)
            await r.content.readline()  # the stream has started
            r.close()  # and the caller goes away
            running = -1
            for _ in range(100):
                load = await (await s.get(url + "/get_load")).json()
                running = load[0]["num_reqs"] + load[0]["num_waiting_reqs"]
                if running == 0:
                    break
                await asyncio.sleep(0.02)
    assert running == 0, "the run was aborted when its caller left"
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, [r.getMessage() for r in errors]


async def _served_model(url: str) -> str:
    async with aiohttp.ClientSession() as s:
        models = await (await s.get(url + "/v1/models")).json()
    return models["data"][0]["id"]


async def test_an_idle_connection_is_closed_as_sglangs_server_closes_it(nats_server, monkeypatch):
    """SGLang's uvicorn closes a keep-alive connection idle for 5 s; so does the simulated
    engine (aiohttp would keep it 75 s), so a client's pool shrinks after a burst as it would
    in front of SGLang."""
    from thunderagent.simengine import server

    monkeypatch.setattr(server, "KEEPALIVE_S", 0.3)
    async with inproc_stack(nats_server.url) as stack:
        url = await stack.start_engine("e0", kv_events=False)
        host, port = url.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(f"GET /get_load HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
        head = await reader.readuntil(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200")
        length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-length")))  # fmt: skip
        await reader.readexactly(length)
        started = time.monotonic()
        assert await asyncio.wait_for(reader.read(1), timeout=5) == b"", "closed by the engine"
        assert 0.2 <= time.monotonic() - started < 3, "after its keep-alive time"
        writer.close()
