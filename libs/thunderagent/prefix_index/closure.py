"""Upkeep of the ``kids`` links that keep ``PrefixIndex``'s ``closed`` sets exact (see ``index``).

``closed`` of a block names the workers that hold it and every block before it. When a worker
loses a block, the block's descendants lose that worker from ``closed`` too, found through
``kids``: None, one child's hash (the usual chain) or a ``Kids`` set (a branch point). ``kids``
must list every child that is closed for some worker; it may also list children that are gone
or not closed (harmless: they are looked up and skipped).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Final, TypeAlias

from thunderagent.prefix_index.entry import Entry

KIDS_PRUNE_MIN: Final = 32
"""A branch point's kid set is first pruned of gone entries at this size."""


class Kids(set):
    """Children of a branch point. Pruned of gone entries whenever it reaches ``floor`` items,
    and ``floor`` then doubles past what is left: amortised O(1) per added kid."""

    __slots__ = ("floor",)

    def __init__(self, items: Iterable[int] = ()) -> None:
        super().__init__(items)
        self.floor = max(2 * len(self), KIDS_PRUNE_MIN)

    def add_pruned(self, entries: dict, kid: int) -> None:
        """Add ``kid`` (whose entry may not exist yet: it is about to be stored)."""
        if len(self) + 1 >= self.floor:
            self.difference_update([k for k in self if k not in entries])
            self.floor = max(2 * (len(self) + 1), KIDS_PRUNE_MIN)
        self.add(kid)


KidsField: TypeAlias = "int | Kids | None"
"""An entry's ``kids`` field."""


def with_kid(entries: dict, kids: KidsField, kid: int) -> KidsField:
    """``kids`` with ``kid`` in it: the same object if it is a set (added in place)."""
    if kids is None:
        return kid
    if kids.__class__ is Kids:
        if kid not in kids:  # type: ignore[operator]
            kids.add_pruned(entries, kid)  # type: ignore[union-attr]
        return kids
    if kids == kid:
        return kids
    return Kids((kids, kid))


def link(entries: dict, e: Entry, kid: int) -> None:
    """Record ``kid`` among the kids of the entry ``e``."""
    e.kids = with_kid(entries, e.kids, kid)  # type: ignore[arg-type]


def unclose(entries: dict, stack: list[tuple[KidsField, int]]) -> None:
    """For each ``(kids, mask)``: those workers lost a block above the kids, so clear ``mask``
    from the kids' closed sets, and on down. Only bits actually cleared go further down, so it
    terminates (even on a chain that loops through a repeated hash)."""
    get = entries.get
    while stack:
        kids, mask = stack.pop()
        for c in kids if kids.__class__ is Kids else (kids,):  # type: ignore[union-attr]
            e = get(c)
            if e is not None and e.closed & mask:
                m = e.closed & mask
                e.closed ^= m
                if e.kids is not None:
                    stack.append((e.kids, m))  # type: ignore[arg-type]
