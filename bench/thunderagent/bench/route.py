"""CPU time of one routing decision in the router core (hash lookup in the prefix index, the
in-flight overlay, the workers' views, the policy's ranking), the pure code the router service
and the replay both call; no I/O.

    thunderagent bench route [--workers 8] [--blocks 64] [--indexed 20000] [--policy thunder]
                             [--new-blocks N]

Each worker holds ``--indexed`` blocks of its own in the index and reports a moderate load; the
prompt of ``--blocks`` blocks matches none of them, so the whole walk and every cost are paid.
Prints the best of five rounds in µs: ``us_per_decision``, the decision alone (nothing changes
between two decisions, so every worker's view is kept), and ``us_per_request``, the router
core's whole work for a request as the router service does it (decision, dispatch booked,
first token, end: the chosen worker's state changes at each, and its view is rebuilt). With
``--new-blocks N`` each request's prompt has only its last N blocks of its own and shares the
rest with every other (a conversation's earlier turns, a shared document): the prefix is then
in the router's in-flight overlay, as it is in front of a real fleet.
"""

from __future__ import annotations

import time

from thunderagent.bench.cli import bench_parser
from thunderagent.bench.jsonfile import dumps
from thunderagent.router_core import RouterCore, RouterParams
from thunderagent.routing import POLICIES
from thunderagent.schemas import BlocksStored, KvEventBatch, LoadReport, WorkerRegistration
from thunderagent.shell.argtypes import at_least

BLOCK_SIZE = 16


def build_core(policy: str, workers: int, indexed: int) -> RouterCore:
    core = RouterCore(RouterParams(policy=policy, seed=1, index_ttl_s=None))
    for i in range(workers):
        w = f"w{i}"
        core.register(
            WorkerRegistration(
                worker_id=w, model="m", engine_url="", block_size=BLOCK_SIZE,
                kv_capacity_blocks=4 * indexed, lease_s=1e9, registered_at=0.0,
            ),
            0.0,
        )  # fmt: skip
        core.report(
            LoadReport(
                worker_id=w, ts=0.0, running=3, queued=0, kv_used_blocks=indexed,
                kv_total_blocks=4 * indexed, prefill_backlog_tokens=0,
            ),
            0.0,
        )  # fmt: skip
        start = (i + 1) * indexed * BLOCK_SIZE
        hashes = core.hash_tokens(list(range(start, start + indexed * BLOCK_SIZE)), BLOCK_SIZE)
        events = [BlocksStored(hashes=hashes.primary, check_hashes=hashes.check)]
        core.apply_kv(KvEventBatch(worker_id=w, seq=0, ts=0.0, events=events), 0.0)
    return core


def time_decisions(
    core: RouterCore,
    blocks: int,
    decisions: int,
    *,
    lifecycle: bool = False,
    new_blocks: int | None = None,
) -> float:
    """Best of five rounds, seconds per ``route`` call (``lifecycle``: per request, with its
    dispatch, first token and end; each request then has a prompt of its own, since a booked
    dispatch puts its prompt in the in-flight overlay and the next one would hit it, or with
    ``new_blocks`` only its last ``new_blocks`` blocks, the rest shared by all)."""
    tokens, rounds = blocks * BLOCK_SIZE, 5
    prompts = _timed_prompts(core, blocks, rounds * decisions, lifecycle, new_blocks)
    best = float("inf")
    for r in range(rounds):
        started = time.perf_counter()
        for k in range(decisions):
            rid = f"{r}-{k}"
            routed = core.route(
                request_id=rid, model="m", hashes=prompts[r * decisions + k],
                prompt_tokens=tokens, block_size=BLOCK_SIZE, expected_output_tokens=16, now=1.0,
            )  # fmt: skip
            if not lifecycle:
                core.forget(rid)
                continue
            assert routed is not None
            _serve(core, rid, routed.decision.worker_id)
        best = min(best, (time.perf_counter() - started) / decisions)
    return best


def _timed_prompts(
    core: RouterCore, blocks: int, n: int, lifecycle: bool, new_blocks: int | None
) -> list:
    """``time_decisions``'s ``n`` prompts of ``blocks`` blocks (see its docstring)."""
    prompt = list(range(blocks * BLOCK_SIZE))
    if lifecycle and new_blocks is not None and new_blocks < blocks:
        return _sharing_prompts(core, blocks, new_blocks, n)
    if lifecycle:  # a namespace (salt) of its own each: no prefix of any other prompt
        return [core.hash_tokens(prompt, BLOCK_SIZE, salt=f"request-{k}") for k in range(n)]
    return [core.hash_tokens(prompt, BLOCK_SIZE)] * n


def _serve(core: RouterCore, rid: str, worker: str) -> None:
    """The rest of a routed request's life, as the router service sees it on the credit path:
    offered, taken, first token, end."""
    core.on_offered(rid, worker)
    core.on_dispatched(rid, worker, 1.0)
    core.on_started(rid, worker, 1.0)
    core.on_finished(rid, worker, 1.0, cached_tokens=0, completion_tokens=16)


def _sharing_prompts(core: RouterCore, blocks: int, new_blocks: int, n: int) -> list:
    """``n`` prompts of ``blocks`` blocks: one shared prefix, then ``new_blocks`` of each
    prompt's own (token ids from 2**30 up, apart from the prefix's and the workers' blocks)."""
    shared = list(range((blocks - new_blocks) * BLOCK_SIZE))
    own = new_blocks * BLOCK_SIZE
    return [core.hash_tokens([*shared, *range(2**30 + k * own, 2**30 + (k + 1) * own)],
                             BLOCK_SIZE) for k in range(n)]  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    p = bench_parser("route", __doc__)
    p.add_argument("--workers", type=at_least(1), default=8)
    p.add_argument("--blocks", type=at_least(1), default=64)
    p.add_argument("--indexed", type=at_least(1), default=20000, help="blocks indexed per worker")
    p.add_argument("--policy", default="thunder", choices=POLICIES.names())
    p.add_argument("--decisions", type=at_least(1), default=5000)
    p.add_argument("--new-blocks", type=at_least(1), default=None,
                   help="blocks of each timed request's prompt no other prompt has (default: "
                        "all); the rest is one prefix they all share")  # fmt: skip
    args = p.parse_args(argv)
    core = build_core(args.policy, args.workers, args.indexed)
    decision = time_decisions(core, args.blocks, args.decisions)
    request = time_decisions(
        core, args.blocks, args.decisions, lifecycle=True, new_blocks=args.new_blocks
    )
    report = vars(args) | {
        "us_per_decision": round(decision * 1e6, 1),
        "us_per_request": round(request * 1e6, 1),
    }
    print(dumps(report, indent=None))


if __name__ == "__main__":
    main()
