"""Agent programs: sticky placement, pausing smallest acting programs, resume (fewest steps run
first), release."""

from __future__ import annotations

from program_helpers import run, sched

from thunderagent.scheduling import Dispatch, SchedRequest, ThunderScheduler, WorkerRoom
from thunderagent.scheduling.programs import ACTING, PAUSED

BS_TOKENS = 16


def step(rid, pid, prompt, cands=(("w0", 0),), out=16, hashed=False) -> SchedRequest:
    """``hashed``: the prompt's blocks carry hashes (the program's own), so a step can find
    its program's previous prompt cached (rescue)."""
    own = sum(map(ord, pid)) << 20
    hashes = [own + i for i in range(prompt // BS_TOKENS)] if hashed else []
    return SchedRequest(rid, 0.0, prompt, out, list(cands), block_hashes=hashes, program_id=pid)


def test_sticky_placement_prefers_the_worker_holding_the_program() -> None:
    s = sched()
    assert run(s, step("p-0", "p", 160, [("w1", 0), ("w0", 0)]), 0.0) == [Dispatch("p-0", "w1")]
    s.on_finished("p-0", "w1", 1.0)
    assert run(s, step("p-1", "p", 320, [("w0", 2), ("w1", 0)]), 2.0) == [Dispatch("p-1", "w1")]


def crowded(hashed=False, **params) -> ThunderScheduler:
    s = sched(total=100, **params)  # pause above 95 blocks, resume under 75
    for pid, prompt in (("A", 160), ("B", 480), ("C", 800)):
        assert len(run(s, step(f"{pid}-0", pid, prompt, hashed=hashed), 0.0)) == 1
        s.on_finished(f"{pid}-0", "w0", 1.0)
    # acting: A 11 blocks, B 31, C 51 = 93; D reasoning with 20 more: 113 > 95
    assert run(s, step("D-0", "D", 320), 2.0) == [Dispatch("D-0", "w0")]
    s.poll(2.0)
    return s


def test_over_capacity_pauses_smallest_acting_then_resumes_after_release() -> None:
    s = crowded()
    phases = {p: s.programs.programs[p].phase for p in "ABC"}
    assert phases == {"A": PAUSED, "B": PAUSED, "C": ACTING}
    assert s.programs.resident("w0") == 51 + 20
    # A's next step waits: 71 + 11 is over the resume mark (75) on both candidates
    assert run(s, step("A-1", "A", 176, [("w0", 11)]), 3.0) == []
    assert s.waiting() == 1
    s.on_finished("D-0", "w0", 4.0)
    assert s.poll(4.0) == []
    s.release_program("D", 4.5)
    assert s.poll(4.5) == [Dispatch("A-1", "w0")]
    assert s.stats()["program_resumes"] == 1


def test_room_goes_first_to_the_paused_program_with_the_fewest_steps_run() -> None:
    """B (two steps run) parked before A (one step run); when room for one of them appears, A
    resumes: it most likely has more steps left, and the last program to end sets when the
    whole batch is done. B waits for more room."""
    s = sched(total=100)  # pause above 95 blocks, resume under 75
    for rid, pid, prompt in (
        ("A-0", "A", 160),
        ("B-0", "B", 160),
        ("B-1", "B", 176),
        ("C-0", "C", 880),
    ):
        assert len(run(s, step(rid, pid, prompt), 0.0)) == 1
        s.on_finished(rid, "w0", 1.0)
    assert run(s, step("D-0", "D", 480), 2.0) == [Dispatch("D-0", "w0")]  # 110 blocks > 95
    s.poll(2.0)
    assert [s.programs.programs[p].phase for p in "ABC"] == [PAUSED, PAUSED, ACTING]
    assert run(s, step("B-2", "B", 192), 3.0) == []
    assert run(s, step("A-1", "A", 176), 3.1) == []
    assert s.programs.resume_order() == ["A", "B"]
    s.on_finished("D-0", "w0", 4.0)
    s.release_program("D", 4.0)  # C's 56 blocks left: room under 75 for A's 11 or B's 12
    assert s.poll(4.0) == [Dispatch("A-1", "w0")]
    assert s.programs.programs["B"].phase == PAUSED and s.waiting() == 1


def test_paused_step_resumes_on_the_routers_next_candidate() -> None:
    s = crowded()
    got = run(s, step("A-1", "A", 176, [("w0", 11), ("w1", 0)]), 3.0)
    assert got == [Dispatch("A-1", "w1")]


def test_every_parked_step_of_a_paused_program_resumes_with_it() -> None:
    """An open-loop client may send a program's next steps before the first is served: all
    of them wait with the program and all of them go when it resumes (none is lost)."""
    s = crowded()
    assert run(s, step("A-1", "A", 176, [("w0", 11)]), 3.0) == []
    assert run(s, step("A-2", "A", 192, [("w0", 11)]), 3.1) == []
    assert s.programs.pending["A"] == ["A-1", "A-2"]
    s.on_finished("D-0", "w0", 3.2)
    s.release_program("D", 3.2)
    assert s.poll(3.2) == [Dispatch("A-1", "w0"), Dispatch("A-2", "w0")]
    assert s.waiting() == 0


def test_a_parked_step_never_waits_past_the_park_bound() -> None:
    """Under sustained pressure nothing frees memory: after ``program_park_max_s`` the program
    resumes on its step's first candidate anyway (re-prefilling beats starving)."""
    s = crowded()
    assert run(s, step("A-1", "A", 176, [("w0", 11)]), 3.0) == []
    wake = s.next_wakeup(3.0)
    assert wake == 3.0 + s.params.program_park_max_s
    assert s.poll(wake - 0.01) == []
    assert s.poll(wake) == [Dispatch("A-1", "w0")]


def test_the_forced_resume_displaces_the_program_silent_longest() -> None:
    s = crowded(program_park_max_s=5.0)
    assert run(s, step("A-1", "A", 176, [("w0", 11)]), 3.0) == []
    wake = s.next_wakeup(3.0)
    assert s.poll(wake) == [Dispatch("A-1", "w0")]
    assert s.programs.programs["C"].phase == PAUSED, "C, acting since t=1, made room for A"


FULL = WorkerRoom("w0", 8, 0, 100, 100, 8)
"""w0's engine with no room: a step handed to it waits in the scheduler's queue."""


def forced_back_while_full() -> ThunderScheduler:
    """A's step was forced back in after the park bound, but the engine has no room yet, so
    it waits in the queue; B and C, still cached on w0, are rescued there meanwhile and push
    w0's programs over the watermark (113 blocks > 95)."""
    s = crowded(hashed=True, program_park_max_s=5.0)
    assert run(s, step("A-1", "A", 176, [("w0", 0)]), 3.0) == []  # evicted: it parks
    s.update_worker(FULL, 3.5)
    assert s.poll(8.0) == []  # forced back in, nowhere to run yet
    assert s.programs.programs["A"].phase == ACTING and "A" not in s.programs.pending
    for pid, prompt in (("C", 816), ("B", 496)):
        cands = [("w1", 0), ("w0", prompt // BS_TOKENS - 1)]
        assert run(s, step(f"{pid}-1", pid, prompt, cands, hashed=True), 8.2) == []
    assert s.programs.resident("w0") > 95
    return s


def test_a_forced_step_still_queued_is_not_parked_again() -> None:
    """Pausing A now would park its step a second time, past the bound: the pass pauses no
    program whose woken steps are still queued, and A's step goes once the engine has room."""
    s = forced_back_while_full()
    s.update_worker(FULL, 8.4)
    assert s.poll(8.4) == []
    assert s.programs.programs["A"].phase == ACTING, "A's step is queued, not parked"
    s.update_worker(WorkerRoom("w0", 0, 0, 0, 100, 8), 9.0)
    got = [a for a in s.poll(9.0) if isinstance(a, Dispatch)]
    assert Dispatch("A-1", "w0") in got


def test_a_woken_program_whose_step_is_cancelled_can_pause_again() -> None:
    s = forced_back_while_full()
    assert s.cancel("A-1", 8.3) is True
    s.update_worker(FULL, 8.4)
    s.poll(8.4)
    assert s.programs.programs["A"].phase == PAUSED, "nothing of A's waits: it gives way"


def test_a_stale_program_gives_way_at_once_a_live_one_does_not() -> None:
    """Tool pauses seen so far last about a second: C, silent for 2 s, is most likely over and
    gives its place to A's step at once; a second earlier it was not stale and A waited."""
    s = crowded()
    s.programs.tool_pauses.extend([1.0] * 20)
    assert run(s, step("A-1", "A", 176, [("w0", 11)]), 1.5) == []  # C silent 0.5 s: live
    assert s.programs.programs["C"].phase == ACTING
    got = [a for a in s.poll(3.0) if isinstance(a, Dispatch)]  # C silent 2 s: stale
    assert got == [Dispatch("A-1", "w0")]
    assert s.programs.programs["C"].phase == PAUSED


def test_cancelling_a_parked_step_leaves_nothing_behind() -> None:
    s = crowded()
    assert run(s, step("A-1", "A", 176, [("w0", 11)]), 3.0) == []
    assert s.cancel("A-1", 3.5) is True
    assert s.waiting() == 0 and "A" not in s.programs.pending
    assert s.next_wakeup(3.5) is None


def test_a_prompt_programs_share_counts_once_toward_the_watermark() -> None:
    """Agents on one tool prompt hold its KV once: 40 programs sharing a 20-block prompt, each
    with 1 own block and 1 block of output, hold 100 blocks, not 880 (which would pause nearly
    every one of them on a 200-block worker)."""
    s = sched(total=200)
    tool = list(range(20))
    for i in range(40):
        req = SchedRequest(f"p{i}-0", 0.0, 21 * BS_TOKENS, 1, [("w0", 0)], program_id=f"p{i}",
                           block_size=BS_TOKENS, block_hashes=[*tool, 1000 + i])  # fmt: skip
        assert len(run(s, req, 0.0)) == 1
        s.on_finished(f"p{i}-0", "w0", 0.5)
    s.poll(1.0)
    assert s.programs.resident("w0") == 20 + 40 * 2  # the tool prompt once; own + output block
    assert s.stats()["program_pauses"] == 0


def test_a_program_no_worker_can_hold_does_not_wait_for_room() -> None:
    """A program bigger than a worker's resume room even on an empty worker (a long prompt on
    a small pool) gets paused like any other, but its next step must not park: no release
    can ever make room for it, so waiting only delays it by ``program_park_max_s``."""
    s = sched(total=100)  # resume under 75 blocks
    assert run(s, step("X-0", "X", 110 * BS_TOKENS), 0.0) == [Dispatch("X-0", "w0")]
    s.on_finished("X-0", "w0", 1.0)
    s.poll(1.0)
    assert s.programs.programs["X"].phase == PAUSED, "111 blocks on a 95-block watermark"
    assert run(s, step("X-1", "X", 160, [("w0", 0), ("w1", 0)]), 2.0) == [Dispatch("X-1", "w0")]
    assert s.waiting() == 0 and "X" not in s.programs.pending


def test_a_step_that_failed_leaves_no_residency_behind() -> None:
    """A step whose run failed for good (refused, or its engine failed it) never ran: the
    tracker must not count its prompt as the program's KV on that worker (as a finished step
    would), or programs there get paused for KV nobody holds."""
    s = sched(total=100)
    assert run(s, step("X-0", "X", 60 * BS_TOKENS), 0.0) == [Dispatch("X-0", "w0")]
    assert s.programs.resident("w0") == 60  # its prompt, while the step runs
    s.on_failed("X-0", "w0", 1.0)
    assert s.programs.resident("w0") == 0 and "X" not in s.programs.programs
    assert s.running == {}
    assert run(s, step("X-1", "X", 160), 2.0) == [Dispatch("X-1", "w0")]


def test_a_finished_step_keeps_its_residency() -> None:
    """The contrast: the same step finishing leaves the program acting with its KV there."""
    s = sched(total=100)
    run(s, step("X-0", "X", 60 * BS_TOKENS), 0.0)
    s.on_finished("X-0", "w0", 1.0)
    assert s.programs.programs["X"].phase == ACTING
    assert s.programs.resident("w0") == 61  # its prompt and its output
