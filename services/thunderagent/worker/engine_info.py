"""What an engine's ``/server_info`` says that the worker registers: its limits, its
vocabulary, where its KV events are reached, how many data-parallel ranks it runs."""

from __future__ import annotations

from collections.abc import Mapping

from thunderagent.tokenizer import load_tokenizer


def context_length(info: dict) -> int:
    """The longest prompt + output the engine takes (0: unknown). SGLang reports
    ``context_length`` only when it was overridden; ``max_req_input_len`` (longest prompt) is
    one less than the model's context (or the KV pool, whichever is smaller); no request can
    outgrow the pool, ``max_total_num_tokens``."""
    context = int(info.get("context_length") or 0)
    if not context:
        longest_prompt = int(info.get("max_req_input_len") or 0)
        context = longest_prompt + 1 if longest_prompt else 0
    pool = int(info.get("max_total_num_tokens") or 0)
    return pool if pool and (not context or pool < context) else context


def vocab_size(tokenizer_spec: str) -> int:
    """The vocabulary of the tokenizer the router uses (0 when it cannot tell)."""
    try:
        return int(getattr(load_tokenizer(tokenizer_spec), "vocab_size", 0) or 0)
    except (OSError, RuntimeError, ValueError):
        return 0


def connectable(endpoint: str, host: str) -> str:
    """``tcp://*:5557`` (a bind address) -> ``tcp://<engine host>:5557``."""
    for wildcard in ("*", "0.0.0.0", "[::]"):
        endpoint = endpoint.replace(f"//{wildcard}:", f"//{host}:")
    return endpoint


def dp_size(info: Mapping) -> int:
    """How many data-parallel ranks, each with its own KV cache, the engine runs: SGLang 0.5's
    ``kv_events.dp_size`` (one event publisher per rank), else from its server arguments:
    ``dp_size`` x ``attn_dp_size`` (``--dp-size N --enable-dp-attention`` becomes
    ``attn_dp_size`` N and ``dp_size`` 1)."""
    events = info.get("kv_events")
    ranks = events.get("dp_size") if isinstance(events, Mapping) else None
    if not ranks:
        ranks = int(info.get("dp_size") or 1) * int(info.get("attn_dp_size") or 1)
    return max(1, int(ranks))
