"""Fuzz payloads: random bytes, and JSON shaped like a message type but with extreme values.

Shaped payloads follow the Struct's fields as ``msgspec.inspect`` describes them (so most reach
the handler, which is where crashes hide) and then bend them: huge, negative and zero ints,
the largest finite floats, empty and huge lists and strings, wrong types, unknown worker ids,
unicode and control characters, unknown fields, missing fields, deeply nested JSON, and literals
JSON has no value for (``NaN``). Everything is drawn from one seeded ``random.Random``, so a
failing case is reproduced by its seed and index.
"""

from __future__ import annotations

import copy
import random
from dataclasses import dataclass
from typing import Any

import msgspec
import msgspec.inspect as mi

INTS = (
    0,
    1,
    -1,
    2,
    7,
    2**31 - 1,
    2**31,
    -(2**31),
    2**32 - 1,
    2**32,
    2**53 + 1,
    2**63 - 1,
    -(2**63),
    2**64 - 1,
)
FLOATS = (
    0.0,
    -0.0,
    1.0,
    -1.0,
    0.5,
    1e-308,
    5e-324,
    1.7976931348623157e308,
    -1.7976931348623157e308,
    1e300,
    -1e300,
    1e15,
    4102444800.0,
)
STRINGS = (
    "",
    "w0",
    "w1",
    "ghost-worker",
    "sim/test-model.v1",
    "x" * 300,
    "é✓🙂\u200b",
    "\x00\x01\x7f",
    " spaced subject ",
    "thunderagent.requests.>",
    "_INBOX.fuzz.x",
    "a.b.*",
    "%2E%",
    "../../etc/passwd",
    "null",
    "NaN",
    "\ud7ff\ue000",
    "finished",
    "started",
    "GPU",
    "CPU_PINNED",
    "stored",
)
WORKERS = ("w0", "w1", "ghost", "", "W0", "w0.load", "w*", "w 0", "🙂")


def Raw(text: str) -> msgspec.Raw:
    """A piece of JSON text spliced in as it is (NaN, huge nesting, lone surrogates)."""
    return msgspec.Raw(text.encode())


def to_json(value: Any) -> bytes:
    """JSON of plain values with :func:`Raw` pieces (msgspec splices them in unchecked)."""
    return msgspec.json.encode(value)


@dataclass
class Shaper:
    """Draws values for a type; ``big`` bounds how large a huge list or string gets."""

    rng: random.Random
    big: int = 20_000
    wrong_type_p: float = 0.08

    # ---- entry points ---------------------------------------------------------------------
    def message(self, message_type: Any, seed: Any = None) -> bytes:
        """A payload for ``message_type``; with a valid ``seed`` (JSON values), most are the
        seed with one to three leaves bent, the rest are drawn from the type alone."""
        info = mi.type_info(message_type)
        roll = self.rng.random()
        if roll < 0.02:
            return to_json(Raw("[" * 50_000 + "]" * 50_000))  # deep nesting
        if roll < 0.04:
            return to_json(Raw('{"a":' * 20_000 + "1" + "}" * 20_000))
        if seed is not None and roll < 0.7:
            value = copy.deepcopy(seed)
            for _ in range(self.rng.randint(1, 3)):
                value = self.bend(value)
            return to_json(value)
        return to_json(self.value(info, 0))

    def bend(self, value: Any) -> Any:
        """``value`` with one leaf (or a whole list or object) replaced by an extreme."""
        if isinstance(value, dict) and value and self.rng.random() < 0.85:
            key = self.rng.choice(list(value))
            value[key] = self.bend(value[key])
            return value
        if isinstance(value, list) and value and self.rng.random() < 0.7:
            i = self.rng.randrange(len(value))
            value[i] = self.bend(value[i])
            return value
        return self.extreme_like(value)

    def extreme_like(self, value: Any) -> Any:
        if self.rng.random() < self.wrong_type_p * 2:
            return self.wrong()
        if isinstance(value, bool):
            return not value
        if isinstance(value, int):
            return self.rng.choice(INTS + (-(2**70), 10**40))
        if isinstance(value, float):
            return self.rng.choice(FLOATS)
        if isinstance(value, str):
            return self.rng.choice(WORKERS) if self.rng.random() < 0.3 else self.string()
        if isinstance(value, list):
            sample = value[0] if value else 0
            return self.rng.choice(
                (
                    [],
                    [sample] * self.rng.randint(self.big // 4, self.big),
                    [self.extreme_like(sample)],
                )
            )
        if isinstance(value, dict):
            return self.rng.choice(({}, {**value, self.string(): self.wrong()}))
        return self.wrong()

    def value(self, info: mi.Type, depth: int) -> Any:
        if depth > 0 and self.rng.random() < self.wrong_type_p:
            return self.wrong()
        if isinstance(info, mi.StructType):
            return self.struct(info, depth)
        if isinstance(info, mi.UnionType):
            return self.value(self.rng.choice(info.types), depth)
        if isinstance(info, mi.IntType):
            return self.int_(info)
        if isinstance(info, mi.FloatType):
            return self.rng.choice(FLOATS) if self.rng.random() < 0.8 else Raw("NaN")
        if isinstance(info, mi.StrType):
            return self.string()
        if isinstance(info, mi.BoolType):
            return self.rng.random() < 0.5
        if isinstance(info, mi.NoneType):
            return None
        if isinstance(info, mi.BytesType):
            return self.rng.choice(("", "AAAA", "not base64 ✓"))
        if isinstance(info, mi.ListType | mi.SetType | mi.VarTupleType):
            return self.list_(info.item_type, depth)
        if isinstance(info, mi.DictType):
            return {
                self.string(): self.value(info.value_type, depth + 1)
                for _ in range(self.rng.choice((0, 1, 3)))
            }
        if isinstance(info, mi.LiteralType):
            return self.rng.choice(info.values) if self.rng.random() < 0.8 else self.string()
        if isinstance(info, mi.EnumType):
            members = [m.value for m in info.cls]
            return self.rng.choice(members) if self.rng.random() < 0.8 else self.string()
        return self.wrong()

    # ---- pieces ----------------------------------------------------------------------------
    def struct(self, info: mi.StructType, depth: int) -> dict:
        out: dict[str, Any] = {}
        if info.tag_field is not None:
            tag = info.tag if self.rng.random() < 0.9 else self.string()
            out[info.tag_field] = tag
        for f in info.fields:
            if self.rng.random() < (0.97 if f.required else 0.6):
                if f.name.endswith("worker_id") or f.name in ("source", "target", "worker"):
                    out[f.encode_name] = self.rng.choice(WORKERS)
                else:
                    out[f.encode_name] = self.value(f.type, depth + 1)
        if self.rng.random() < 0.1:
            out[self.string() or "unknown"] = self.wrong()
        return out

    def int_(self, info: mi.IntType) -> Any:
        r = self.rng.random()
        if r < 0.5:
            return self.rng.choice(INTS)
        if r < 0.6:
            return self.rng.choice((-(2**70), 2**70, 10**40))  # beyond int64: must be refused
        lo = info.ge if info.ge is not None else -1000
        hi = info.le if info.le is not None else 100_000
        return self.rng.randint(min(lo, hi), max(lo, hi)) if hi - lo < 10**12 else 1

    def string(self) -> str:
        r = self.rng.random()
        if r < 0.75:
            return self.rng.choice(STRINGS)
        if r < 0.8:
            return "🙂" * self.rng.randint(1, self.big)
        n = self.rng.randint(1, 40)
        return "".join(
            chr(self.rng.choice((self.rng.randint(32, 126), self.rng.randint(0, 0x2FFF))))
            for _ in range(n)
        )

    def list_(self, item: mi.Type, depth: int) -> Any:
        r = self.rng.random()
        if r < 0.2:
            return []
        if r < 0.27 and isinstance(item, mi.IntType):
            n = self.rng.randint(self.big // 2, self.big * 5)  # a long prompt / hash list
            return [self.rng.randint(0, 2**31) for _ in range(n)]
        if r < 0.3:
            return [self.value(item, depth + 1)] * self.rng.randint(100, 2_000)
        return [self.value(item, depth + 1) for _ in range(self.rng.randint(1, 4))]

    def wrong(self) -> Any:
        return self.rng.choice(
            (
                None,
                True,
                0,
                -1,
                2**64 - 1,
                1e308,
                "",
                "str",
                [],
                {},
                [[]],
                {"k": [1, {"x": None}]},
                Raw("NaN"),
                Raw('"\\ud800"'),
            )
        )


def random_bytes(rng: random.Random, big: int = 20_000) -> bytes:
    """Bytes with no structure, or almost-JSON (truncated, corrupted, not UTF-8)."""
    r = rng.random()
    if r < 0.4:
        return rng.randbytes(rng.choice((0, 1, 2, 7, 64, 512, 4096)))
    if r < 0.5:
        return rng.randbytes(rng.randint(big, big * 10))
    if r < 0.7:
        text = bytearray(
            rng.choice(
                (
                    b'{"model": "m", "text": "hi"}',
                    b"[1,2,3]",
                    b"{}",
                    b"null",
                    b'"x"',
                    b"true",
                    b'{"type":"stored"}',
                )
            )
        )
        for _ in range(rng.randint(1, 4)):
            text[rng.randrange(len(text))] = rng.randrange(256)
        return bytes(text)
    if r < 0.85:
        return b'{"model": "m", "text": "' + rng.randbytes(rng.randint(1, 200)) + b'"}'
    return rng.choice((b"\xff\xfe", b"\x00" * 100, b"{" * 1000, b'{"a":1,"a":2}', b" ", b"\n"))
