"""Mooncake-format trace rows and the prompt arithmetic the trace generators share (pure).

A row is one request as the Mooncake JSONL traces write it: ``timestamp`` (ms), ``input_length``,
``output_length`` and ``hash_ids``, one id per ``block_size`` prompt tokens (the last block may be
partial), equal leading ids meaning equal prefixes; optionally ``program_id`` and ``step`` (agent
programs) and ``hot`` (hot-spot requests; loaders that do not know it ignore it).

Block ids are prefix ids: an id names the whole prompt up to and including its block, so it is
allocated once, the first time that prefix appears, from one counter per trace (small integers,
like the published traces). ``Prompt`` keeps a prompt as its full-block ids plus a token count.
Extending it by new tokens keeps the full blocks; the old partial block, now holding the old tail
plus new tokens, is different content and gets a fresh id, as do the new blocks. A partial last
block is never shared: its id is fresh for every request (an engine does not cache it either).
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol


@dataclass(slots=True)
class BlockIds:
    """The trace's id counter: every new prefix block gets the next integer."""

    next_id: int = 0

    def take(self, n: int) -> tuple[int, ...]:
        ids = tuple(range(self.next_id, self.next_id + n))
        self.next_id += n
        return ids


@dataclass(slots=True, frozen=True)
class Prompt:
    """A prompt's content as prefix ids: ``full`` ids cover ``len(full) * block_size`` tokens,
    ``tokens`` counts them all (the rest, under one block, is the partial tail)."""

    full: tuple[int, ...]
    tokens: int

    def extend(self, n: int, ids: BlockIds, block_size: int) -> Prompt:
        """This prompt followed by ``n`` new tokens (fresh content: fresh ids past the full
        blocks, the old partial block included)."""
        total = self.tokens + n
        grown = total // block_size - len(self.full)
        return Prompt(self.full + ids.take(grown), total)


def start_prompt(n: int, ids: BlockIds, block_size: int) -> Prompt:
    """A prompt of ``n`` brand-new tokens."""
    return Prompt((), 0).extend(n, ids, block_size)


@dataclass(slots=True)
class GeneratedTrace:
    """A generator's result: rows in arrival order and what the sidecar meta adds for this kind
    (hot window, program count...)."""

    rows: list[TraceRow]
    meta: dict = field(default_factory=dict)


@dataclass(slots=True)
class TraceRow:
    """One request of a generated trace (the JSONL line is ``as_json()``)."""

    timestamp_ms: int
    input_length: int
    output_length: int
    hash_ids: list[int]
    program_id: str | None = None
    step: int | None = None
    hot: bool = False
    order: int = field(default=0, compare=False)
    """Generation order: the tie-break among equal timestamps (keeps sorting stable)."""

    def as_json(self) -> dict:
        row: dict = {
            "timestamp": self.timestamp_ms,
            "input_length": self.input_length,
            "output_length": self.output_length,
            "hash_ids": self.hash_ids,
        }
        if self.program_id is not None:
            row["program_id"] = self.program_id
            row["step"] = self.step
        if self.hot:
            row["hot"] = True
        return row


def make_row(
    at_s: float, prompt: Prompt, output: int, ids: BlockIds, block_size: int, **extra
) -> TraceRow:
    """A row arriving at ``at_s`` seconds with ``prompt`` and ``output`` tokens."""
    tail = ids.take(1) if prompt.tokens % block_size else ()
    return TraceRow(
        timestamp_ms=round(at_s * 1000.0),
        input_length=prompt.tokens,
        output_length=output,
        hash_ids=[*prompt.full, *tail],
        **extra,
    )


def in_order(rows: list[TraceRow]) -> int:
    """Sort ``rows`` by timestamp (generation order among ties) and shift them to start at 0;
    returns the shift in ms (what to subtract from any other time of the same trace)."""
    for i, r in enumerate(rows):
        r.order = i
    rows.sort(key=lambda r: (r.timestamp_ms, r.order))
    t0 = rows[0].timestamp_ms if rows else 0
    for r in rows:
        r.timestamp_ms -= t0
    return t0


class ChatParams(Protocol):
    """What ``chat_rows`` reads of a generator's parameters (the hot spot's and the coding
    sessions' frozen dataclasses)."""

    @property
    def block_size(self) -> int: ...
    @property
    def duration_s(self) -> float: ...
    @property
    def max_context_tokens(self) -> int: ...
    @property
    def output_tokens_median(self) -> float: ...
    @property
    def output_tokens_sigma(self) -> float: ...
    @property
    def output_tokens_max(self) -> int: ...
    @property
    def est_prefill_tokens_per_s(self) -> float: ...
    @property
    def est_s_per_output_token(self) -> float: ...


def chat_rows(
    p: ChatParams,
    rng: random.Random,
    ids: BlockIds,
    prompt: Prompt,
    cached: int,
    at: float,
    turns: int,
    think: Callable[[], float],
    message: Callable[[], int],
) -> list[TraceRow]:
    """A chat's turns from ``at`` (``cached``: the first prompt's tokens an idle system holds):
    each turn's answer and the next ``message()`` extend its prompt, and the next turn comes
    after the idle-system service time (``est_service``) and ``think()``; it stops after
    ``turns``, at the context limit or past ``duration_s``."""
    bs, out = p.block_size, []
    for _ in range(turns):
        answer = lognormal(
            rng, p.output_tokens_median, p.output_tokens_sigma, 1, p.output_tokens_max
        )
        if prompt.tokens + answer > p.max_context_tokens or at >= p.duration_s:
            break
        out.append(make_row(at, prompt, answer, ids, bs))
        new = prompt.tokens - cached
        at += est_service(new, answer, p.est_prefill_tokens_per_s, p.est_s_per_output_token)
        at += think()
        cached = len(prompt.full) * bs
        prompt = prompt.extend(answer + message(), ids, bs)
    return out


def est_service(
    new_tokens: int, output: int, prefill_tokens_per_s: float, s_per_token: float
) -> float:
    """Seconds one request takes on an idle system: prefill of its uncached tokens, then decode.
    Open-loop exports place a conversation's next turn this long (plus a pause) after the turn."""
    return new_tokens / prefill_tokens_per_s + output * s_per_token


def zipf_cum_weights(n: int, exponent: float) -> list[float]:
    """Cumulative weights of ranks 1..n under a Zipf law (for ``random.choices``)."""
    return list(itertools.accumulate(1.0 / (i + 1) ** exponent for i in range(n)))


def lognormal(rng: random.Random, median: float, sigma: float, lo: float, hi: float) -> int:
    """A log-normal draw with ``median`` and log-sigma ``sigma``, rounded and clamped."""
    return int(min(hi, max(lo, round(median * math.exp(sigma * rng.gauss(0.0, 1.0))))))


def summary(rows: list[TraceRow]) -> dict:
    """Requests, span and mean lengths (hit ratios need the replay metrics: bench computes them)."""
    n = len(rows)
    return {
        "requests": n,
        "span_s": round(rows[-1].timestamp_ms / 1000.0, 3) if rows else 0.0,
        "mean_input": round(sum(r.input_length for r in rows) / n, 1) if n else 0.0,
        "mean_output": round(sum(r.output_length for r in rows) / n, 1) if n else 0.0,
    }
