"""Tokenizer protocol, the built-in byte tokenizer and the loader."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Final, Protocol

BYTES_SPEC: Final = "thunderagent/bytes"


class Tokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...

    def decode(self, token_ids: list[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes shifted past ``SPECIALS`` reserved ids; decoding ignores the specials."""

    SPECIALS: Final = 4
    VOCAB_SIZE: Final = 256 + SPECIALS

    def encode(self, text: str) -> list[int]:
        return [b + self.SPECIALS for b in text.encode("utf-8")]

    def decode(self, token_ids: list[int]) -> str:
        data = bytes(t - self.SPECIALS for t in token_ids if self.SPECIALS <= t < self.VOCAB_SIZE)
        return data.decode("utf-8", errors="replace")


class HFTokenizer:
    """A local HF ``tokenizer.json`` through the ``tokenizers`` library."""

    def __init__(self, path: Path) -> None:
        try:
            from tokenizers import Tokenizer as _HF
        except ImportError as err:
            raise RuntimeError(f"tokenizer {path} needs `pip install tokenizers`") from err
        self._tok = _HF.from_file(str(path))

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, token_ids: list[int]) -> str:
        return self._tok.decode(token_ids)


@lru_cache(maxsize=32)
def load_tokenizer(spec: str) -> Tokenizer:
    """``thunderagent/bytes`` or a path to a ``tokenizer.json`` (or a folder holding one)."""
    if spec == BYTES_SPEC:
        return ByteTokenizer()
    path = Path(spec)
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"tokenizer {spec!r}: no such file (expected a tokenizer.json)")
    return HFTokenizer(path)
