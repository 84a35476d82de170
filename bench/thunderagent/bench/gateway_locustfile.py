"""Locust load on the OpenAI-compatible gateway: chat requests, half of them streamed, over a
few shared system prompts (multi-turn agents reuse their prefix, so the KV cache has work).

A fixed number of requests (``--requests``) or a time limit (``-t``); locust's own reports
(``--json-file``, ``--html``, ``--csv``; locust rewrites its CSV once a second, so a run shorter
than that leaves it empty: the JSON and HTML reports are written at the end). Streamed requests also record ``TTFT`` (first content
chunk) and ``E2E`` (the ``[DONE]`` frame) rows; the ``POST`` row of a streamed request is its
time to response headers (the gateway sends them with the first token).

    locust -f bench/thunderagent/bench/gateway_locustfile.py --headless -u 64 -r 64 \\
        --host http://127.0.0.1:8000 --requests 5000 --max-tokens 32 --json-file gateway --html gateway.html
"""  # noqa: E501

from __future__ import annotations

import itertools
import json
import random
import time

import gevent
from locust import HttpUser, events, task
from locust.exception import StopUser

SYSTEM_PROMPTS = [
    f"You are agent {i}. Answer in one short paragraph, cite nothing, and keep a calm tone. " * 6
    for i in range(8)
]
_issued = itertools.count()
_finished = itertools.count(1)


@events.init_command_line_parser.add_listener
def _options(parser) -> None:
    parser.add_argument("--model", default="sim/llama-3.1-8b", help="model to ask")
    parser.add_argument("--requests", type=int, default=0,
                        help="stop after this many requests (0: until --run-time)")  # fmt: skip
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--stream-share", type=float, default=0.5,
                        help="share of requests sent with stream=true")  # fmt: skip


class ChatUser(HttpUser):
    """One agent: each request is a new turn after one of the shared system prompts."""

    def _body(self, stream: bool) -> dict:
        opts = self.environment.parsed_options
        messages = [
            {"role": "system", "content": random.choice(SYSTEM_PROMPTS)},
            {"role": "user", "content": f"Question {random.randrange(10**6)}: what next?"},
        ]
        return {"model": opts.model, "messages": messages, "max_tokens": opts.max_tokens,
                "stream": stream}  # fmt: skip

    @task
    def chat(self) -> None:
        opts = self.environment.parsed_options
        if opts.requests and next(_issued) >= opts.requests:
            raise StopUser()
        if random.random() < opts.stream_share:
            self._streamed()
        else:
            with self.client.post("/v1/chat/completions", json=self._body(False),
                                  name="chat", catch_response=True) as resp:  # fmt: skip
                if resp.status_code != 200 or not resp.json()["choices"][0]["message"]["content"]:
                    resp.failure(f"{resp.status_code}: {resp.text[:200]}")
        self._count_done()

    def _streamed(self) -> None:
        started = time.perf_counter()
        first = None
        with self.client.post("/v1/chat/completions", json=self._body(True), stream=True,
                              name="chat stream", catch_response=True) as resp:  # fmt: skip
            done = False
            for line in resp.iter_lines():
                if not line.startswith(b"data: "):
                    continue
                data = line[6:]
                if data == b"[DONE]":
                    done = True
                    break
                if b'"error"' in data[:12]:
                    resp.failure(json.loads(data)["error"]["message"])
                    return
                if first is None and b'"content"' in data:
                    first = time.perf_counter()
            if resp.status_code != 200 or not done:
                resp.failure(f"{resp.status_code}: stream ended without [DONE]")
                return
        self._timing("TTFT", (first or time.perf_counter()) - started)
        self._timing("E2E", time.perf_counter() - started)

    def _timing(self, kind: str, seconds: float) -> None:
        events.request.fire(request_type=kind, name="chat stream", response_time=seconds * 1e3,
                            response_length=0, exception=None, context={})  # fmt: skip

    def _count_done(self) -> None:
        opts = self.environment.parsed_options
        if opts.requests and next(_finished) >= opts.requests:
            # from another greenlet: quitting kills every user, this one included
            gevent.spawn(self.environment.runner.quit)
