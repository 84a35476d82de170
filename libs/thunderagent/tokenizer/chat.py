"""A plain chat template for simulated models (real models bring their own template)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol


class Turn(Protocol):
    """Anything with a role and a content: the wire's ``ChatMessage`` or the engine's own."""

    role: str
    content: str


def render_chat(messages: Iterable[Turn]) -> str:
    """``<|role|>\\ncontent\\n`` per turn, then the assistant header.

    Stable across turns: the rendering of turns 1..k is a prefix of the rendering of turns
    1..k+1 (minus the trailing assistant header), so a conversation's KV cache is reusable.
    """
    parts = [f"<|{m.role}|>\n{m.content}\n" for m in messages]
    parts.append("<|assistant|>\n")
    return "".join(parts)
