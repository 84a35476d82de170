"""Two adapters started at once on one worker id: the one that registered first keeps it."""

from __future__ import annotations

import msgspec

from thunderagent.schemas import WorkerRegistration
from thunderagent.worker.id_lease import IdLease


def registration(engine_url: str, registered_at: float) -> WorkerRegistration:
    return WorkerRegistration(
        worker_id="w0", model="m", engine_url=engine_url, block_size=16, kv_capacity_blocks=8,
        lease_s=10.0, registered_at=registered_at,
    )  # fmt: skip


def adapter(engine_url: str, registered_at: float) -> IdLease:
    """The worker-id hold of an adapter in front of ``engine_url``."""
    return IdLease(None, registration(engine_url, registered_at))  # type: ignore[arg-type]


def test_the_later_adapter_leaves_and_the_first_keeps_the_id() -> None:
    first, later = adapter("http://a:1", 100.0), adapter("http://b:1", 105.0)
    wrote_first = (7, msgspec.json.encode(first.registration))
    wrote_later = (8, msgspec.json.encode(later.registration))
    # each sees the other's write since its own last renewal (revision 5)
    assert first.still_ours(wrote_later, 5) and first.taken is None
    assert not later.still_ours(wrote_first, 5)
    assert later.taken == (
        "worker id 'w0' is in use by a live adapter in front of http://a:1: "
        "give this one another --worker-id"
    )


def test_its_own_last_write_or_an_empty_key_or_garbage_keep_the_id() -> None:
    a = adapter("http://a:1", 100.0)
    assert a.still_ours((5, msgspec.json.encode(a.registration)), 5)
    assert a.still_ours(None, 5) and a.still_ours((9, b"x"), None)
    assert a.still_ours((9, b"not json"), 5) and a.taken is None
