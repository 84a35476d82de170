"""The HTTP routers ``bench live`` and ``bench throughput`` compare against: sglang-router 0.3.2
and SMG 1.13.0, each launched as it ships (``--policy cache_aware``, nothing tuned) in its own
process group, waited for, and stopped; and the engines' caches flushed between systems."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import aiohttp

from thunderagent.embedded import free_port

BASELINES = ("sglang-router", "smg", "smg-dp-aware", "dynamo")
"""HTTP routers ``--baseline`` can put in front of the engines (the pip package named).
``smg-dp-aware``: SMG with its ``--dp-aware`` setting (off as it ships), which reads each
engine's ``dp_size`` and routes to its data-parallel ranks as workers of their own. ``dynamo``:
Dynamo 1.6.1's KV router (its runtime-free selection core, every setting its default) behind a
thin aiohttp proxy of ours (``bench.dynamo_router``): its routing is Dynamo's, its added
latency is not."""
_PACKAGE = {
    "sglang-router": "sglang_router", "smg": "smg", "smg-dp-aware": "smg", "dynamo": "dynamo",
}  # fmt: skip
_EXTRA = {"dynamo": "dynamo"}
"""The pip extra that installs a baseline (``baseline`` unless named here)."""
_SETTINGS = {"smg-dp-aware": ["--dp-aware"]}
FRESH_SUFFIX = "/fresh-connections"
"""System-name suffix of a baseline measured with a new client connection per request."""


def router_argv(baseline: str, port: int, metrics_port: int, engine_urls: list[str]) -> list[str]:
    """The baseline's launch command: ``--policy cache_aware`` and nothing tuned but the setting
    its name says (``_SETTINGS``); only the listening and metrics ports are set (both routers
    default their metrics to 0.0.0.0:29000)."""
    if baseline == "dynamo":  # our proxy around Dynamo's selection core: no metrics, no policy
        return [
            sys.executable, "-m", "thunderagent.bench.dynamo_router", "--host", "127.0.0.1",
            "--port", str(port), "--worker-urls", *engine_urls,
        ]  # fmt: skip
    launcher = {
        "sglang_router": ["-m", "sglang_router.launch_router"],
        "smg": ["-m", "smg", "launch"],
    }[_PACKAGE[baseline]]
    return [
        sys.executable, *launcher, "--host", "127.0.0.1", "--port", str(port),
        "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port),
        "--policy", "cache_aware", *_SETTINGS.get(baseline, []), "--worker-urls", *engine_urls,
    ]  # fmt: skip


def start_router(
    baseline: str, engine_urls: list[str], log_path: Path
) -> tuple[subprocess.Popen, str]:
    """Start the baseline in its own process group (its launcher may fork the router)."""
    port = free_port()
    argv = router_argv(baseline, port, free_port(), engine_urls)
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    return proc, f"http://127.0.0.1:{port}"


def stop_router(proc: subprocess.Popen) -> None:
    """Stop the baseline's whole process group (the group this benchmark created)."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(10)
    except ProcessLookupError:
        return
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


def baseline_missing(baseline: str) -> str | None:
    """Why the baseline cannot run here, or None."""
    module = _PACKAGE[baseline]
    try:
        __import__(module)
    except ImportError:
        extra = _EXTRA.get(baseline, "baseline")
        return f"{baseline} is not installed: pip install 'thunderagent[{extra}]'"
    return None


def parse_baselines(text: str) -> list[str]:
    """``--baseline``: comma-separated names from ``BASELINES``, in order, no repeats."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = sorted(set(names) - set(BASELINES))
    if unknown or not names:
        bad = ", ".join(unknown) or repr(text)
        raise argparse.ArgumentTypeError(
            f"unknown baseline {bad}; choose from {', '.join(BASELINES)}"
        )
    return list(dict.fromkeys(names))


def system_name(baseline: str, connections: str) -> str:
    """The key a baseline run gets in ``systems`` (keep-alive runs keep the plain name)."""
    return baseline if connections == "keepalive" else baseline + FRESH_SUFFIX


async def wait_http(url: str, timeout_s: float = 60, *, openai: bool = False) -> None:
    """Until ``url`` answers a one-token ``/generate`` (or, ``openai``, lists a model)."""
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as s:
        while time.monotonic() < deadline:
            try:
                if openai:
                    async with s.get(url + "/v1/models") as r:
                        if r.status == 200 and (await r.json()).get("data"):
                            return
                    await asyncio.sleep(0.3)
                    continue
                body = {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 1}}
                async with s.post(url + "/generate", json=body) as r:
                    if r.status == 200:
                        return
            except (aiohttp.ClientError, OSError):
                pass
            await asyncio.sleep(0.3)
    raise TimeoutError(f"{url} did not serve within {timeout_s}s")


async def flush_all(engine_urls: list[str]) -> None:
    async with aiohttp.ClientSession() as s:
        for url in engine_urls:
            for _ in range(50):  # refused while requests still run
                async with s.post(url + "/flush_cache") as r:
                    if r.status == 200:
                        break
                await asyncio.sleep(0.1)
