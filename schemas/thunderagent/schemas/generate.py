"""Generate request and the replies streamed back to the client's reply subject."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Annotated, Literal

import msgspec
from msgspec import Meta, Struct, field

PositiveInt = Annotated[int, Meta(gt=0)]
TokenId = Annotated[int, Meta(ge=0, lt=2**32)]


class ChatMessage(Struct, frozen=True, kw_only=True):
    """One chat turn, as in OpenAI's chat API."""

    role: Literal["system", "user", "assistant", "tool"]
    """Who spoke."""
    content: str
    """What was said."""


class SamplingParams(Struct, frozen=True, kw_only=True, omit_defaults=True):
    """Sampling settings, forwarded to the engine unchanged."""

    temperature: Annotated[float, Meta(ge=0.0)] = 0.0
    """0 is greedy; the simulated engine ignores it."""
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] = 1.0
    """Nucleus sampling mass."""
    stop: list[str] = field(default_factory=list)
    """Stop strings."""
    ignore_eos: bool = True
    """Generate exactly ``max_tokens`` (benchmarks rely on it)."""


class GenerateRequest(Struct, frozen=True, kw_only=True, omit_defaults=True):
    """A client's request. Exactly one of ``token_ids``, ``text`` or ``messages`` is given.

    Token ids are preferred: the cache is keyed on them, so the router must see the ids the
    engine will see. Text and messages are tokenized by the router with the model's tokenizer
    and forwarded as ids.
    """

    model: Annotated[str, Meta(min_length=1, max_length=256)]
    """Model name; only workers registered for this model are candidates."""
    request_id: str = ""
    """Client-chosen id, unique per request; the router assigns one when empty."""
    token_ids: list[TokenId] | None = None
    """Prompt as token ids (exact, preferred)."""
    text: str | None = None
    """Prompt as text, tokenized by the router."""
    messages: list[ChatMessage] | None = None
    """Prompt as chat messages, rendered with the model's chat template, then tokenized."""
    max_tokens: PositiveInt = 128
    """Upper bound on generated tokens."""
    expected_output_tokens: PositiveInt | None = None
    """The client's estimate of the output length (orders short work first); None: the
    router's running mean of finished outputs, capped by ``max_tokens``."""
    sampling: SamplingParams = field(default_factory=SamplingParams)
    """Sampling settings."""
    priority: Annotated[int, Meta(ge=0, le=9)] = 0
    """0 is the most urgent class; larger numbers are served later (batch work)."""
    program_id: str | None = None
    """Agent program / session this request belongs to; steps of one program share KV."""
    deadline_ms: float | None = None
    """Absolute deadline (Unix ms); a request that cannot meet it gets an early error."""
    stream: bool = True
    """Stream ``TokenChunk`` messages before the ``FinalReply``; when false only the final reply."""
    cache_salt: str | None = None
    """Tenant namespace of the prompt's KV cache (as Dynamo's and vLLM's ``cache_salt``): mixed
    into every block hash, so requests with different salts never share cached prefixes and
    cannot time-probe each other's. None: the shared namespace."""
    lora_name: str | None = None
    """The LoRA adapter to serve it with, by the name the engine loaded it under (SGLang's
    ``lora_path`` in a request, ``lora_name`` in its KV events). An adapter's KV is its own:
    its blocks are cached, and hashed for routing, in the adapter's namespace. None: the base
    model."""
    retry: Annotated[int, Meta(ge=0)] = 0
    """0 on the first try; the client resent this request (same id, same reply subject) this
    many times. A retry always goes through the scheduler, which runs a request id at most once
    (a router that died holding it, a reply that never came)."""

    def __post_init__(self) -> None:
        given = [x for x in (self.token_ids, self.text, self.messages) if x is not None]
        if len(given) != 1:
            raise ValueError("exactly one of token_ids, text or messages must be given")
        if not given[0]:
            raise ValueError("the prompt is empty")

    def prompt_len(self) -> int:
        """Prompt tokens (0 before the router tokenized a text or chat prompt)."""
        return len(self.token_ids or ())

    def extended(self, output: Sequence[int]) -> GenerateRequest:
        """This request with ``output`` appended to its prompt (a continuation's prompt)."""
        return msgspec.structs.replace(self, token_ids=[*(self.token_ids or ()), *output])


class TokenChunk(Struct, frozen=True, kw_only=True, tag="token", tag_field="type"):
    """Tokens generated since the previous chunk."""

    request_id: str
    """The request these tokens belong to."""
    index: int
    """Position of the first token of this chunk in the output (0-based)."""
    token_ids: list[int]
    """New output token ids."""
    text: str = ""
    """New output text (the engine's detokenization), possibly empty."""


class Usage(Struct, frozen=True, kw_only=True):
    """Token accounting of a finished request, as the engine reported it."""

    prompt_tokens: int
    """Prompt length in tokens."""
    cached_tokens: int
    """Prompt tokens served from the engine's prefix cache (not prefilled)."""
    completion_tokens: int
    """Generated tokens."""


class FinishReason(enum.StrEnum):
    LENGTH = "length"
    STOP = "stop"
    ABORT = "abort"


class FinalReply(Struct, frozen=True, kw_only=True, tag="final", tag_field="type"):
    """Last message for a successful request."""

    request_id: str
    """The request that finished."""
    worker_id: str
    """Worker that generated it."""
    usage: Usage
    """Token accounting."""
    ttft_ms: float
    """Time to first token measured at the worker adapter (engine + adapter), ms."""
    e2e_ms: float
    """Adapter-side end-to-end time, ms."""
    finish_reason: FinishReason = FinishReason.LENGTH
    """Why generation stopped."""
    text: str = ""
    """Whole output text (only when the request did not stream)."""
    predicted_cached_tokens: int = -1
    """Cached tokens the router predicted for this worker; -1 when unknown."""
    engine_ttft_ms: float = -1.0
    """Receipt-to-first-token time the engine itself reported; -1 when it reports none
    (SGLang does not; the simulated engine does). Client TTFT minus this is what the whole
    control plane added."""


class ErrorCode(enum.StrEnum):
    BAD_REQUEST = "bad_request"
    """The message could not be decoded or failed validation."""
    UNKNOWN_MODEL = "unknown_model"
    """No worker serves the requested model."""
    UNAVAILABLE = "unavailable"
    """A service on the path did not answer (no scheduler, no worker accepted)."""
    ENGINE_ERROR = "engine_error"
    """The engine failed the request."""
    DEADLINE = "deadline"
    """The deadline passed or cannot be met."""
    CONTEXT_LENGTH = "context_length"
    """Prompt tokens + ``max_tokens`` exceed the model's context."""
    PAYLOAD_TOO_LARGE = "payload_too_large"
    """The message is larger than the bus accepts (the reason names the limit)."""
    OVERLOADED = "overloaded"
    """The model's waiting queue is full; retry after ``ErrorReply.retry_after_s``."""
    CANCELLED = "cancelled"
    """The client cancelled the request (or timed out waiting for it)."""
    INTERNAL = "internal"
    """A bug: the service logged it with a traceback."""


class ErrorReply(Struct, frozen=True, kw_only=True, tag="error", tag_field="type"):
    """Terminal error for a request; no further messages follow."""

    code: ErrorCode
    """Machine-readable class of error."""
    message: str
    """Human-readable reason."""
    request_id: str = ""
    """The request, when it could be decoded."""
    service: str = ""
    """Service that gave up on the request."""
    retry_after_s: float | None = None
    """With ``overloaded``: when a retry is likely to be admitted (seconds from now)."""


class HeldReply(Struct, frozen=True, kw_only=True, tag="held", tag_field="type"):
    """The request is in the control plane's hands (queued or running): the sender stops
    resending and waits for its answer. The router sends it in answer to a resend (``retry`` >
    0) the scheduler accepted; a worker sends it for a run that has told its client nothing
    for a second (a first token still to come, or an answer that is not streamed), so a
    resend cannot reach a scheduler that does not know the run. A request answered sooner
    gets none; a client that resent and heard nothing knows no live router took it."""

    request_id: str
    """The request that is held."""
    service: str = "router"
    """The service that says so (``worker/<id>`` from a worker)."""


ReplyMessage = TokenChunk | FinalReply | ErrorReply | HeldReply
"""Everything a client may receive on its reply subject."""

REPLY_DECODER = msgspec.json.Decoder(ReplyMessage)
