"""Which run-event batches a receiver refuses (``fleet.progress``): an adapter speaks only on
its own subject and only for its own runs (or the run it handed to a decode worker)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from thunderagent.fleet import progress_refusal
from thunderagent.schemas import ProgressBatch, RequestProgress, subjects

PHASES = ["started", "finished", "failed", "aborted", "transferred"]


def event(i: int, phase: str = "finished", worker: str = "w0", **kw) -> RequestProgress:
    return RequestProgress(request_id=f"r{i}", worker_id=worker, phase=phase, ts=0.0, **kw)  # type: ignore[arg-type]


def test_an_adapters_own_batch_is_trusted_on_its_own_subject_only():
    own = ProgressBatch(worker_id="w0", events=[event(1, "started"), event(1)])
    assert own.ends_runs
    assert progress_refusal(own, subjects.progress("w0", ended=True)) == ""
    refusal = progress_refusal(own, subjects.progress("w1", ended=True))
    assert "arrived on thunderagent.progress.w1.ended" in refusal
    # an end on the subject routers do not read would leave their books stale
    assert "arrived on" in progress_refusal(own, subjects.progress("w0", ended=False))
    start = ProgressBatch(worker_id="w0", events=[event(2, "started")])
    assert not start.ends_runs
    assert progress_refusal(start, subjects.progress("w0", ended=False)) == ""
    assert "arrived on" in progress_refusal(start, subjects.progress("w0", ended=True))
    empty = ProgressBatch(worker_id="w0", events=[])
    assert "no events" in progress_refusal(empty, subjects.progress("w0", ended=False))


def test_a_batch_may_name_another_worker_only_for_its_own_pd_hand_off():
    spoofed = ProgressBatch(worker_id="w0", events=[event(1), event(2, worker="w1")])
    on = subjects.progress("w0", ended=True)
    assert "speaks for 'w1' (finished)" in progress_refusal(spoofed, on)
    handed = event(3, "transferred", worker="w1", from_worker="w0")
    assert progress_refusal(ProgressBatch(worker_id="w0", events=[handed]), "x") != ""
    ok = ProgressBatch(worker_id="w0", events=[handed])
    assert progress_refusal(ok, subjects.progress("w0", ended=False)) == ""
    stolen = event(3, "transferred", worker="w1", from_worker="w2")
    refusal = progress_refusal(
        ProgressBatch(worker_id="w0", events=[stolen]), subjects.progress("w0", ended=False)
    )
    assert "speaks for 'w1' (transferred)" in refusal


@given(
    st.lists(
        st.tuples(
            st.sampled_from(PHASES),
            st.sampled_from(["w0", "w1"]),
            st.sampled_from(["", "w0", "w2"]),
        ),
        min_size=1,
        max_size=8,
    )
)
def test_trusted_exactly_when_every_event_is_the_senders(specs):
    events = [event(i, p, worker=w, from_worker=f) for i, (p, w, f) in enumerate(specs)]
    batch = ProgressBatch(worker_id="w0", events=events)
    own = all(
        e.worker_id == "w0" or (e.phase == "transferred" and e.from_worker == "w0") for e in events
    )
    on = subjects.progress("w0", ended=batch.ends_runs)
    assert (progress_refusal(batch, on) == "") == own
