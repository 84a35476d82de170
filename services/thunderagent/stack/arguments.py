"""``thunderagent up``'s and ``demo``'s command-line flags (the stack they run: ``up.py``)."""

from __future__ import annotations

import argparse

from thunderagent.engine.profiles import PRESETS
from thunderagent.routing import POLICIES
from thunderagent.shell.argtypes import at_least, nats_url, positive, readable_file
from thunderagent.stack.engine_flags import DEFAULT_MODEL, add_engine_layout_flags


def add_stack_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workers", type=at_least(0), default=4, help="simulated workers to start")
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--policy", default="thunder", choices=POLICIES.names(), help="routing policy")
    p.add_argument(
        "--routers", type=at_least(0), default=1,
        help="router replicas (0 with --gateway-embed-router: only the gateways route; NATS "
        "clients then find no router)",
    )  # fmt: skip
    p.add_argument(
        "--sched-param", action="append", default=[], metavar="FIELD=VALUE",
        help="override a parameter of the scheduler (repeatable; VALUE is JSON or a string), "
        "e.g. cold_shared_hits=true",
    )  # fmt: skip
    p.add_argument("--run-dir", default=None, help="logs and data (default: a new temp folder)")
    p.add_argument("--metrics", action="store_true", help="serve Prometheus metrics per service")
    _bus_arguments(p)
    _gateway_arguments(p)
    _engine_arguments(p)


def _bus_arguments(p: argparse.ArgumentParser) -> None:
    """NATS and Redis: embedded or given, and how NATS is secured."""
    p.add_argument(
        "--nats", type=nats_url, default=None,
        help="use this NATS server instead of an embedded one",
    )  # fmt: skip
    p.add_argument("--redis", default=None, help="use this Redis instead of an embedded one")
    p.add_argument(
        "--no-auth", dest="auth", action="store_false",
        help="a bare development bus: no NATS users (default: one generated login per role and "
        "per worker, in <run-dir>/creds)",
    )  # fmt: skip
    p.add_argument(
        "--tls-cert", type=readable_file, default=None,
        help="NATS over TLS with this certificate (PEM; needs --tls-key)",
    )  # fmt: skip
    p.add_argument(
        "--tls-key", type=readable_file, default=None, help="the --tls-cert's private key (PEM)"
    )


def _gateway_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--gateways", type=at_least(0), default=1,
        help="OpenAI-compatible HTTP gateway processes sharing one port (0: none)",
    )  # fmt: skip
    p.add_argument(
        "--gateway-port", type=at_least(0), default=8000, help="the gateways' HTTP port when free"
    )
    p.add_argument(
        "--gateway-embed-router", action="store_true",
        help="each gateway routes in its own process (a router replica inside it: one NATS hop "
        "less per HTTP request); the router services still serve NATS clients",
    )  # fmt: skip


def _engine_arguments(p: argparse.ArgumentParser) -> None:
    """The simulated engines."""
    p.add_argument(
        "--profile", default="llama-3.1-8b-h100", choices=sorted(PRESETS),
        help="simulated engine profile",
    )  # fmt: skip
    p.add_argument("--block-size", type=at_least(1), default=16, help="tokens per KV block")
    p.add_argument(
        "--speedup", type=positive, default=1.0, help="simulated engines run this much faster"
    )
    p.add_argument(
        "--kv-pool", action="store_true",
        help="simulated engines keep real KV bytes in host memory registered with NIXL, so the "
        "migration service can move prefixes between them (needs nixl)",
    )  # fmt: skip
    p.add_argument("--kv-pool-scale", type=at_least(1), default=1,
                   help="divide the KV bytes per block by this in the pools")  # fmt: skip
    p.add_argument("--kv-blocks", type=at_least(1), default=None,
                   help="KV capacity per engine in blocks (default: the profile's)")  # fmt: skip
    p.add_argument(
        "--engine", choices=["timed", "instant"], default="timed",
        help="simulated engines: timed (roofline model) or instant (one token at once)",
    )  # fmt: skip
    p.add_argument(
        "--kv-events", choices=["on", "off"], default="on",
        help="off: the simulated engines publish no KV events, as SGLang without "
        "--kv-events-config; each worker's adapter announces what its runs leave cached",
    )  # fmt: skip
    add_engine_layout_flags(p)
    p.add_argument(
        "--prefill-workers", type=at_least(0), default=0,
        help="PD: this many workers prefill, the rest decode, and the scheduler pairs them "
        "(--policy pd_uncapped); 0: whole engines",
    )  # fmt: skip
    p.add_argument(
        "--pd-via", choices=["sglang", "workers"], default="sglang",
        help="with --prefill-workers: engines in SGLang's PD modes, the decode engine taking "
        "the KV (sglang), or whole engines whose workers move it (workers: --role)",
    )  # fmt: skip
