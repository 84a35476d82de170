"""PrefixIndex against a naive reference model, over random event streams (hypothesis).

The model keeps ``worker -> set of block hashes`` and computes each worker's match as the
longest run of leading prompt blocks in its set; TTL as ``hash -> bucket of last confirmation``
checked one block at a time. Streams mix stores (from the root or continuing a prefix), removes,
clears, resyncs, worker removal and re-registration, sequence gaps and stale events, clock
advances with expiry, and snapshot/restore in the middle. Besides the answers, the index's
``closed`` sets (who holds a block's whole prefix, what the query's search relies on) are checked
never to claim a block of the prefix the worker does not hold.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from thunderagent.hashing import BlockHasher, BlockHashes
from thunderagent.prefix_index import (
    APPLIED,
    Gap,
    PrefixIndex,
    Stale,
    decode,
    encode,
    ttl,
    worker_log,
)
from thunderagent.prefix_index import index as index_module

TTL_S = 10.0
BUCKETS = 4
WIDTH = TTL_S / BUCKETS
WORKERS = ["w0", "w1", "w2", "w3"]
HASHER = BlockHasher(block_size=1)

# Prompts are paths over a tiny alphabet, so they share prefixes all the time.
paths = st.lists(st.integers(0, 2), min_size=1, max_size=6).map(tuple)


def hashes(path: tuple[int, ...]) -> BlockHashes:
    return HASHER.hash_block_ids(path)


@dataclass
class Model:
    blocks: dict[str, set[int]] = field(default_factory=dict)
    seqs: dict[str, int | None] = field(default_factory=dict)
    touched: dict[int, int] = field(default_factory=dict)
    orphans: int = 0

    def sequence(self, worker: str, seq: int) -> object:
        self.blocks.setdefault(worker, set())
        last = self.seqs.setdefault(worker, None)
        if last is None or seq == last + 1:
            self.seqs[worker] = seq
            return APPLIED
        if seq <= last:
            return Stale(worker, last, seq)
        self.seqs[worker] = seq
        return Gap(worker, last + 1, seq)

    def forget_unheld(self) -> None:
        held = set().union(*self.blocks.values()) if self.blocks else set()
        self.touched = {h: b for h, b in self.touched.items() if h in held}

    def overlap(self, primary: list[int]) -> dict[str, int]:
        out = {}
        for worker, held in self.blocks.items():
            depth = 0
            while depth < len(primary) and primary[depth] in held:
                depth += 1
            if depth:
                out[worker] = depth
        return out


class IndexMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.ix = PrefixIndex(ttl_s=TTL_S, ttl_buckets=BUCKETS)
        self.model = Model()
        self.now = 0.0
        self.stored: list[tuple[int, ...]] = []
        self.paths: dict[int, tuple[int, ...]] = {}  # block hash -> the prefix it names

    def _learn(self, path: tuple[int, ...]) -> BlockHashes:
        h = hashes(path)
        for k, p in enumerate(h.primary):
            self.paths[p] = path[: k + 1]
        return h

    def _seq(self, worker: str, kind: int) -> int:
        last = self.model.seqs.get(worker)
        base = -1 if last is None else last
        return {0: base + 1, 1: base + 3, 2: max(base, 0)}[kind]

    @rule(
        worker=st.sampled_from(WORKERS),
        path=paths,
        start=st.integers(0, 5),
        kind=st.sampled_from([0, 0, 0, 0, 1, 2]),
    )
    def store(self, worker: str, path: tuple, start: int, kind: int) -> None:
        start = min(start, len(path) - 1)
        h = self._learn(path)
        parent = h.primary[start - 1] if start else None
        part = BlockHashes(h.primary[start:], h.check[start:])
        seq = self._seq(worker, kind)
        expected = self.model.sequence(worker, seq)
        assert self.ix.apply_stored(worker, seq, part, parent, self.now) == expected
        self.stored.append(path)
        if expected.__class__ is not Stale:
            held = self.model.blocks[worker]
            if parent is not None and parent not in held:
                self.model.orphans += 1
            held.update(part.primary)
            for p in part.primary:
                self.model.touched[p] = int(self.now // WIDTH)

    @precondition(lambda self: self.stored)
    @rule(worker=st.sampled_from(WORKERS), pick=st.integers(0, 7), dt=st.sampled_from([1.0, 2.5]))
    def reconfirm_later(self, worker: str, pick: int, dt: float) -> None:
        """Store an already stored prompt again a bucket or so later (TTL re-confirmation)."""
        self.now += dt
        self.store(worker, self.stored[-1 - pick % len(self.stored)], 0, 0)

    @rule(worker=st.sampled_from(WORKERS), path=paths, kind=st.sampled_from([0, 0, 1, 2]))
    def remove(self, worker: str, path: tuple, kind: int) -> None:
        primary = hashes(path).primary[-2:]
        seq = self._seq(worker, kind)
        expected = self.model.sequence(worker, seq)
        assert self.ix.apply_removed(worker, seq, primary, self.now) == expected
        if expected.__class__ is not Stale:
            self.model.blocks[worker].difference_update(primary)
            self.model.forget_unheld()

    @rule(worker=st.sampled_from(WORKERS), kind=st.sampled_from([0, 1, 2]))
    def clear(self, worker: str, kind: int) -> None:
        seq = self._seq(worker, kind)
        expected = self.model.sequence(worker, seq)
        assert self.ix.clear_worker(worker, seq, self.now) == expected
        if expected.__class__ is not Stale:
            self.model.blocks[worker] = set()
            self.model.forget_unheld()

    @rule(worker=st.sampled_from(WORKERS), seq=st.integers(0, 50))
    def reset(self, worker: str, seq: int) -> None:
        self.ix.reset_worker(worker, seq)
        self.model.blocks[worker] = set()
        self.model.seqs[worker] = seq
        self.model.forget_unheld()

    @rule(worker=st.sampled_from(WORKERS))
    def remove_worker(self, worker: str) -> None:
        assert self.ix.remove_worker(worker) == (worker in self.model.blocks)
        self.model.blocks.pop(worker, None)
        self.model.seqs.pop(worker, None)
        self.model.forget_unheld()

    @rule(dt=st.sampled_from([0.0, 0.5, 1.0, 2.5, 4.0, 7.5, 12.5]))
    def advance_and_expire(self, dt: float) -> None:
        self.now += dt
        gone = {h for h, b in self.model.touched.items() if (b + 1) * WIDTH + TTL_S <= self.now}
        assert self.ix.expire(self.now) == len(gone)
        for held in self.model.blocks.values():
            held -= gone
        self.model.forget_unheld()

    @precondition(lambda self: self.model.blocks)
    @rule()
    def snapshot_and_restore(self) -> None:
        fresh = PrefixIndex(ttl_s=TTL_S, ttl_buckets=BUCKETS)
        fresh.restore(decode(encode(self.ix.snapshot())), self.now)
        fresh.stats = self.ix.stats
        self.ix = fresh

    @rule(path=paths, extra=st.lists(st.integers(0, 2), max_size=2))
    def query(self, path: tuple, extra: list[int]) -> None:
        h = hashes(path + tuple(extra))
        assert self.ix.overlap(h.primary, h.check) == self.model.overlap(h.primary)

    @invariant()
    def closed_never_overstates(self) -> None:
        for p, e in self.ix._entries.items():
            held, closed = e.held, e.closed
            assert closed & ~held == 0
            if not closed:
                continue
            prefix = set(hashes(self.paths[p]).primary)
            for w in self.ix._workers.values():
                if closed & w.bit:
                    assert prefix <= self.model.blocks[w.name], (w.name, self.paths[p])

    @invariant()
    def counts_and_dumps_agree(self) -> None:
        expected = {w: len(s) for w, s in self.model.blocks.items()}
        assert self.ix.block_counts() == expected
        for worker, held in self.model.blocks.items():
            dump = self.ix.dump_worker(worker)
            assert set(dump.primary) == held and len(dump.primary) == len(held)
        assert len(self.ix) == len(self.model.touched)
        assert self.ix.stats.orphan_stores == self.model.orphans
        assert self.ix.stats.query_collisions == 0 and self.ix.stats.store_collisions == 0

    @invariant()
    def every_held_block_is_logged(self) -> None:
        for w in self.ix._workers.values():
            assert self.model.blocks[w.name] <= set(w.logged())


IndexMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=50, deadline=None)
TestIndexAgainstModel = IndexMachine.TestCase


EAGER_SWEEPS = {
    (index_module, "_LOG_GROWTH"): 0,
    (index_module, "_LOG_SLACK"): 0,
    (worker_log, "SWEEP_MIN_ITEMS"): 1,
    (worker_log, "SWEEP_ITEMS_PER_BLOCK"): 1,
}


class SweepingIndexMachine(IndexMachine):
    """The same streams with a worker's log compacted whenever it holds anything, one item per
    stored block: a compaction is under way at 14-33 % of the steps (five counts; through
    stores, removals, expiry, dumps, snapshots and a worker's removal in the middle of one)."""

    def __init__(self) -> None:
        super().__init__()
        self._saved = {where: getattr(*where) for where in EAGER_SWEEPS}
        for (module, name), value in EAGER_SWEEPS.items():
            setattr(module, name, value)

    def teardown(self) -> None:
        for (module, name), value in self._saved.items():
            setattr(module, name, value)


SweepingIndexMachine.TestCase.settings = IndexMachine.TestCase.settings
TestSweepingIndexAgainstModel = SweepingIndexMachine.TestCase


def test_the_eager_settings_reach_the_index() -> None:
    """The sweeping machine's settings take hold where the index reads them: a worker's first
    store starts a compaction (were they bound elsewhere, no sweep would ever run and the
    machine above would test nothing more than the plain one)."""
    machine = SweepingIndexMachine()
    try:
        machine.ix.apply_stored("w0", 0, hashes((0, 1)), None, 0.0)
        assert machine.ix._workers["w0"].sweep is not None
    finally:
        machine.teardown()


class SteppingIndexMachine(IndexMachine):
    """The same streams with expiry read one due item per call (``EXPIRE_STEP`` = 1, doubled
    per bucket of lag): each clock advance calls ``expire`` until the model's due blocks are
    gone, so stores, removals, queries, dumps and snapshots meet an expiry part way through a
    list. Never early: the invariants compare every worker's blocks with the model's."""

    def __init__(self) -> None:
        super().__init__()
        self._saved_step = ttl.EXPIRE_STEP
        ttl.EXPIRE_STEP = 1

    def teardown(self) -> None:
        ttl.EXPIRE_STEP = self._saved_step

    @rule(dt=st.sampled_from([0.0, 0.5, 1.0, 2.5, 4.0, 7.5, 12.5]), calls=st.integers(1, 3))
    def advance_and_expire(self, dt: float, calls: int) -> None:
        self.now += dt
        gone = {h for h, b in self.model.touched.items() if (b + 1) * WIDTH + TTL_S <= self.now}
        dropped = sum(self.ix.expire(self.now) for _ in range(calls))  # part of it, perhaps
        for _ in range(10_000):
            if dropped >= len(gone):
                break
            dropped += self.ix.expire(self.now)
        assert dropped == len(gone)
        for held in self.model.blocks.values():
            held -= gone
        self.model.forget_unheld()


SteppingIndexMachine.TestCase.settings = IndexMachine.TestCase.settings
TestSteppingIndexAgainstModel = SteppingIndexMachine.TestCase
