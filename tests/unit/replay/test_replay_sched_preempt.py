"""Preemption in the replay: the engine keeps the victim's blocks, the continuation resumes on
them and finishes with every token."""

from thunderagent.engine import EngineCore, Request, get_profile
from thunderagent.replay import Replay, ReplayConfig, TraceRequest

TINY = get_profile("tiny")  # block 4 tokens, 32 blocks, chunk 32 tokens, 8 running
BS = TINY.engine.block_size


def _run_until_decoded(core: EngineCore, rid: str, tokens: int) -> None:
    now = 0.0
    done = 0
    while done < tokens:
        out = core.step(now)
        done += out.tokens.get(rid, 0)
        now += out.duration


def test_abort_keep_cache_inserts_prompt_and_output_blocks() -> None:
    keys = [101, 102, 103, 104]
    # the prompt blocks were cached at prefill either way; keep_cache adds the output blocks
    for keep, expect_hit in ((False, 16), (True, 24)):
        core = EngineCore(TINY)
        core.add(Request("r", 16, list(keys), max_new_tokens=40), 0.0)
        _run_until_decoded(core, "r", 10)  # KV exists for 16 + 9 tokens: 6 full blocks
        fin = core.abort("r", 1.0, keep_cache=keep)
        assert fin is not None and fin.completion_tokens == 10
        assert core.cache.free == core.cache.capacity - core.cache.gpu_blocks  # nothing pinned
        core.add(Request("r", 26, list(keys), max_new_tokens=30), 1.0)  # the continuation
        out = core.step(1.0)
        assert out.kind == "prefill"
        assert out.prefill_tokens == 26 - expect_hit


def test_preempted_request_finishes_with_all_tokens_and_resumes_from_cache() -> None:
    trace = [
        TraceRequest("long", 0.0, 16, 80, [1, 2, 3, 4], priority=1, expected_output=80),
        TraceRequest("short", 0.05, 8, 4, [7, 8], priority=0, expected_output=4),
    ]
    cfg = ReplayConfig(
        profile=TINY,
        policy="round_robin",
        workers=1,
        scheduler="preempt",
        scheduler_params={"max_running": 1, "preempt_min_remaining_tokens": 16},
    )
    result = Replay(cfg, BS).run(trace)
    long_, short = result.records
    assert [r.status for r in result.records] == ["completed", "completed"]
    assert long_.sched_preemptions == 1 and short.sched_preemptions == 0
    assert long_.completion_tokens == 80 and short.completion_tokens == 4
    assert short.finish < long_.finish
    assert long_.first_token < short.arrival  # preempted while decoding, stream kept
    # the continuation (prompt + generated) found every block it could reuse
    assert long_.resume_prompt_tokens > 16
    assert long_.resume_cached_tokens == (long_.resume_prompt_tokens - 1) // BS * BS
    assert result.sched_stats["preempted"] == 1
