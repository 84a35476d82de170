"""Which tenant salt each cached block belongs to, so ``BlockStored`` events can carry it.

SGLang keys a salted request's blocks by hashes seeded with its ``cache_salt`` (two tenants with
the same prompt never share a block) and names the salt on every ``BlockStored`` event of those
blocks. The engine core only sees the (already salted) keys, so the driver remembers the salt of
each salted key here while a request holds it or the cache keeps it, and forgets it once both
are gone: the book never outgrows the running requests plus the cache.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable


class SaltBook:
    def __init__(self) -> None:
        self._salt: dict[int, str] = {}
        self._refs: dict[int, int] = {}
        """Running requests holding each key (a key they hold may not be cached yet)."""

    def __len__(self) -> int:
        return len(self._salt)

    def salt_of(self, key: int) -> str | None:
        return self._salt.get(key)

    def hold(self, keys: Iterable[int], salt: str) -> None:
        """A running request with ``salt`` will store these keys."""
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
