"""``thunderagent simengine``: a simulated SGLang engine (its flags; the engine itself is
``thunderagent.simengine``, imported only when it runs)."""

from __future__ import annotations

import argparse

from thunderagent.engine.profiles import PRESETS
from thunderagent.shell.argtypes import at_least, positive
from thunderagent.stack.engine_flags import (
    DEFAULT_MODEL,
    adapter_names,
    add_engine_layout_flags,
)


def add_simengine_command(add) -> None:
    p = add("simengine", "run a simulated SGLang engine (HTTP API + ZMQ KV events)", _run)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=at_least(0), default=30000)
    p.add_argument("--model", default=DEFAULT_MODEL)
    _add_model_flags(p)
    add_engine_layout_flags(p)
    _add_clock_and_kv_flags(p)
    _add_role_flags(p)


def _add_model_flags(p: argparse.ArgumentParser) -> None:
    """What is simulated: the model-and-GPU profile, the KV page size, where KV events go."""
    p.add_argument("--profile", default="llama-3.1-8b-h100", choices=sorted(PRESETS))
    p.add_argument(
        "--page-size", dest="block_size", type=at_least(1), default=16,
        help="tokens per KV block (SGLang's flag name)",
    )  # fmt: skip
    p.add_argument("--kv-events-config", default=None, help="SGLang's --kv-events-config JSON")


def _add_clock_and_kv_flags(p: argparse.ArgumentParser) -> None:
    """The engine's clock, then where KV lives and how fast it moves (tiers, pool, links)."""
    p.add_argument(
        "--speedup", type=positive, default=1.0, help="run the engine's clock this much faster"
    )
    p.add_argument(
        "--host-blocks",
        type=int,
        default=0,
        help="host-memory KV tier in blocks (SGLang's hierarchical cache); 0: off",
    )
    p.add_argument(
        "--link-gbps",
        type=float,
        default=25.0,
        help="PD KV-import link in GB/s (gigabytes; 25 = one 200 Gb/s RDMA NIC)",
    )
    p.add_argument(
        "--kv-pool", action="store_true",
        help="keep real KV bytes per cached block in host memory registered with NIXL, so "
        "prefixes can be moved between engines (needs nixl; not an SGLang flag)",
    )  # fmt: skip
    p.add_argument(
        "--kv-pool-scale", type=at_least(1), default=1,
        help="divide the profile's KV bytes per block by this in the pool (small test pools)",
    )  # fmt: skip
    p.add_argument(
        "--kv-blocks", type=at_least(1), default=None,
        help="KV capacity in blocks instead of the profile's GPU-memory formula",
    )  # fmt: skip
    p.add_argument(
        "--kv-pull-gbps", type=float, default=0.0,
        help="pace KV pulls (migration) to this link speed in GB/s; 0: as fast as NIXL copies",
    )  # fmt: skip


def _add_role_flags(p: argparse.ArgumentParser) -> None:
    """What the engine answers as: its PD role, and timed or instant replies."""
    p.add_argument(
        "--disaggregation-mode", choices=["null", "prefill", "decode"], default="null",
        help="SGLang's PD role: prefill or decode engines pair on every request through the "
        "prefill engine's bootstrap registry (served on its API port)",
    )  # fmt: skip
    p.add_argument(
        "--engine", choices=["timed", "instant"], default="timed",
        help="timed: the roofline model's prefill/decode time; instant: answer every "
        "/generate at once with one token (benchmarks of what sits in front of engines)",
    )  # fmt: skip


def _run(args: argparse.Namespace) -> None:
    from thunderagent.simengine.main import SimEngineConfig, serve

    serve(
        SimEngineConfig(
            host=args.host,
            port=args.port,
            model=args.model,
            profile=args.profile,
            block_size=args.block_size,
            kv_events_config=args.kv_events_config,
            speedup=args.speedup,
            host_blocks=args.host_blocks,
            link_gbps=args.link_gbps,
            kv_pool=args.kv_pool,
            kv_pool_scale=args.kv_pool_scale,
            kv_blocks=args.kv_blocks,
            kv_pull_gbps=args.kv_pull_gbps,
            instant=args.engine == "instant",
            dp_size=args.dp_size,
            disaggregation_mode=args.disaggregation_mode,
            lora_adapters=adapter_names(args.lora_paths),
        )
    )
