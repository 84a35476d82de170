"""``bench route``: the decision it times is a real one over an index that holds every worker."""

import json

import pytest

from thunderagent.bench import route


def test_every_worker_is_indexed_and_a_decision_ranks_them_all() -> None:
    core = route.build_core("thunder", workers=3, indexed=50)
    assert core.feeder.gpu_index.block_counts() == {"w0": 50, "w1": 50, "w2": 50}
    hashes = core.hash_tokens(list(range(4 * route.BLOCK_SIZE)), route.BLOCK_SIZE)
    routed = core.route(
        request_id="r", model="m", hashes=hashes, prompt_tokens=4 * route.BLOCK_SIZE,
        block_size=route.BLOCK_SIZE, expected_output_tokens=16, now=1.0,
    )  # fmt: skip
    assert routed is not None and len(routed.decision.candidates) == 3
    assert routed.query.overlaps == {}, "the timed prompt matches no worker's blocks"


def test_main_prints_the_time_per_decision_and_per_request(capsys) -> None:
    route.main(["--workers", "2", "--indexed", "20", "--decisions", "10"])
    report = json.loads(capsys.readouterr().out)
    assert report["workers"] == 2 and report["us_per_decision"] > 0
    assert report["us_per_request"] > 0


def test_each_timed_request_is_booked_started_and_ended_on_its_worker() -> None:
    """The per-request figure runs the router service's whole sequence: afterwards nothing is
    left assigned or awaiting its dispatch, and no prompt was a hit (each is its own)."""
    core = route.build_core("thunder", workers=3, indexed=50)
    route.time_decisions(core, blocks=4, decisions=6, lifecycle=True)
    states = core.fleet.all()
    assert all(not s.assigned and s.assigned_since_report == 0 for s in states)
    assert not core._routed, "every routed request was dispatched"
    assert not core.verifier._dispatched, "and verified at its end"
    assert core.window.predicted_tokens == 0, "no prompt was predicted as a hit"


def test_an_unknown_policy_is_a_usage_error(capsys) -> None:
    """It was a ValueError traceback from the router core."""
    with pytest.raises(SystemExit) as info:
        route.main(["--policy", "nosuch", "--decisions", "10"])
    assert info.value.code == 2
    assert "argument --policy: invalid choice: 'nosuch'" in capsys.readouterr().err


def test_with_new_blocks_the_timed_prompts_share_the_rest_through_the_in_flight_overlay() -> None:
    """``--new-blocks 2`` of 6: after the first request every prompt's shared 4 blocks are in
    flight on a worker, so the requests after it are predicted hits of exactly those blocks."""
    core = route.build_core("thunder", workers=3, indexed=50)
    route.time_decisions(core, blocks=6, decisions=4, lifecycle=True, new_blocks=2)
    assert core.window.predicted_tokens > 0, "the shared prefix was predicted cached"
    prompts = route._sharing_prompts(core, blocks=6, new_blocks=2, n=3)
    assert prompts[0].primary[:4] == prompts[2].primary[:4]
    assert prompts[0].primary[4] != prompts[1].primary[4]
    assert not core._routed and all(not s.assigned for s in core.fleet.all())


def test_main_reports_new_blocks(capsys) -> None:
    route.main(["--workers", "2", "--indexed", "20", "--decisions", "10", "--blocks", "8",
                "--new-blocks", "2"])  # fmt: skip
    report = json.loads(capsys.readouterr().out)
    assert report["new_blocks"] == 2 and report["us_per_request"] > 0
