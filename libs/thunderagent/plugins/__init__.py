"""One way to register pluggable policies (routing, scheduling, migration): a named registry.

A plugin is registered once, with ``@REGISTRY.register("name")`` on its class or factory
function; registering a name twice is a bug and raises. ``create(name, **params)`` builds a new
instance; an unknown name, or a parameter the factory does not take, raises a ``ValueError``
that lists the known ones.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar

T = TypeVar("T")
F = TypeVar("F", bound=Callable[..., Any])


class Registry(Generic[T]):
    """Name -> factory (a class or a function taking keyword parameters)."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._factories: dict[str, Callable[..., T]] = {}

    def register(self, name: str) -> Callable[[F], F]:
        def add(factory: F) -> F:
            if name in self._factories:
                raise ValueError(f"{self.kind} {name!r} registered twice")
            self._factories[name] = factory
            return factory

        return add

    def create(self, name: str, **params: Any) -> T:
        """A new instance; ``params`` override its documented defaults."""
        try:
            factory = self._factories[name]
        except KeyError:
            known = ", ".join(self.names())
            raise ValueError(f"unknown {self.kind} {name!r}; known: {known}") from None
        accepted = _keywords(factory)
        unknown = sorted(set(params) - accepted) if accepted is not None else []
        if unknown:
            raise ValueError(
                f"{self.kind} {name!r} has no parameter {', '.join(map(repr, unknown))}; "
                f"its parameters: {', '.join(sorted(accepted))}"  # type: ignore[arg-type]
            )
        return factory(**params)

    def names(self) -> list[str]:
        return sorted(self._factories)

    def __contains__(self, name: object) -> bool:
        return name in self._factories

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())


def _keywords(factory: Callable[..., Any]) -> set[str] | None:
    """The keyword parameters ``factory`` takes; None when it takes any (``**params``)."""
    try:
        parameters = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):  # no signature to read
        return None
    if any(p.kind is p.VAR_KEYWORD for p in parameters):
        return None
    return {p.name for p in parameters if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)}
