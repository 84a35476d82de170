"""``thunderagent up`` and ``thunderagent demo``: the embedded stack's commands, their flags and
the checks on them that no single flag's type can make."""

from __future__ import annotations

import argparse
import sys

from thunderagent.routing import POLICIES
from thunderagent.shell.argtypes import at_least, output_file
from thunderagent.stack.arguments import add_stack_arguments
from thunderagent.stack.up import StackConfig, run_up


def _cmd_up(args: argparse.Namespace) -> None:
    sys.exit(run_up(_stack_config("up", args)))


def _cmd_demo(args: argparse.Namespace) -> None:
    from thunderagent.stack.demo import run_demo  # the client, asyncio: only when it runs

    _stack_config("demo", args)
    sys.exit(run_demo(args))


def _stack_config(command: str, args: argparse.Namespace) -> StackConfig:
    try:
        return StackConfig.from_args(args)
    except ValueError as err:
        print(f"thunderagent {command}: error: {err}", file=sys.stderr)
        raise SystemExit(2) from None


def _policy_list(text: str) -> str:
    """A comma list of routing policies, each one the registry knows ('' for none)."""
    unknown = [name for name in text.split(",") if name and name not in POLICIES]
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown routing policy {', '.join(map(repr, unknown))} "
            f"(known: {', '.join(POLICIES.names())})"
        )
    return text


def add_stack_commands(add) -> None:
    """Add ``up`` and ``demo`` with ``add(name, help, handler)`` (the CLI's subcommand maker)."""
    p = add("up", "run NATS, Redis, every service and N simulated workers", _cmd_up)
    add_stack_arguments(p)

    p = add(
        "demo", "start the embedded stack, run a short workload, print a summary, stop", _cmd_demo
    )
    add_stack_arguments(p)
    p.add_argument(
        "--requests", type=at_least(1), default=200, help="requests in the demo workload"
    )
    p.add_argument("--concurrency", type=at_least(1), default=16)
    p.add_argument(
        "--json", dest="json_out", type=output_file, default=None,
        help="write the summary as JSON here",
    )  # fmt: skip
    p.add_argument(
        "--compare",
        type=_policy_list,
        default="round_robin",
        help="also run the workload with these routing policies (comma list; '' for none)",
    )
