"""The simulated engine's layout flags, as SGLang names them, shared by ``thunderagent
simengine`` (one engine) and ``thunderagent up`` (every engine it starts)."""

from __future__ import annotations

import argparse

from thunderagent.shell.argtypes import at_least

DEFAULT_MODEL = "sim/llama-3.1-8b"
"""The model name simulated engines serve unless told another."""


def add_engine_layout_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--lora-paths", nargs="*", default=[], metavar="NAME[=PATH]",
        help="LoRA adapters to serve, by name (SGLang's flag; the path is not read: the "
        "simulated engine keeps an adapter's KV apart, it has no weights); request one as "
        "\"model\": \"<model>:<adapter>\"",
    )  # fmt: skip
    p.add_argument(
        "--dp-size", type=at_least(1), default=1,
        help="data-parallel ranks per engine (SGLang's flag), each with its own KV cache and "
        "events on the next port; each is a worker of its own, <id>-dp<r>",
    )  # fmt: skip


def adapter_names(lora_paths: list[str]) -> list[str]:
    """``--lora-paths`` entries (``NAME`` or ``NAME=PATH``) as the adapters' names."""
    return [spec.split("=", 1)[0] for spec in lora_paths]
