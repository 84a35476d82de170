"""The router's hand-offs as the scheduler decodes them: the prompt's ids left unparsed.

The scheduler needs a prompt's length on every request and never its values: it passes the
prompt on to a worker (whose adapter checks every id before an engine sees it) and extends it
with output already streamed when it resumes a run. Here ``token_ids`` is the JSON array's bytes
(``msgspec.Raw``), counted, spliced and sent on as they came. Parsing 32k ids into a list took
the scheduler ~1.6 ms per request, skipping them ~0.6 ms. The wire is the same: a
``GenerateRequest`` decoder reads what these encode, and the other way round. The classes keep
the wire names, so a refusal names the message as its sender knows it.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec
import numpy as np

from thunderagent.schemas import generate, routing

_COMMA = ord(",")
_SHORT_ARRAY_BYTES = 4096
_NOT_INTEGERS = (b"-", b".", b"e", b"E", b'"', b"[", b"{", b"n")
"""Bytes that only a value other than a non-negative integer puts inside a JSON array (a sign, a
fraction, an exponent, a string, a nested array or object, true, false, null)."""
_INTEGER_BYTES = b"0123456789, \t\r\n"
_NOT_GIVEN = msgspec.Raw(b"")


def _integers_only(inside: bytes) -> bool:
    """Whether what is between a JSON array's brackets holds non-negative integers only: a
    short one deletes its digits, commas and white space and must leave nothing (~0.3 µs at 64
    ids), a long one is searched for each byte another value needs (~47 µs at 32k ids, where
    the deletion takes 0.12-0.35 ms)."""
    if len(inside) <= _SHORT_ARRAY_BYTES:
        return not inside.translate(None, _INTEGER_BYTES)
    return not any(b in inside for b in _NOT_INTEGERS)


class GenerateRequest(generate.GenerateRequest, frozen=True, kw_only=True, omit_defaults=True):
    """A tokenized request with its ids as the JSON array they arrived in."""

    token_ids: msgspec.Raw = _NOT_GIVEN  # type: ignore[assignment]
    """The prompt's ids: a JSON array of non-negative integers (the router checked each against
    the model's vocabulary; the adapter checks each is a token id before its engine sees it)."""

    def __post_init__(self) -> None:
        # a run of text could never be resumed: continuations extend the prompt's token ids
        if self.text is not None or self.messages is not None or not len(self.token_ids):
            raise ValueError("a relayed request carries token ids (the router tokenizes)")
        array = bytes(self.token_ids)
        if array[:1] != b"[" or not _integers_only(array[1:-1]):
            raise ValueError("token_ids is not an array of non-negative integers")
        if self.prompt_len() == 0:
            raise ValueError("the prompt is empty")

    @classmethod
    def of(cls, request: generate.GenerateRequest) -> GenerateRequest:
        """``request`` (tokenized) with its ids encoded once, for every message that carries it."""
        if isinstance(request, GenerateRequest):
            return request
        fields = msgspec.structs.asdict(request)
        fields["token_ids"] = msgspec.Raw(msgspec.json.encode(request.token_ids))
        return cls(**fields)

    def prompt_len(self) -> int:
        # integers only: the commas count the items (~27 µs at 32k ids); numpy's call costs
        # more than a plain scan of a short array's bytes
        raw = self.token_ids
        if len(raw) > _SHORT_ARRAY_BYTES:
            commas = int(np.count_nonzero(np.frombuffer(raw, np.uint8) == _COMMA))
        else:
            commas = bytes(raw).count(b",")
        if commas:
            return commas + 1
        return 1 if bytes(raw).strip(b"[] \t\r\n") else 0  # [7], or [ ] as JSON may space it

    def extended(self, output: Sequence[int]) -> GenerateRequest:
        if not output:
            return self
        tail = msgspec.json.encode(list(output))
        spliced = bytes(self.token_ids)[:-1] + b"," + tail[1:]
        return msgspec.structs.replace(self, token_ids=msgspec.Raw(spliced))


class ScheduleRequest(routing.ScheduleRequest, frozen=True, kw_only=True):
    """``routing.ScheduleRequest`` as the scheduler decodes it."""

    request: GenerateRequest  # type: ignore[assignment]


class DirectDispatch(routing.DirectDispatch, frozen=True, kw_only=True):
    """``routing.DirectDispatch`` as the scheduler decodes it."""

    submit: ScheduleRequest  # type: ignore[assignment]
