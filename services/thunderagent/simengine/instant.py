"""Instant engine mode (``--engine instant``): zero compute time, for measuring what sits in
front of an engine.

``/generate`` answers at once with exactly one output token (whatever ``max_new_tokens`` asks)
and ``finish_reason`` length. The prefix cache is still real: the prompt's full blocks are looked
up (``cached_tokens``), stored and published as SGLang KV events, so routing and the index see
the same cache traffic as with the timed engine, only with no modelled prefill or decode time.

The answer is one HTTP body (SSE lines when ``stream`` is set, JSON otherwise) encoded with
msgspec: the engine has to be cheap, since it shares the CPU with whatever is measured.
"""

from __future__ import annotations

import time

import msgspec

from thunderagent.sglang import kv_wire
from thunderagent.simengine.driver import EngineDriver, GenerateInput, output_token
from thunderagent.simengine.salts import cache_namespace
from thunderagent.tokenizer import ByteTokenizer

_encode = msgspec.json.Encoder().encode
SSE_DONE = b"data: [DONE]\n\n"
TOKEN = output_token(0)
TEXT = ByteTokenizer().decode([TOKEN])


class InstantMeta(msgspec.Struct):
    """SGLang's ``meta_info`` for the one-token answer."""

    id: str
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    finish_reason: dict
    e2e_latency: float
    engine_ttft_s: float
    """Not an SGLang field (as in the timed engine): receipt-to-first-token time."""


class InstantChunk(msgspec.Struct):
    text: str
    output_ids: list[int]
    meta_info: InstantMeta


async def cache_prompt(engine: EngineDriver, req: GenerateInput) -> int:
    """Look up and store the prompt's full blocks in ``engine``'s cache (its events are
    published); returns the prompt tokens that were already cached."""
    size = engine.block_size
    full = len(req.input_ids) - len(req.input_ids) % size
    if not full:
        return 0
    space = cache_namespace(req.cache_salt, req.lora_name)
    keys = kv_wire.sglang_block_hashes(req.input_ids[:full], size, space and space.seed())
    cache = engine.core.cache
    cached = cache.match(keys).gpu
    if cached < len(keys):

        def store() -> None:
            if space:  # BlockStored events name the tenant's salt and the adapter
                engine.salts.hold(keys, space)
            engine.core.import_blocks(keys, req.input_ids[:full])

        await engine.between_steps(store)
        if space:
            engine.salts.release(keys, cache.__contains__)
    # like SGLang, the last prompt token is always computed: a full hit still leaves one
    return min(cached * size, len(req.input_ids) - 1)


async def answer(
    engine: EngineDriver, req: GenerateInput, received: float, *, stream: bool
) -> bytes:
    """The whole response body for ``req``: one token, finished."""
    cached = await cache_prompt(engine, req)
    now = time.monotonic()
    meta = InstantMeta(
        id=req.rid,
        prompt_tokens=len(req.input_ids),
        cached_tokens=cached,
        completion_tokens=1,
        finish_reason={"type": "length", "length": 1},
        e2e_latency=now - received,
        engine_ttft_s=now - received,
    )
    chunk = _encode(InstantChunk(text=TEXT, output_ids=[TOKEN], meta_info=meta))
    if not stream:
        return chunk
    return b"data: " + chunk + b"\n\n" + SSE_DONE
