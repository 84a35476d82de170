"""One indexed block: ``PrefixIndex``'s dict maps a block's primary hash to an ``Entry``.

A struct the cyclic GC cannot see (``gc=False``), not a tuple. A dict is tracked by the GC as
soon as it holds one tracked value, and every new tuple is tracked, so with tuples the index's
dict was tracked for good and every full collection walked it: ~130 ms per million blocks on the
dev VM, paid by whichever process holds the index (the router follows the KV stream itself) at
the moment the collection runs. A ``gc=False`` struct is no GC object at all, so the dict stays
untracked however it grows. It is also smaller (56 bytes against 80) and mutable: a store or a
removal changes the fields in place instead of building a new tuple and writing it back.

Nothing an entry points to can form a cycle (ints, None, a ``Kids`` set of ints), which is what
``gc=False`` asks of its users.
"""

from __future__ import annotations

import msgspec


class Entry(msgspec.Struct, gc=False):
    """What the index knows of one block (field meanings: ``index``'s module docstring)."""

    held: int
    """Bit per worker slot holding the block."""
    closed: int
    """The workers of ``held`` known to hold every block before it too."""
    check: int
    """The first writer's check hash."""
    bucket: int
    """TTL bucket of the last confirmation."""
    kids: object
    """None, one child's primary hash, or a ``Kids`` set (see ``closure``)."""
