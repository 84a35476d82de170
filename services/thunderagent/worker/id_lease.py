"""An adapter's hold on its worker id: its registration under the id's key in the fleet bucket.

Two adapters on one id would both take every request sent to it (each answer streamed twice,
interleaved) and overwrite each other's registration and KV events, so the id is claimed
before any of its subjects is subscribed, renewed by compare-and-set on the adapter's own last
revision, and given up to the adapter that registered first when two started at once.
"""

from __future__ import annotations

import asyncio
import logging

import msgspec

from thunderagent.bus import Bucket
from thunderagent.schemas import WorkerRegistration, subjects
from thunderagent.worker.waits import sleep_or_stop

log = logging.getLogger(__name__)


class IdLease:
    def __init__(self, bucket: Bucket, registration: WorkerRegistration) -> None:
        self.bucket = bucket
        self.registration = registration
        """What this adapter writes under the key."""
        self.worker_id = registration.worker_id
        self.key = subjects.worker_key(self.worker_id)
        self._payload = msgspec.json.encode(registration)
        self.taken: str | None = None
        """Why the id is another adapter's (the later of two started at once), else None."""
        self._revision: int | None = None

    async def claim(self, stop: asyncio.Event) -> None:
        """Refuse to start (``SystemExit``) when another live adapter holds the id. A
        registration left by an adapter that died is not renewed: it is taken over after half a
        lease (renewals come every third of one)."""
        seen = await self.bucket.get(self.key)
        if seen is None:
            return
        other = _registration(seen[1])
        lease_s = other.lease_s if other is not None else 0.0
        log.info("%s is registered: waiting %.1f s to see if its adapter renews it", self.key,
                 lease_s / 2)  # fmt: skip
        await sleep_or_stop(stop, lease_s / 2)
        now = await self.bucket.get(self.key)
        if now is not None and now[0] != seen[0]:
            raise SystemExit(_id_in_use(self.worker_id, now[1]))

    def amend(self, registration: WorkerRegistration) -> None:
        """Write ``registration`` from the next renewal on (same worker and start: what the
        engine serves changed, e.g. a LoRA adapter loaded)."""
        assert registration.worker_id == self.worker_id
        assert registration.registered_at == self.registration.registered_at
        self.registration = registration
        self._payload = msgspec.json.encode(registration)

    async def renew(self) -> bool:
        """Write the registration unless another adapter took the id since our last write (then
        False, and ``taken`` says why): a compare-and-set on our last revision, so the common
        renewal is one round trip; only a conflict reads the key."""
        if self._revision is not None:
            written = await self.bucket.update(self.key, self._payload, self._revision)
            if written is not None:
                self._revision = written
                return True
            if not self.still_ours(await self.bucket.get(self.key), self._revision):
                return False
        self._revision = await self.bucket.put(self.key, self._payload)
        return True

    def still_ours(self, current: tuple[int, bytes] | None, revision: int | None) -> bool:
        """False when another adapter wrote the key since our last renewal and it registered
        first (two started at once: the later one leaves, the first keeps it)."""
        if current is None or revision is None or current[0] == revision:
            return True
        other, mine = _registration(current[1]), self.registration
        if other is None or (other.registered_at, other.engine_url) >= (
            mine.registered_at,
            mine.engine_url,
        ):
            return True
        self.taken = _id_in_use(self.worker_id, current[1])
        return False

    async def withdraw(self) -> None:
        """Leave the fleet for now (the engine stopped answering); the next renewal rejoins."""
        await self.bucket.delete(self.key)
        self._revision = None

    async def release(self) -> None:
        """Deregister on the way out, unless the key is another adapter's."""
        if self.taken is not None:
            return
        try:
            await self.bucket.delete(self.key)
        except Exception:
            log.warning("could not deregister %s", self.worker_id, exc_info=True)


def _registration(payload: bytes) -> WorkerRegistration | None:
    """Another adapter's registration; None when it does not decode (it then counts as stale:
    it never wins the id)."""
    try:
        return msgspec.json.decode(payload, type=WorkerRegistration)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None


def _id_in_use(worker_id: str, registration: bytes) -> str:
    other = _registration(registration)
    engine = other.engine_url if other is not None else "an engine it does not name"
    return (
        f"worker id {worker_id!r} is in use by a live adapter in front of {engine}: "
        "give this one another --worker-id"
    )
