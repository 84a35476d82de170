"""Knobs of the composed scheduler, with their defaults and the reasoning behind them.

Every knob is optional; ``SchedParams.validate`` rejects a bad value with a ``ParamError``
naming the field, the value and the reason.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

from thunderagent.prefill_model import LLAMA_8B_ATTENTION_PARITY_TOKENS

ORDERS = ("fcfs", "priority", "srpt", "priority_srpt")
WINDOWS = ("none", "fixed", "adaptive")
PD_MODES = ("colocated", "disaggregated")


class ParamError(ValueError):
    """A scheduler knob with a bad value."""

    def __init__(self, field: str, value: object, reason: str) -> None:
        super().__init__(f"scheduler param {field}={value!r}: {reason}")
        self.field = field
        self.value = value
        self.reason = reason


@dataclass(slots=True, kw_only=True)
class SchedParams:
    # --- admission (item 1)
    max_running: int = 0
    """Running-request cap per worker; 0: the worker's reported ``max_running``."""
    fallback_max_running: int = 64
    """Cap when neither the knob nor the worker names one (SGLang's default is larger, but
    keeping requests here instead of in engine queues is the point)."""
    kv_watermark: float = 1.0
    """Admit while the KV running requests will hold (their expected output included) stays
    under this fraction of the pool. The expected output is already the margin for decode
    growth, so none more is kept by default: on the generated workloads (thunder routing,
    virtual time) 0.9 against 1.0 gave TTFT p99 1,687 / 798 ms, 3,966 / 850 ms and
    12,797 / 7,033 ms on the hot-spot trace at 8x / 10x / 12x, and 3,860 / 3,316 ms and
    11,251 / 9,210 ms on the bursty trace at 10x / 12x; below those loads they are identical."""
    cold_prefill_queue_tokens: int = 32768
    """A request with nothing of its prompt cached on a worker is not sent there while the
    prompts sent there and not started yet (no first token) hold this many uncached tokens: it
    waits here instead (0: no bound). SGLang's engine serves its waiting requests first come,
    first served; waiting here, they go in this queue's order (priority + SRPT), so in a burst
    the short prompts pass the long ones, and a request that spills may go to whichever worker
    starts its queue first. A request with a prefix cached on the worker is never held by it
    (its hit is what it waits for). 32,768 tokens is four of SGLang's default 8,192-token
    prefill chunks, about a second of prefill for the 8B model on an H100: the engine's queue
    does not run dry between first tokens. Chosen on generated bursty traffic without shared
    prefixes (``bench gen --kind bursty`` with no system prompt, one request per document,
    1,500-token documents; thunder as deployed, seeds 0-2, TTFT p99 summed over 1-12x, s):
    off 35.60, 8,192 33.61, 16,384 33.72, 24,576 33.98, 32,768 33.63, 65,536 34.52; capacity
    at every bound 16 / 8 / 12x against 16 / 4 / 8x off (65,536: 20x on seed 0). Its order is
    what helps: with ``order`` fcfs the bound changes nothing there. Traffic with shared
    prefixes (the bursty, hot-spot and agent workloads) rarely has a cold request; holding
    requests with a hit as well (any bound) lost capacity there (bursty seed 0: 12x -> 6x)."""
    cold_shared_hits: bool = False
    """Under ``cold_prefill_queue_tokens``, a request whose hit on a worker is no more than
    every other candidate caches (a system prompt all hold) counts as cold there too. Off:
    one shared block exempts a request from the bound, and when a worker whose KV was full
    frees room, every request waiting for it goes at once, short prompts behind long ones in
    its engine's first-come queue (the conversation trace's first 600 requests, 4 workers,
    outputs capped at 16 tokens as ``bench live`` sends them: TTFT p99 off / on 22.8 / 16.2 s
    at 2x, 26.6 / 31.6 s at 2.3x). Off by default because the generated workloads disagree
    (thunder as deployed, capacity): bursty seed 0 12x -> 10x (a burst's first request, the
    one that prefills its document, waits), unique prompts under a system prompt seed 2
    8x -> 12x, long unique prompts seed 0 0.3x -> 0.5x and seed 1 0.3x -> 0.2x, hot spot and
    agent unchanged (docs/benchmarks.md, "Stop 65")."""
    spill_after_s: float = 0.5
    """A request whose first candidate gave it no room this long may go to the next one: long
    enough that a short decode frees a slot first, short against a re-prefill elsewhere."""
    spill_pays_for_hits: bool = True
    """A spilled request goes to a candidate caching less of its prompt than its best one only
    after it has also waited the time that candidate would spend prefilling the difference
    (``ordering.prefill_s``: at ``prefill_tokens_per_s``, attention included): wait for the
    cache or re-prefill, whichever the wait so far says costs less (the ski-rental rule: never
    worse than twice the better choice in hindsight).
    Off: every candidate opens at ``spill_after_s``, and a request holding a long hit gives it
    up after half a second. Against off (thunder as deployed, ``bench replay``): identical below
    every capacity on the generated workloads (bursty and hot spot seeds 0-2, agent 0-1); past
    it bursty seed 0 12x 4.33 -> 4.02 s, 14x 15.6 -> 11.3 s, hot spot seed 2 16x 5.82 ->
    4.40 s, agent seed 0 5x 9.50 -> 2.88 s (7.51 s at replay seed 2), worse at bursty seed 0 16x
    (18.6 -> 19.6 s) and hot spot seed 1 14x (1.06 -> 1.18 s). Judged on the traces:
    conversation 2.75x 7.49 -> 6.98 s, 3x 50.8 -> 41.7 s, synthetic 3x 51.1 -> 67.5 s (goodput
    6.35 -> 6.50 req/s), the rest identical."""
    spill_past_queues: bool = False
    """On: a spilled request takes room on a candidate caching less of its prompt than its best
    one even while requests homed on that candidate wait there (the rule before stop 73). Off:
    it takes such room only while nobody waits for that worker. A worker with a queue of its
    own is short of room too; the re-prefill would add to the work both queues wait behind,
    and where every worker queues (a cluster past its edge) each such spill made more load:
    evicted and recomputed contexts, longer queues, more spills. A spill still goes first to
    workers caching as much as its best, its home included, so it waits no longer there than
    before. Measured (thunder as deployed, ``bench replay``, jittered copies, stop 73): agent
    seed 0 at 5x over 24 copies TTFT p99 5.51 ± 2.14 -> 4.01 ± 1.29 s, paired -1.49 s (s.e.
    0.21), lower in 22 copies, the 6.01 s SLO met in 23 copies against 15; the generated edges
    (bursty and hot spot seeds 0-2, agent seed 1, 4 copies each) the same or lower within
    their spread (hot spot seed 2 16x 9.21 -> 7.80 s, bursty seed 2 18x 11.45 -> 10.45 s, hot
    spot seed 0 18x met in 3 copies against 2), none worse by more than 2.4 %. Judged on the
    traces: every run below capacity identical (conversation, synthetic, both Azure traces:
    the spill into a queue happens past the edge only); past it conversation 3x 39.8 ->
    38.8 s, synthetic 3x 44.1 -> 59.1 s (goodput 7.66 -> 7.15 req/s: where one worker's queue
    is far longer than another's, a spill into the shorter queue balanced them)."""
    # --- window (item 2)
    window: str = "adaptive"
    fixed_window_s: float = 0.1
    online_window_cap_s: float = 0.010
    """docs/features.md, point 5: online (priority 0) requests never wait more than 10 ms for a
    window."""
    batch_window_cap_s: float = 0.050
    window_gain_s: float = 0.001
    """Adaptive window length per unit of pressure (waiting requests + arrivals expected in the
    next 10 ms): 1 ms per request, so the window only grows where batching has material."""
    # --- ordering (item 3)
    order: str = "priority_srpt"
    class_step_s: float = 30.0
    """One priority class is worth this much waiting: a class-1 request overtakes fresh
    class-0 arrivals after ~30 s (aging), and class dominates work differences below
    ``class_step_s * work_tokens_per_s`` tokens."""
    work_tokens_per_s: float = 2000.0
    """Exchange rate between predicted work and waiting time: a request with 2,000 more tokens
    of work than another is passed over for at most 1 s (the starvation bound of SRPT)."""
    srpt_max_delay_s: float = math.inf
    """Cap on that bound: no request is passed over for more than this long for its size (a
    100k-token prompt otherwise waits up to ~50 s behind smaller ones). It matters only past
    capacity, where the queue holds work that long. Off by default: 2 s was chosen on the
    generated workloads past their capacity (TTFT p99 s, uncapped vs 2 s: bursty 12 / 14 / 16x
    8.0 / 19.1 / 22.0 vs 6.5 / 13.1 / 20.3; hot spot 14 / 16x 16.9 / 20.1 vs 14.7 / 16.8; agent
    5x 10.1 vs 7.9; identical below capacity), but the real traces rejected it: Mooncake
    conversation 2.75x 8.89 -> 10.10 s (over the SLO: capacity 2.75 -> 2.5x; 3x 45.1 -> 34.7
    s), synthetic 3x 48.9 -> 77.7 s; Azure code unchanged (docs/benchmarks.md)."""
    # --- grouping (item 2)
    grouping: bool = True
    group_min_blocks: int = 4
    """Hold a follower only when it shares at least this many uncached blocks with a leader
    (fewer: the wait costs more than the prefill it saves)."""
    group_timeout_s: float = 2.0
    """A follower waits at most this long for the leader's prefix (covers a lost KV event or a
    preempted leader; a 32k-token prefill takes about a second on one GPU)."""
    # --- preemption (item 4)
    preemption: bool = False
    preempt_gain_ratio: float = 2.0
    """Preempt only if the wait saved is at least this many times the cost."""
    preempt_max_per_s: float = 1.0
    """Per worker: preemptions churn KV and batches, so at most this many per second."""
    preempt_max_per_request: int = 2
    """A request is preempted at most this many times (no livelock)."""
    preempt_min_remaining_tokens: int = 256
    """Victims must have at least this much decode left (short ones free a slot soon anyway)."""
    prefill_tokens_per_s: float = 10000.0
    """The scheduler's prefill-rate estimate: the spill rule's wait, prefill backlogs, SRPT's
    service times, preemption gain. Half the router's and the migration planner's 20,000 on
    purpose: it is a knob checked on results, not the engine's rate. At 20,000 or 30,000 the
    generated agent workload (seed 0) loses its 5x capacity (docs/benchmarks.md, "The other
    defaults re-checked at 0.2 s reports")."""
    attention_parity_tokens: float = LLAMA_8B_ATTENTION_PARITY_TOKENS
    """Context length at which a prompt token's attention costs as much as its dense layers
    (``prefill_model``; the router's value): the spill rule's wait, service times and the
    preemption gain grow with the context before a prompt's tokens, as the engine's time
    does. 0: linear in tokens. ``program_yield_ratio`` compares tokens, not this work: with
    the prefill backlogs and the re-prefill counted in work the generated agent workloads'
    capacity cell (5x, 8 copies jittered by 0.5 ms) went 5.77 ± 2.22 -> 5.39 ± 2.23 s (seed 0)
    and 0.97 ± 0.28 -> 1.11 ± 0.33 s (seed 1), against 3.77 ± 1.26 and 0.96 ± 0.24 with tokens
    there, at 4x equal or noisier."""
    decode_tokens_per_s: float = 40.0
    """Per request; estimates only (service times, preemption gain, deadline feasibility, the
    output a started run still has to generate in admission's KV count)."""
    resume_recompute_fraction: float = 0.1
    """Share of a preempted context re-prefilled on resume (its KV stays cached; some is lost)."""
    # --- PD (item 5)
    pd_mode: str = "colocated"
    pd_max_inflight: int = 0
    """Cap on KV transfers in flight (dispatched to prefill, not yet landed); 0: uncapped."""
    # --- programs (item 6)
    programs: bool = False
    program_watermark: float = 0.95
    """Pause acting programs on a worker once program contexts exceed this share of its KV."""
    program_resume_watermark: float = 0.85
    """Resume a paused program only where it fits under this share (hysteresis, no flapping)."""
    program_park_max_s: float = 90.0
    """A parked step of a paused program waits at most this long for room: then the program
    resumes on its first candidate, displacing the programs silent longest there. Pausing must
    never starve a program. Room comes sooner when a program ends or goes stale (silent past
    the 99th percentile of the tool pauses seen: it gives its place up at once). Holding is what
    keeps the cache from thrashing when live programs overfill the KV, so the bound is a guard
    that should rarely fire: each forced resume displaces programs and re-prefills. On the
    closed-loop agent programs of ``bench sched`` (generated; aware steps/min, seeds 0-3): 30 s
    416.7 / 415.1 / 352.1 / 424.9, 60 s 428 / 425 / 385 / 455 (16, 30 forced resumes at 0, 2),
    90 s 447.1 / 428.9 / 391.3 / 452.9, the same at 120 and 180 s (it never fires); seeds 4-7
    at 60 / 90 s: 371.8 / 377.0 / 423.4 / 454.5 against 377.5 / 370.5 / 428.9 / 485.8 (+1.9 %
    over the eight seeds). The open-loop agent traces (seeds 0-2, 1-8x) are identical at 60
    and 90 s. Earlier draws: 2 s 1.01x the program-unaware rate, 10 s 1.18x, 30 s 1.43x."""
    program_rescue_share: float = 0.9
    """A step of a paused program whose previous prompt is still cached, to at least this
    share of its blocks, on one of its candidates resumes the program there at once instead of
    parking (0: never). Pausing only leaves a program's blocks to the engine's eviction, and
    the paused program most often comes back within seconds (a tool call; median 5.3 s after
    its pause on ``bench sched``'s programs), its KV still there: parking it then waited
    ~45 s for room and re-prefilled what the wait had evicted. Chosen on ``bench sched``'s
    programs (steps/min; program-unaware 288.9 / 263.5 / 300.6 on seeds 0-2): 0.9 gave
    420.6 / 371.8 / 429.6 against 364.0 / 363.1 / 434.3 with no rescue, 0.5 404.0 / 379.2 /
    400.9; on seeds 3-7 0.9 gave 478.9 / 470.1 / 453.2 / 426.0 / 343.4 against 455.8 / 461.4 /
    430.6 / 449.1 / 320.5 (program-unaware 310.6 / 312.6 / 294.1 / 316.0 / 257.2). The
    open-loop agent trace pauses only at 4x: TTFT p99 800 -> 740 ms (seed 0), 654 -> 672 ms
    (seed 1). Those with stickiness always on; with ``program_yield_ratio`` 1 as well,
    434.8 / 371.8 / 419.3 on seeds 0-2 (one yield each on seeds 0 and 2 moved the end of the
    run: the makespan is set by the one program with the longest chain of tool pauses)."""
    program_yield_ratio: float = 1.0
    """A step goes back to the worker holding its program's KV (sticky) unless the router
    ranked another worker first, the holder's queued prefill exceeds that worker's by more
    than this many times the prompt tokens the step re-prefills there, and the program fits
    there under ``program_resume_watermark`` (inf: always sticky). A step sent back to a
    holder busy with a long prefill waited behind it although the router had ranked a free
    worker first; moving a program re-prefills its own context there and leaves a copy behind,
    which only pays where the program fits (under ``bench sched``'s saturation, without the
    fit condition, 55-88 moves per run cost 0.72-0.74 against 0.76-0.78 hit; with it, 0-1).
    Chosen on the generated agent trace (thunder as deployed, TTFT p99 ms at 1 / 2 / 3 / 4x),
    seed 0: always sticky 644 / 654 / 763 / 979, 0.5 607 / 622 / 684 / 830, 1.0 588 / 583 /
    652 / 740, 2.0 573 / 632 / 697 / 851; seed 1: 588 / 581 / 630 / 734, 558 / 589 / 567 /
    674, 551 / 556 / 552 / 672, 544 / 565 / 630 / 654 (with ``program_rescue_share`` 0.9)."""
    program_idle_s: float = 60.0
    """An acting program silent this long is released (no release message came): tool calls
    pause for seconds (log-normal, median 2-6 s in agent traces), so after a minute the program
    is most likely over, and its KV only an LRU entry at the engine; counting it as resident
    longer would pause live programs for a dead one."""
    # --- deadlines (item 6)
    deadlines: bool = True

    def validate(self) -> SchedParams:
        for f in fields(self):
            value = getattr(self, f.name)
            _check_type(f.name, value, type(f.default))
            if isinstance(value, bool) or isinstance(value, str):
                continue
            if value < 0:
                raise ParamError(f.name, value, "must be >= 0")
        choices = {"window": WINDOWS, "order": ORDERS, "pd_mode": PD_MODES}
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ParamError(name, getattr(self, name), f"must be one of {allowed}")
        if self.program_rescue_share > 1:
            raise ParamError("program_rescue_share", self.program_rescue_share, "must be <= 1")
        for name in ("kv_watermark", "program_watermark", "program_resume_watermark"):
            if not 0 < getattr(self, name) <= 1:
                raise ParamError(name, getattr(self, name), "must be in (0, 1]")
        for name in ("work_tokens_per_s", "prefill_tokens_per_s", "decode_tokens_per_s"):
            if getattr(self, name) <= 0:
                raise ParamError(name, getattr(self, name), "must be > 0")
        if self.fallback_max_running < 1:
            raise ParamError("fallback_max_running", self.fallback_max_running, "must be >= 1")
        return self


def _check_type(name: str, value: object, kind: type) -> None:
    """``value`` has the type of the knob's default (an int where a float is due is fine):
    overrides arrive from command lines as JSON or strings, and a comparison below would
    otherwise fail with Python's own message instead of the knob's name."""
    if kind is float:
        ok = isinstance(value, int | float) and not isinstance(value, bool)
    elif kind is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    else:
        ok = isinstance(value, kind)
    if not ok:
        words = {float: "a number", int: "an integer", bool: "true or false", str: "a string"}
        raise ParamError(name, value, f"must be {words.get(kind, kind.__name__)}")
