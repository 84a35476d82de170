"""Tokenizer protocol, the built-in byte tokenizer and the loader.

Chat messages become prompt text in one place, ``load_tokenizer(spec).render_chat(messages)``:
with the model's own chat template when its tokenizer folder has one (``templates.py``), else
the plain built-in rendering (``chat.py``).
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Final, Protocol

from thunderagent.tokenizer.chat import Turn, render_chat
from thunderagent.tokenizer.templates import ChatTemplate, load_chat_template

BYTES_SPEC: Final = "thunderagent/bytes"


class Tokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...

    def decode(self, token_ids: list[int]) -> str: ...

    def render_chat(self, messages: Iterable[Turn], *, now: datetime | None = None) -> str:
        """Prompt text for chat ``messages``, ending with the assistant's turn opening."""
        ...


class ByteTokenizer:
    """UTF-8 bytes shifted past ``SPECIALS`` reserved ids; decoding ignores the specials."""

    SPECIALS: Final = 4
    VOCAB_SIZE: Final = 256 + SPECIALS

    def encode(self, text: str) -> list[int]:
        return [b + self.SPECIALS for b in text.encode("utf-8")]

    def decode(self, token_ids: list[int]) -> str:
        data = bytes(t - self.SPECIALS for t in token_ids if self.SPECIALS <= t < self.VOCAB_SIZE)
        return data.decode("utf-8", errors="replace")

    def render_chat(self, messages: Iterable[Turn], *, now: datetime | None = None) -> str:
        return render_chat(messages)


class HFTokenizer:
    """A local HF ``tokenizer.json`` through the ``tokenizers`` library."""

    def __init__(self, path: Path) -> None:
        try:
            from tokenizers import Tokenizer as _HF
        except ImportError as err:
            raise RuntimeError(f"tokenizer {path} needs `pip install tokenizers`") from err
        self._tok = _HF.from_file(str(path))
        self.chat_template: ChatTemplate | None = load_chat_template(path.parent)

    @property
    def vocab_size(self) -> int:
        """Token ids are below this (added special tokens included)."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, token_ids: list[int]) -> str:
        return self._tok.decode(token_ids)

    def render_chat(self, messages: Iterable[Turn], *, now: datetime | None = None) -> str:
        """The model's template; the built-in rendering when its folder has none. Special
        tokens in the text (``<|begin_of_text|>``, ...) become their ids in :meth:`encode`, as
        transformers' ``apply_chat_template(tokenize=True)`` does."""
        if self.chat_template is None:
            return render_chat(messages)
        return self.chat_template.render(messages, now=now)


@lru_cache(maxsize=32)
def load_tokenizer(spec: str) -> Tokenizer:
    """``thunderagent/bytes`` or a path to a ``tokenizer.json`` (or a folder holding one); the
    chat template comes from the same folder."""
    if spec == BYTES_SPEC:
        return ByteTokenizer()
    path = Path(spec)
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"tokenizer {spec!r}: no such file (expected a tokenizer.json)")
    return HFTokenizer(path)
