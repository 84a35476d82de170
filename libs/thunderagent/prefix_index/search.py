"""The overlap query over ``PrefixIndex`` entries: a bisection for the depths where the set of
workers changes, instead of a walk over every block.

Entries are ``primary -> Entry(held, closed, check, bucket, kids)`` (see ``index``). ``closed`` is
monotone along a chain: a worker in ``closed`` of block ``i`` is in ``closed`` of every block
before it, so along one prompt ``f(i) = closed(prompt[i])`` only ever loses workers. The answer
is where it loses them: a worker that leaves between depths ``d - 1`` and ``d`` holds exactly
``d`` leading blocks, and an interval whose two ends have the same ``f`` has it everywhere in
between. So the query probes block 0, takes ``f = 0`` past the end, and bisects only the
intervals whose ends differ: a 64-block prompt with two or three change points costs ~11 lookups
instead of ~40-64.

Why bisection (one dependent lookup at a time) and not wider rounds of parallel lookups: a cold
lookup in a million-entry dict is several dependent cache misses (hash slot, entry, key, value
tuple), ~300-700 ns here, and ``map(dict.get, ...)`` overlaps barely two of them, so the count of
lookups decides; measured on 64-block queries over ~1 M entries, rounds of 3 or 7 probes cost as
much cold and more hot.

``closed`` may under-state (a worker that stored blocks before their parent): where a worker
leaves ``closed``, its ``held`` bit of the next block is looked at, and a worker still holding it
is followed block by block (``_extend``), so the answer stays exact. It never over-states: the
index clears ``closed`` down a block's descendants whenever a worker loses the block. On input
that breaks the chain contract, ``f`` is forced monotone (each probe is ANDed with the mask to
its left), so a worker is never credited past a probed block it does not hold.

The check hash is compared where a worker is credited; on a mismatch the caller re-walks the
query comparing every block (``walk(..., verify=True)``), also the reference the tests use.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from thunderagent.prefix_index.entry import Entry

Credit = Callable[[dict, int, int], None]
Get = Callable[[int], Entry | None]


def search(
    get: Get, primary: Sequence[int], check: Sequence[int] | None, credit: Credit
) -> dict[str, int] | None:
    """``{worker: matched_blocks}``, or None when a check hash did not match (re-walk)."""
    out: dict[str, int] = {}
    first = get(primary[0])
    if first is None:
        return out
    m_first = first.closed
    if _drop(get, primary, check, credit, out, 0, first, ~m_first, first):
        return None
    # Intervals (a, b, f(a), f(b), entry a, entry b) whose ends differ; past the prompt's end
    # f is 0 (no probe of the last block: a new turn's last blocks are usually uncached).
    todo = [(0, len(primary), m_first, 0, first, None)]
    while todo:
        a, b, ma, mb, ea, eb = todo.pop()
        if b - a == 1:
            if _drop(get, primary, check, credit, out, b, ea, ma & ~mb, eb):
                return None
            continue
        mid = (a + b) >> 1
        em = get(primary[mid])
        mm = em.closed & ma if em is not None else 0
        if mm != mb:
            todo.append((mid, b, mm, mb & mm, em, eb))
        if mm != ma:
            todo.append((a, mid, ma, mm, ea, em))
    return out


def _drop(get, primary, check, credit, out, d: int, prev: Entry, gone: int, nxt) -> bool:
    """The workers ``gone`` hold blocks ``0..d-1`` and are not closed at block ``d`` (entry
    ``nxt``; ``prev`` is block ``d-1``'s): credit them with ``d``, except those that still
    hold block ``d`` (``closed`` under-stated), which are followed. True on a check mismatch."""
    follow = gone & nxt.held if nxt is not None else 0
    if follow:
        gone &= ~follow
    if gone and d:
        if check is not None and prev.check != check[d - 1]:
            return True
        credit(out, gone, d)
    if follow:
        return _extend(get, primary, check, credit, out, d, nxt, follow)
    return False


def _extend(get, primary, check, credit, out, d: int, e: Entry, mask: int) -> bool:
    """Follow the workers ``mask``, which hold blocks ``0..d``, by their ``held`` bits."""
    n = len(primary)
    while True:
        d += 1
        nxt = get(primary[d]) if d < n else None
        m = nxt.held & mask if nxt is not None else 0
        if m != mask:
            if check is not None and e.check != check[d - 1]:
                return True
            credit(out, mask ^ m, d)
            if not m:
                return False
            mask = m
        e = nxt


def walk(
    get: Callable[[int], Entry | None],
    primary: Sequence[int],
    check: Sequence[int] | None,
    credit: Credit,
    verify: bool,
) -> dict[str, int]:
    """Block-by-block reference: AND the ``held`` masks in order; with ``verify`` compare every
    block's check hash and stop at the first mismatch."""
    out: dict[str, int] = {}
    mask = -1
    depth = 0
    prev = None
    for i, p in enumerate(primary):
        e = get(p)
        if e is None or (verify and check is not None and e.check != check[i]):
            break
        m = mask & e.held
        if m != mask:
            if depth:
                credit(out, mask ^ m, depth)
            mask = m
            if not m:
                return out
        prev = e
        depth += 1
    if depth and prev is not None:
        credit(out, mask, depth)
    return out
