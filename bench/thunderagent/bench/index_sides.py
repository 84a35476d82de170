"""The two sides of ``bench index``: our ``PrefixIndex`` and Dynamo 1.6.1's ``RadixTree``, each
behind the same calls (``ingest``, ``query``, ``answer``, ``handoff``), and the timers both use.
What each call includes, and why it is fair, is in ``index.py``'s docstring."""

from __future__ import annotations

import gc
import json
import os
import time
from collections.abc import Callable

import msgspec

from thunderagent.bench.index_workload import (
    EVENT_DT_S,
    WORKERS,
    Workload,
    dynamo_payloads,
    our_payloads,
)
from thunderagent.prefix_index import PrefixIndex
from thunderagent.schemas import KvEventBatch

EXPIRE_EVERY = 1_000
NAMES = [f"worker-{i}" for i in range(WORKERS)]


def pct(values: list[int], q: float) -> float:
    """Percentile of ns samples, in µs."""
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))] / 1_000


def latency(call: Callable[[], object], n: int) -> dict:
    clock = time.perf_counter_ns
    ns = []
    for _ in range(n):
        t = clock()
        call()
        ns.append(clock() - t)
    return {"p50_us": pct(ns, 0.5), "p99_us": pct(ns, 0.99)}


def start_clocks() -> tuple[float, float]:
    return time.perf_counter(), time.process_time()


def stop_clocks(t: tuple[float, float]) -> tuple[float, float]:
    """Wall and CPU seconds since ``start_clocks``. CPU time is the whole process's (Dynamo's
    background thread included): what the work cost, whatever else ran on the machine."""
    return time.perf_counter() - t[0], time.process_time() - t[1]


def set_affinity(cpus: set[int]) -> None:
    """Every thread of this process onto ``cpus`` (threads started later inherit it)."""
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except OSError:
            pass  # a thread that just exited


# ----------------------------------------------------------------------------- the two sides


class Ours:
    name = "thunderagent"

    def __init__(self, w: Workload, bulk: list) -> None:
        self.args = [
            (NAMES[e[0]], e[1], (e[2], e[3]), e[4], i * EVENT_DT_S) for i, e in enumerate(w.events)
        ]
        self.blobs = our_payloads(w.events)
        self.bulk = [(NAMES[e[0]], e[1], (e[2], e[3]), None, 0.0) for e in bulk]
        self.index = PrefixIndex()

    def ingest(self, decoded: bool | str = False, bulk: bool = False) -> tuple[float, float]:
        """Wall and CPU seconds to apply every event to a fresh index (TTL on, expire every
        1,000 events): from the pre-built lists, or (``decoded``) decoding each event's
        ``KvEventBatch`` first, or (``decoded="only"``) decoding alone."""
        self.index = None  # type: ignore[assignment]  # free the last one before timing
        gc.collect()
        ix = self.index = PrefixIndex()
        apply, expire = ix.apply_stored, ix.expire
        if bulk:
            t = start_clocks()
            for args in self.bulk:
                apply(*args)
            return stop_clocks(t)
        if decoded == "only":  # the decode alone: what the decoded run spends outside the index
            decode = msgspec.msgpack.Decoder(KvEventBatch).decode
            t = start_clocks()
            for blob in self.blobs:
                decode(blob)
            return stop_clocks(t)
        if decoded:
            decode = msgspec.msgpack.Decoder(KvEventBatch).decode
            t = start_clocks()
            for i, blob in enumerate(self.blobs):
                b = decode(blob)
                ev = b.events[0]
                apply(b.worker_id, b.seq, (ev.hashes, ev.check_hashes), ev.parent_hash, b.ts)
                if i % EXPIRE_EVERY == 0:
                    expire(b.ts)
            return stop_clocks(t)
        t = start_clocks()
        for i, args in enumerate(self.args):
            apply(*args)
            if i % EXPIRE_EVERY == 0:
                expire(args[4])
        return stop_clocks(t)

    def query(self, q: tuple) -> dict[int, int]:
        return self.index.overlap(q[0], q[1])

    def answer(self, q: tuple) -> dict[int, int]:
        return {int(k.rsplit("-", 1)[1]): v for k, v in self.query(q).items()}

    def handoff(self, calls: int) -> dict:
        ix = PrefixIndex()
        events = iter([("w", seq, ([7], [7]), None, 0.0) for seq in range(calls)])
        apply = ix.apply_stored
        return {
            "trivial_call": latency(lambda: ix.overlap((), None), calls),
            "event_1_block": latency(lambda: apply(*next(events)), calls),
        }


class Dynamo:
    name = "dynamo"

    def __init__(self, w: Workload, bulk: list) -> None:
        from dynamo.llm import RadixTree  # type: ignore[import-not-found]

        self.cls = RadixTree
        self.payloads = dynamo_payloads(w.events)
        self.bulk = dynamo_payloads(bulk)
        self.tree = RadixTree()

    def ingest(self, decoded: bool = False, bulk: bool = False) -> tuple[float, float]:
        self.tree = None
        gc.collect()
        tree = self.tree = self.cls()
        apply = tree.apply_event
        t = start_clocks()
        for wid, data in self.bulk if bulk else self.payloads:
            apply(wid, data)
        return stop_clocks(t)

    def query(self, q: tuple) -> dict:
        return self.tree.find_matches(q[2]).scores

    def answer(self, q: tuple) -> dict[int, int]:
        return {wid: depth for (wid, _dp), depth in self.query(q).items() if depth}

    def handoff(self, calls: int) -> dict:
        """Per-call cost through the binding: a trivial call, and a 1-block event (bytes
        encoded beforehand, as ours gets its lists)."""
        tree = self.cls()
        blocks = [{"block_hash": 7, "tokens_hash": 7}]
        events = iter(
            [
                json.dumps(
                    {"event_id": seq, "dp_rank": 0, "data": {"stored": {"blocks": blocks}}}
                ).encode()
                for seq in range(calls)
            ]
        )
        apply = tree.apply_event
        return {
            "trivial_call": latency(lambda: tree.find_matches([]), calls),
            "event_1_block": latency(lambda: apply(0, next(events)), calls),
        }
