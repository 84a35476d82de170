"""The coding-assistant and retrieval-augmented generators: the sharing each one promises."""

from __future__ import annotations

from collections import Counter, defaultdict

from thunderagent.workloads.tracegen import generate


def test_coding_sessions_share_their_repository_and_extend_their_own_turns() -> None:
    params, trace = generate("coding", 3, 0.5)
    bs, rows = params.block_size, trace.rows
    repo_blocks = trace.meta["repo_blocks"]
    assert len(repo_blocks) == params.repos
    assert all(
        params.repo_tokens_min // bs <= n <= params.repo_tokens_max // bs for n in repo_blocks
    )
    # a row's leading blocks are one repository's whole context; popular ones carry most rows
    starts = Counter(r.hash_ids[0] for r in rows)
    assert len(starts) <= params.repos
    top = sum(n for _, n in starts.most_common(params.repos // 6))
    assert top > len(rows) / 3
    # later turns extend an earlier row past its repository: a turn's prompt holds the last one
    full = {tuple(r.hash_ids[: r.input_length // bs]) for r in rows}
    grown = sum(
        any(tuple(r.hash_ids[:k]) in full for k in range(len(r.hash_ids) - 1, 0, -1)
            if k > min(repo_blocks))
        for r in rows
    )  # fmt: skip
    assert grown > len(rows) // 2
    assert sum(r.input_length for r in rows) / len(rows) > params.repo_tokens_min


def test_rag_requests_share_as_far_as_tenant_and_leading_documents_agree() -> None:
    params, trace = generate("rag", 2, 0.25)
    rows = trace.rows
    bs = params.block_size
    by_first: dict[int, set[int]] = defaultdict(set)
    for r in rows:
        by_first[r.hash_ids[0]].add(len(r.hash_ids))
    assert 1 < len(by_first) <= params.tenants  # every prompt opens with a tenant's prompt
    # one id names one prefix: rows that agree on a block agree on every block before it
    seen: dict[int, tuple[int, ...]] = {}
    for r in rows:
        for i, h in enumerate(r.hash_ids[: r.input_length // bs]):
            prefix = tuple(r.hash_ids[:i])
            assert seen.setdefault(h, prefix) == prefix
    # reuse: popular documents make blocks past the system prompts recur
    count = Counter(h for r in rows for h in set(r.hash_ids))
    deep = [h for r in rows for h in r.hash_ids[params.system_blocks_max :] if count[h] > 1]
    assert len(deep) > len(rows)
    assert trace.meta["distinct_prefixes"] < sum(len(r.hash_ids) for r in rows)


def test_rag_rate_swings_over_its_period() -> None:
    _, trace = generate("rag", 0, 1.0, {"rate_period_s": 300.0, "rate_swing": 0.8})
    per_period = Counter(int(r.timestamp_ms / 1000 // 75) % 4 for r in trace.rows)
    # sin is high in the first quarter of each period, low in the third
    assert per_period[0] > 2 * per_period[2]
