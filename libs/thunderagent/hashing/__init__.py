"""Chained block hashing with a second verification hash (see ``blocks`` for the scheme)."""

from thunderagent.hashing.blocks import (
    SCHEME_VERSION,
    BlockHash,
    BlockHasher,
    BlockHashes,
    CheckHash,
    Namespace,
    kv_namespace,
    namespace_roots,
    pack_tokens,
)

__all__ = [
    "SCHEME_VERSION",
    "BlockHash",
    "BlockHasher",
    "BlockHashes",
    "CheckHash",
    "Namespace",
    "kv_namespace",
    "namespace_roots",
    "pack_tokens",
]
