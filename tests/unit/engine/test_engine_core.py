"""Engine core on the tiny profile: block 4 tokens, 32 blocks, chunk 32 tokens, 8 running."""

import dataclasses

import pytest

from thunderagent.engine.core import EngineCore, Request, StepOutcome
from thunderagent.engine.events import Medium, Stored
from thunderagent.engine.prefix_cache import Match
from thunderagent.engine.profiles import get_profile

TINY = get_profile("tiny")


def make_request(rid: str, prompt_len: int, keys: list[int] | None = None, out: int = 4) -> Request:
    if keys is None:
        keys = [hash((rid, i)) & 0xFFFFFFFF for i in range(prompt_len // 4)]
    return Request(rid, prompt_len, keys, max_new_tokens=out)


def drain(core: EngineCore, now: float = 0.0, limit: int = 10_000) -> list[StepOutcome]:
    outcomes = []
    while core.has_work and len(outcomes) < limit:
        out = core.step(now)
        now += out.duration
        outcomes.append(out)
    assert not core.has_work
    return outcomes


def assert_clean(core: EngineCore) -> None:
    """No blocks leak: nothing reserved, nothing pinned once every request has left."""
    assert core.cache.reserved == 0
    assert core.cache.pinned == 0
    assert all(core.cache.refcount(k) == 0 for k in core.cache.contents())
    load = core.load()
    assert load.kv_used_blocks == load.cached_blocks


def test_chunked_prefill_splits_a_long_prompt() -> None:
    core = EngineCore(TINY)
    core.add(make_request("a", 100, out=2), 0.0)
    outs = drain(core)
    assert [o.kind for o in outs] == ["prefill"] * 4 + ["decode"]
    assert [o.prefill_tokens for o in outs[:4]] == [32, 32, 32, 4]
    assert [o.first_token for o in outs[:4]] == [[], [], [], ["a"]]
    assert outs[-1].finished[0].completion_tokens == 2
    # each chunk stores its full blocks as soon as it ends: 8 blocks per 32-token chunk
    stored = [sum(len(e.block_hashes) for e in o.events if isinstance(e, Stored)) for o in outs]
    assert stored[:4] == [8, 8, 8, 1]
    assert_clean(core)


def test_prefill_time_follows_the_timing_model() -> None:
    core = EngineCore(TINY)
    core.add(make_request("a", 20), 0.0)
    out = core.step(0.0)
    assert out.duration == pytest.approx(core.timing.prefill_time([(20, 0)]))
    out = core.step(out.duration)
    assert out.kind == "decode"
    assert out.duration == pytest.approx(core.timing.decode_time(1, 21))


def test_preemption_requeues_and_everyone_finishes() -> None:
    core = EngineCore(TINY)
    for i in range(8):  # each needs up to 12 + 20 = 32 tokens = 8 blocks; 64 blocks > 32
        core.add(make_request(f"r{i}", 12, out=20), 0.0)
    outs = drain(core)
    finished = [f for o in outs for f in o.finished]
    assert sorted(f.request_id for f in finished) == [f"r{i}" for i in range(8)]
    assert all(f.completion_tokens == 20 for f in finished)
    assert core.total_preemptions > 0
    assert sum(f.preemptions for f in finished) == core.total_preemptions
    tokens = {}
    for o in outs:
        for rid, n in o.tokens.items():
            tokens[rid] = tokens.get(rid, 0) + n
    assert tokens == {f"r{i}": 20 for i in range(8)}  # retraction keeps generated tokens
    assert_clean(core)


def test_retracted_request_goes_to_the_front() -> None:
    core = EngineCore(TINY)
    for i in range(8):
        core.add(make_request(f"r{i}", 12, out=20), 0.0)
    now = 0.0
    while True:
        out = core.step(now)
        now += out.duration
        if out.preempted:
            break
    assert core._waiting[0].req.request_id == out.preempted[-1]


def test_abort_frees_blocks() -> None:
    core = EngineCore(TINY)
    core.add(make_request("a", 40, out=50), 0.0)
    core.step(0.0)  # first chunk: 32 tokens -> 8 blocks cached and pinned
    core.step(1.0)  # rest of the prompt: 8 tokens -> 2 blocks, first token
    assert core.load().kv_used_blocks == 10
    assert core.step(2.0).kind == "decode"
    assert core.load().kv_used_blocks == 11  # 10 cached + 1 private block for output tokens
    fin = core.abort("a", 3.0)
    assert fin is not None and fin.finish_reason == "abort"
    assert core.abort("a", 2.0) is None
    assert not core.has_work
    assert_clean(core)
    assert core.load().kv_used_blocks == 10  # the prompt stays cached, unpinned


def test_abort_waiting_request() -> None:
    core = EngineCore(TINY)
    core.add(make_request("a", 8), 0.0)
    assert core.abort("a", 0.0).completion_tokens == 0
    assert not core.has_work


def test_cached_tokens_for_a_repeated_prompt() -> None:
    core = EngineCore(TINY)
    keys = [11, 12, 13, 14]
    core.add(make_request("a", 17, keys), 0.0)
    first = next(f for o in drain(core) for f in o.finished)
    assert first.cached_tokens == 0
    core.add(make_request("b", 17, keys), 10.0)
    again = next(f for o in drain(core, 10.0) for f in o.finished)
    assert again.cached_tokens == 16  # 4 full blocks; the partial block is recomputed
    core.add(make_request("c", 16, keys), 20.0)
    exact = next(f for o in drain(core, 20.0) for f in o.finished)
    assert exact.cached_tokens == 12  # at least one token is always computed
    assert_clean(core)


def test_finished_request_caches_prompt_and_output_blocks() -> None:
    core = EngineCore(TINY)
    core.add(make_request("a", 8, [1, 2], out=9), 0.0)
    drain(core)
    # KV of 8 + 9 - 1 = 16 tokens: 4 full blocks, 2 with derived keys after [1, 2]
    contents = core.cache.contents()
    assert len(contents) == 4 and {1, 2} <= set(contents)
    assert set(contents.values()) == {Medium.GPU}


def test_oversized_request_is_rejected() -> None:
    core = EngineCore(TINY)
    fin = core.add(make_request("big", 120, out=20), 0.0)  # 140 tokens > 128 in the pool
    assert fin is not None and fin.finish_reason == "rejected"
    assert not core.has_work


def test_fused_decode_matches_single_steps() -> None:
    def run(fused: bool) -> dict[str, float]:
        core = EngineCore(TINY)
        for i in range(3):
            core.add(make_request(f"r{i}", 8, out=5 + 3 * i), 0.0)
        now, done = 0.0, {}
        while core.has_work:
            out = core.step(now, until=1e9 if fused else None)
            now += out.duration
            done.update({f.request_id: now for f in out.finished})
        return done

    single, fused = run(False), run(True)
    assert single.keys() == fused.keys()
    for rid, t in single.items():
        assert fused[rid] == pytest.approx(t, rel=1e-9)


def test_host_tier_hits_load_back_and_cost_pcie_time() -> None:
    profile = TINY.with_engine(host_blocks=16)
    core = EngineCore(profile)
    core.add(make_request("a", 40, list(range(100, 110)), out=1), 0.0)
    drain(core)
    core.add(make_request("b", 120, list(range(200, 230)), out=1), 1.0)
    drain(core, 1.0)  # b's 30 blocks push 8 of a's 10 blocks (leaves first) to the host tier
    assert core.cache.match(list(range(100, 110))) == Match(2, 8)
    core.add(make_request("c", 40, list(range(100, 110)), out=1), 2.0)
    out = core.step(2.0)
    assert out.host_loaded_blocks == 7  # (40 - 1) // 4 = 9 blocks may hit: 2 on GPU, 7 loaded
    expected = core.timing.prefill_time([(4, 36)], host_load_blocks=7)
    assert out.duration == pytest.approx(expected)
    assert out.finished[0].cached_tokens == 36
    assert_clean(core)


def test_preemption_with_host_tier_still_finishes() -> None:
    core = EngineCore(TINY.with_engine(host_blocks=8))
    for i in range(10):
        core.add(make_request(f"r{i}", 12, [1, 2, 3 + i], out=20), 0.0)
    outs = drain(core)
    assert len([f for o in outs for f in o.finished]) == 10
    assert core.total_preemptions > 0
    assert_clean(core)


def test_kv_in_use_counts_a_shared_prefix_once() -> None:
    """``num_tokens`` is KV in use, as SGLang reports it: two running requests on one cached
    prefix hold its blocks once, plus their own blocks."""
    core = EngineCore(TINY)
    shared = [1, 2, 3, 4]  # 4 blocks of 4 tokens
    core.add(make_request("a", 17, shared, out=1), 0.0)
    drain(core)  # a leaves its 4 full prompt blocks cached
    core.add(make_request("b", 17, shared, out=8), 1.0)
    core.add(make_request("c", 17, shared, out=8), 1.0)
    core.step(1.0)  # both admitted on the cached prefix, prefilling their last token
    load = core.load()
    assert core.cache.pinned == 4  # the shared prefix, once
    assert load.num_tokens == (4 + core.cache.reserved) * 4
    assert load.num_tokens < 2 * 17  # per-request sums would count the prefix twice


def _two_sharing_a_cached_prefix(core: EngineCore) -> StepOutcome:
    """A 24-token prefix cached by a first request; then two requests sharing it, each with one
    block of its own, prefilled together: returns their first decode step."""
    core.add(make_request("warm", 24, [1, 2, 3, 4, 5, 6], out=1), 0.0)
    drain(core)
    core.add(make_request("a", 28, [1, 2, 3, 4, 5, 6, 100], out=3), 10.0)
    core.add(make_request("b", 28, [1, 2, 3, 4, 5, 6, 200], out=3), 10.0)
    first = core.step(10.0)
    assert first.kind == "prefill" and first.prefill_tokens == 8  # 4 new tokens each
    out = core.step(11.0)
    assert out.kind == "decode"
    return out


def test_each_request_reads_its_own_kv_in_a_decode_step_by_default() -> None:
    core = EngineCore(TINY)
    out = _two_sharing_a_cached_prefix(core)
    assert out.duration == pytest.approx(core.timing.decode_time(2, 28 + 28 + 2))


def test_cascade_attention_reads_a_shared_page_once() -> None:
    eff = dataclasses.replace(TINY.eff, shared_kv_once=True)
    core = EngineCore(dataclasses.replace(TINY, eff=eff))
    out = _two_sharing_a_cached_prefix(core)
    # 6 shared blocks + one of each request's own, 4 tokens a block, plus the two new tokens
    assert out.duration == pytest.approx(core.timing.decode_time(2, (6 + 2) * 4 + 2))
    drain(core, 12.0)
    assert_clean(core)
