"""Which namespace (tenant salt, LoRA adapter) each cached block belongs to, so ``BlockStored``
events can carry it.

SGLang keys a salted request's blocks by hashes seeded with its ``cache_salt`` (two tenants with
the same prompt never share a block), a LoRA adapter's in the adapter's namespace, and names the
salt and the adapter on every ``BlockStored`` event of those blocks. The engine core only sees
the (already namespaced) keys, so the driver remembers the namespace of each such key here while
a request holds it or the cache keeps it, and forgets it once both are gone: the book never
outgrows the running requests plus the cache.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import NamedTuple

from thunderagent.sglang import kv_wire


class CacheNamespace(NamedTuple):
    cache_salt: str | None
    lora_name: str | None

    def seed(self) -> bytes:
        """The chain seed of its block hashes: SGLang's for a salt; for an adapter, one of the
        simulated engine's own (SGLang's adapter keys are opaque, named by ``lora_name``)."""
        if self.lora_name:
            return kv_wire.sglang_salt_parent(
                f"{self.cache_salt or ''}\x00lora\x00{self.lora_name}"
            )
        return kv_wire.sglang_salt_parent(self.cache_salt or "")


def cache_namespace(cache_salt: str | None, lora_name: str | None) -> CacheNamespace | None:
    """A request's namespace; None for the shared one (no salt, the base model)."""
    return CacheNamespace(cache_salt, lora_name) if cache_salt or lora_name else None


class SaltBook:
    def __init__(self) -> None:
        self._salt: dict[int, CacheNamespace] = {}
        self._refs: dict[int, int] = {}
        """Running requests holding each key (a key they hold may not be cached yet)."""

    def __len__(self) -> int:
        return len(self._salt)

    def salt_of(self, key: int) -> CacheNamespace | None:
        return self._salt.get(key)

    def hold(self, keys: Iterable[int], salt: CacheNamespace) -> None:
        """A running request in namespace ``salt`` will store these keys."""
        for key in keys:
            self._salt[key] = salt
            self._refs[key] = self._refs.get(key, 0) + 1

    def release(self, keys: Iterable[int], cached: Callable[[int], bool]) -> None:
        """The request ended: keep only the salts of keys the cache still holds."""
        for key in keys:
            left = self._refs.get(key, 0) - 1
            if left > 0:
                self._refs[key] = left
                continue
            self._refs.pop(key, None)
            if not cached(key):
                self._salt.pop(key, None)

    def forget(self, keys: Iterable[int], cached: Callable[[int], bool]) -> None:
        """These keys left (a tier of) the cache: drop the ones nothing holds any more."""
        for key in keys:
            if key not in self._refs and not cached(key):
                self._salt.pop(key, None)

    def keys(self) -> list[int]:
        return list(self._salt)
