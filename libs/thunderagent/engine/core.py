"""Engine core: SGLang-style continuous batching over a paged prefix cache, driven by a clock
it never reads.

One ``step(now)`` is one engine iteration, planned as SGLang's scheduler does by default:

* a prefill batch whenever there is prompt work and room (the partially prefilled "chunked"
  request first, then waiting requests FCFS), at most ``chunked_prefill_size`` new tokens, so a
  long prompt prefills over several steps and at most one request is ever part-way through;
* otherwise a decode batch: one token for every running request.

Cache behaviour follows SGLang's radix cache: a request's prefix hit is pinned at admission;
the full blocks of every prefill chunk are inserted (and pinned) when the chunk ends, so other
requests can hit them at once; on finish the full blocks of prompt + output are inserted and
everything is unpinned. Output blocks have no caller key: their key is derived by chaining
``xxh3_64(f"{parent_key}/{request_id}/{block_index}")``, so they are reusable only by a retried
run of the same request. When a decode step finds no free block, the request with the fewest
generated tokens (longest prompt on ties) is retracted: its blocks are released (what it
inserted stays cached), and it re-queues at the front keeping its generated tokens, which are
re-prefilled with the prompt later.

``step(now, until=t)`` may fuse several decode iterations into one outcome: a decode batch's
composition only changes at arrivals, prefill-chunk ends and finishes, so the run stops at the
first finish or at the first step boundary at or after ``until`` (the next arrival).
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

import xxhash

from thunderagent.engine.events import CacheEvent
from thunderagent.engine.prefix_cache import PrefixCache
from thunderagent.engine.profiles import Profile
from thunderagent.engine.timing import TimingModel


@dataclass(slots=True)
class Request:
    """What the engine is asked to run. ``block_hashes``: one chained key per full prompt block,
    optionally followed by keys of output blocks (with ``token_ids`` holding prompt + output)."""

    request_id: str
    prompt_len: int
    block_hashes: list[int] = field(default_factory=list)
    max_new_tokens: int = 16
    token_ids: list[int] | None = None


@dataclass(slots=True)
class FinishedRequest:
    """Usage of a request that left the engine (SGLang's meta_info fields)."""

    request_id: str
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    preemptions: int = 0
    finish_reason: str = "length"
    """"length" (max_new_tokens reached), "abort", or "rejected" (cannot fit the KV pool)."""


@dataclass(slots=True)
class StepOutcome:
    """What one ``step`` did; the shell sleeps ``duration`` and then delivers it."""

    duration: float = 0.0
    kind: str = "idle"
    """"idle", "prefill" or "decode"."""
    decode_steps: int = 0
    tokens: dict[str, int] = field(default_factory=dict)
    """Tokens emitted per request id in this outcome."""
    first_token: list[str] = field(default_factory=list)
    finished: list[FinishedRequest] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    events: list[CacheEvent] = field(default_factory=list)
    prefill_tokens: int = 0
    host_loaded_blocks: int = 0


@dataclass(slots=True, frozen=True)
class EngineLoad:
    """Routing view, like SGLang's /get_load plus cache occupancy."""

    num_running: int
    num_waiting: int
    kv_used_blocks: int
    kv_total_blocks: int
    num_tokens: int
    """KV in use, in tokens: blocks running requests pin (a prefix they share counted once)
    and their private blocks, as SGLang's ``/get_load`` reports it (pool minus free and
    evictable)."""
    cached_blocks: int
    host_cached_blocks: int
    prefill_backlog_tokens: int = 0
    """Prompt tokens still to prefill: the chunked request's rest plus every waiting prompt
    (their cache hits are not known before admission, so this is an upper bound)."""


@dataclass(slots=True, eq=False)
class _Seq:
    req: Request
    arrival: float
    keys: list[int]
    target: int
    """Tokens to prefill: prompt, plus generated tokens after a retraction."""
    held: int = 0
    """Leading blocks pinned in the cache."""
    private: int = 0
    """Blocks reserved in the pool and not (yet) in the cache."""
    computed: int = 0
    """Tokens whose KV exists."""
    generated: int = 0
    cached_tokens: int = -1
    preemptions: int = 0


def derived_key(parent: int | None, request_id: str, index: int) -> int:
    """Key of a block the caller gave no key for (output blocks), chained on its parent."""
    return xxhash.xxh3_64_intdigest(f"{parent}/{request_id}/{index}".encode())


class EngineCore:
    """One simulated engine instance: queues, KV pool, prefix cache, timing."""

    def __init__(self, profile: Profile) -> None:
        self.profile = profile
        self.block_size = profile.engine.block_size
        self.timing = TimingModel(profile)
        self.cache = PrefixCache(profile.capacity_blocks, profile.engine.host_blocks)
        self._waiting: collections.deque[_Seq] = collections.deque()
        self._prefilling: list[_Seq] = []
        self._running: dict[str, _Seq] = {}
        self._seqs: dict[str, _Seq] = {}
        self.total_preemptions = 0
        self.imports_pending = 0
        """KV imports begun and not committed or aborted (their blocks are reserved)."""

    # ---- public API ----------------------------------------------------------------------
    def add(self, request: Request, now: float) -> FinishedRequest | None:
        """Queue a request; returns a "rejected" record instead if it can never fit."""
        if request.request_id in self._seqs:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        total = request.prompt_len + request.max_new_tokens
        if request.prompt_len <= 0 or request.max_new_tokens <= 0:
            raise ValueError(f"request {request.request_id!r}: empty prompt or output")
        if total > self.cache.capacity * self.block_size:
            return FinishedRequest(request.request_id, request.prompt_len, 0, 0, 0, "rejected")
        # Keys past the prompt name output blocks, when the caller knows its output (the HTTP
        # shell's deterministic output); otherwise output block keys are derived.
        keys = list(request.block_hashes[: total // self.block_size])
        seq = _Seq(req=request, arrival=now, keys=keys, target=request.prompt_len)
        self._seqs[request.request_id] = seq
        self._waiting.append(seq)
        return None

    def abort(
        self, request_id: str, now: float, *, keep_cache: bool = False
    ) -> FinishedRequest | None:
        """Drop a request wherever it is and free its blocks.

        ``keep_cache=False`` (a client abort): nothing more is inserted. ``keep_cache=True`` (a
        scheduler preemption): the full blocks of everything computed so far, prompt and output,
        are inserted first, as a finished request's are, so a continuation of the same request
        id (prompt + generated tokens) finds them cached; they stay evictable like any cache.
        """
        seq = self._seqs.pop(request_id, None)
        if seq is None:
            return None
        if seq in self._waiting:
            self._waiting.remove(seq)
        elif seq in self._prefilling:
            self._prefilling.remove(seq)
        else:
            self._running.pop(request_id, None)
        if keep_cache and seq.computed:
            self._insert_full_blocks(seq)
        self._free(seq)
        return self._record(seq, "abort")

    def import_blocks(self, block_hashes: list[int], token_ids: list[int] | None = None) -> int:
        """KV blocks that arrived from another engine (PD disaggregation: the prefill worker's
        blocks of a prompt, chained from the root) become cached here, unpinned, evicting LRU
        leaves for room; Stored events come out of the next ``step``. Returns blocks now cached
        (a prefix of ``block_hashes``; the rest did not fit)."""
        n = self.cache.insert(list(block_hashes), None, token_ids, block_size=self.block_size)
        self.cache.release(list(block_hashes[:n]))
        return n

    # ---- prefix moves (migration) ------------------------------------------------------
    def pin_prefix(
        self, keys: list[int], *, need_tokens: bool = True
    ) -> tuple[list[int], list[int]]:
        """Export: pin the leading GPU-cached run of ``keys`` so it stays while it is copied.
        Returns (pinned keys, their token ids); nothing is pinned when the tokens are unknown,
        unless ``need_tokens=False`` (the replay, whose blocks carry no token ids: tokens [])."""
        run = list(keys[: self.cache.match(list(keys)).gpu])
        tokens = self.cache.tokens_of(run)
        if tokens is None and not need_tokens:
            tokens = []
        if not run or tokens is None:
            return [], []
        self.cache.acquire(run)
        return run, tokens

    def unpin_prefix(self, keys: list[int], *, drop: bool = False) -> int:
        """End an export; ``drop=True`` (a migration) frees the blocks nobody else uses.
        Returns blocks freed; their Removed events come out with the next events drained."""
        self.cache.release(list(keys))
        return self.cache.discard(list(keys)) if drop else 0

    def begin_import(self, keys: list[int], *, keep_blocks: int = 0) -> int | None:
        """Import: pin the part of the chain already cached here and reserve a block for each
        missing one. Returns the number already cached, or None when there is no room.
        ``keep_blocks``: also refuse unless this many blocks stay free or evictable afterwards
        (SGLang's decode engine keeps room for the requests it holds to grow)."""
        present = self.cache.match(list(keys)).gpu
        self.cache.acquire(list(keys[:present]))
        missing = len(keys) - present
        cache = self.cache
        short = cache.capacity - cache.pinned - cache.reserved - missing < keep_blocks
        if short or (missing and not cache.reserve(missing)):
            cache.release(list(keys[:present]))
            return None
        self.imports_pending += 1
        return present

    def reserve_for_decode(self, keys: list[int], reserved_decode_tokens: int) -> int | None:
        """SGLang's PD, the decode engine's prealloc queue: ``begin_import`` of a prompt whose
        KV a prefill engine will send, made only while ``reserved_decode_tokens`` per request
        held here (waiting, running, or an import not landed) stay allocatable for their decode
        (SGLang 0.5.23, ``DecodePreallocQueue._allocatable_tokens``)."""
        held = len(self._waiting) + len(self._prefilling) + len(self._running)
        keep = -(-reserved_decode_tokens * (held + self.imports_pending) // self.block_size)
        return self.begin_import(keys, keep_blocks=keep)

    def commit_import(self, keys: list[int], present: int, token_ids: list[int] | None) -> int:
        """The missing blocks arrived: insert them (into the reserved blocks) and unpin the
        chain, so it is ordinary cache from now on. Returns blocks inserted. ``token_ids``
        None: blocks without token ids (the replay)."""
        size = self.block_size
        rest = list(keys[present:])
        parent = keys[present - 1] if present else None
        tokens = None if token_ids is None else token_ids[present * size : len(keys) * size]
        self.cache.insert(rest, parent, tokens, reserved=True, block_size=size)
        self.cache.release(list(keys))
        self.imports_pending -= 1
        return len(rest)

    def abort_import(self, keys: list[int], present: int) -> None:
        """The transfer failed: give back the reservation and unpin; nothing was inserted."""
        self.cache.unreserve(len(keys) - present)
        self.cache.release(list(keys[:present]))
        self.imports_pending -= 1

    def flush(self, now: float) -> bool:
        """Clear the prefix cache (SGLang's /flush_cache): refused while requests hold KV."""
        return self.cache.clear()

    def drain_events(self) -> list[CacheEvent]:
        """Events produced outside ``step`` (flush); ``step`` returns its own."""
        return self.cache.drain_events()

    def cached_tokens(self, request_id: str) -> int:
        """Prompt tokens a queued or running request found cached when it was admitted (0
        before), as SGLang reports them with each of its streamed outputs."""
        seq = self._seqs.get(request_id)
        return max(seq.cached_tokens, 0) if seq is not None else 0

    @property
    def has_work(self) -> bool:
        return bool(self._waiting or self._prefilling or self._running)

    def load(self) -> EngineLoad:
        seqs = [*self._prefilling, *self._running.values()]
        return EngineLoad(
            num_running=len(seqs),
            num_waiting=len(self._waiting),
            kv_used_blocks=self.cache.gpu_blocks + self.cache.reserved,
            kv_total_blocks=self.cache.capacity,
            num_tokens=(self.cache.pinned + self.cache.reserved) * self.block_size,
            cached_blocks=self.cache.gpu_blocks,
            host_cached_blocks=self.cache.host_blocks,
            prefill_backlog_tokens=sum(s.target - s.computed for s in self._prefilling)
            + sum(s.target for s in self._waiting),
        )

    def step(self, now: float, until: float | None = None) -> StepOutcome:
        """Plan and account one engine iteration starting at ``now``.

        ``until`` (virtual time only): allow fusing decode iterations up to the first step
        boundary at or after ``until``. State is updated at once; the shell delivers the
        outcome ``duration`` seconds later.
        """
        out = StepOutcome()
        if not self._prefill(out):
            self._decode(now, until, out)
            if not out.decode_steps and self.has_work:
                self._prefill(out)  # every decode request was retracted: prefill instead
        out.events = self.cache.drain_events()
        return out

    # ---- prefill -------------------------------------------------------------------------
    def _prefill(self, out: StepOutcome) -> bool:
        """Build and account one prefill batch; False when there is nothing to prefill."""
        budget = self.profile.engine.chunked_prefill_size
        cap = self.profile.engine.max_running_requests
        chunks: list[tuple[_Seq, int, int]] = []
        for seq in self._prefilling:
            n = self._chunk(seq, budget)
            if n == 0:
                budget = 0  # the chunked request is stuck on memory: admit nobody past it
                break
            chunks.append((seq, n, seq.computed))
            budget -= n
        while budget > 0 and self._waiting and len(self._prefilling) + len(self._running) < cap:
            seq = self._waiting[0]
            out.host_loaded_blocks += self._admit(seq)
            n = self._chunk(seq, budget)
            if n == 0:
                self._free(seq)
                break
            self._waiting.popleft()
            self._prefilling.append(seq)
            if seq.cached_tokens < 0:
                seq.cached_tokens = seq.computed
            chunks.append((seq, n, seq.computed))
            budget -= n
        if not chunks:
            return False
        out.kind = "prefill"
        out.duration = self.timing.prefill_time(
            [(n, c) for _, n, c in chunks], out.host_loaded_blocks
        )
        for seq, n, _ in chunks:
            out.prefill_tokens += n
            self._end_chunk(seq, n, out)
        return True

    def _admit(self, seq: _Seq) -> int:
        """Pin the cached prefix (loading host-tier blocks); returns blocks loaded."""
        usable = self._keys(seq, (seq.target - 1) // self.block_size)
        match = self.cache.match(usable)
        self.cache.acquire(usable[: match.gpu])
        loaded = 0
        if match.host:
            loaded = self.cache.load(usable[match.gpu : match.gpu + match.host])
        seq.held = match.gpu + loaded
        seq.computed = seq.held * self.block_size
        return loaded

    def _chunk(self, seq: _Seq, budget: int) -> int:
        """Tokens of ``seq`` to prefill now within ``budget``, with their blocks reserved."""
        n = min(budget, seq.target - seq.computed)
        if n <= 0:
            return 0
        need = -(-(seq.computed + n) // self.block_size) - seq.held - seq.private
        if need > 0 and not self.cache.reserve(need):
            return 0
        seq.private += max(need, 0)
        return n

    def _end_chunk(self, seq: _Seq, n: int, out: StepOutcome) -> None:
        seq.computed += n
        self._insert_full_blocks(seq)
        if seq.computed < seq.target:
            return
        self._prefilling.remove(seq)
        if seq.generated == 0:
            out.first_token.append(seq.req.request_id)
        self._emit(seq, 1, out)
        if seq.req.request_id in self._seqs:
            self._running[seq.req.request_id] = seq

    # ---- decode --------------------------------------------------------------------------
    def _decode_context(self, seqs: list[_Seq]) -> int:
        """KV tokens a decode step reads: every request's context, or with cascade attention
        (``shared_kv_once``) each page in use once (pinned shared pages and private ones)."""
        total = sum(s.computed for s in seqs)
        if not self.profile.eff.shared_kv_once:
            return total
        return min(total, (self.cache.pinned + self.cache.reserved) * self.block_size)

    def _decode(self, now: float, until: float | None, out: StepOutcome) -> None:
        while self._running:
            seqs = list(self._running.values())
            batch = len(seqs)
            context = self._decode_context(seqs) + batch
            k = 1
            if until is not None and until > now:
                to_finish = min(s.req.max_new_tokens - s.generated for s in seqs)
                k = self.timing.decode_steps_until(batch, context, until - now, to_finish)
            ok = self._grow(seqs, k)
            if not ok and k > 1:
                k = 1
                ok = self._grow(seqs, 1)
            if ok:
                break
            self._retract(min(seqs, key=lambda s: (s.generated, -s.req.prompt_len)), out)
        else:
            return
        out.kind, out.decode_steps = "decode", k
        out.duration = self.timing.decode_run_time(batch, context, k)
        for seq in seqs:
            seq.computed += k
            self._emit(seq, k, out)

    def _grow(self, seqs: list[_Seq], k: int) -> bool:
        """Reserve the blocks ``k`` more decode tokens need, all or nothing."""
        block = self.block_size
        needs = [-(-(s.computed + k) // block) - s.held - s.private for s in seqs]
        total = sum(n for n in needs if n > 0)
        if total and not self.cache.reserve(total):
            return False
        for seq, n in zip(seqs, needs, strict=True):
            if n > 0:
                seq.private += n
        return True

    def _retract(self, seq: _Seq, out: StepOutcome) -> None:
        del self._running[seq.req.request_id]
        self._free(seq)
        seq.target = seq.req.prompt_len + seq.generated
        seq.preemptions += 1
        self.total_preemptions += 1
        self._waiting.appendleft(seq)
        out.preempted.append(seq.req.request_id)

    # ---- shared --------------------------------------------------------------------------
    def _emit(self, seq: _Seq, k: int, out: StepOutcome) -> None:
        """Count ``k`` new tokens; finish the request when it reaches max_new_tokens."""
        rid = seq.req.request_id
        seq.generated += k
        out.tokens[rid] = out.tokens.get(rid, 0) + k
        if seq.generated < seq.req.max_new_tokens:
            return
        self._running.pop(rid, None)
        self._insert_full_blocks(seq)
        self._free(seq)
        del self._seqs[rid]
        out.finished.append(self._record(seq, "length"))

    def _insert_full_blocks(self, seq: _Seq) -> None:
        """Move the request's full private blocks into the cache (SGLang's cache_*_req)."""
        full = seq.computed // self.block_size
        if full <= seq.held:
            return
        keys = self._keys(seq, full)[seq.held : full]
        parent = seq.keys[seq.held - 1] if seq.held else None
        tokens = None
        token_ids = seq.req.token_ids
        if token_ids is not None and full * self.block_size <= len(token_ids):
            tokens = token_ids[seq.held * self.block_size : full * self.block_size]
        self.cache.insert(keys, parent, tokens, reserved=True, block_size=self.block_size)
        seq.private -= len(keys)
        seq.held = full

    def _keys(self, seq: _Seq, n: int) -> list[int]:
        """The first ``n`` block keys of ``seq``, deriving keys the caller did not give."""
        keys = seq.keys
        rid = seq.req.request_id
        while len(keys) < n:
            keys.append(derived_key(keys[-1] if keys else None, rid, len(keys)))
        return keys[:n]

    def _free(self, seq: _Seq) -> None:
        if seq.held:
            self.cache.release(seq.keys[: seq.held])
        if seq.private:
            self.cache.unreserve(seq.private)
        seq.held = seq.private = seq.computed = 0

    def _record(self, seq: _Seq, reason: str) -> FinishedRequest:
        return FinishedRequest(
            request_id=seq.req.request_id,
            prompt_tokens=seq.req.prompt_len,
            cached_tokens=max(seq.cached_tokens, 0),
            completion_tokens=seq.generated,
            preemptions=seq.preemptions,
            finish_reason=reason,
        )


__all__ = [
    "EngineCore",
    "EngineLoad",
    "FinishedRequest",
    "Request",
    "StepOutcome",
    "derived_key",
]
