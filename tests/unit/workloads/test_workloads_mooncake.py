"""Prompt arithmetic of the trace generators: prefix ids, partial blocks, ordering."""

from __future__ import annotations

from thunderagent.workloads.mooncake import (
    BlockIds,
    Prompt,
    TraceRow,
    in_order,
    make_row,
    start_prompt,
)

BS = 4


def test_extend_keeps_full_blocks_and_renames_the_partial_one() -> None:
    ids = BlockIds()
    a = start_prompt(10, ids, BS)  # 2 full blocks + 2 tokens
    assert a == Prompt((0, 1), 10)
    b = a.extend(7, ids, BS)  # 17 tokens: 4 full blocks; block 2 now holds new content
    assert b.full[:2] == a.full and b.full == (0, 1, 2, 3) and b.tokens == 17
    c = a.extend(7, ids, BS)  # the same prefix, other new content: other ids past it
    assert c.full[:2] == a.full and set(c.full[2:]).isdisjoint(b.full)


def test_row_hash_ids_cover_the_prompt_and_tails_are_never_shared() -> None:
    ids = BlockIds()
    p = start_prompt(10, ids, BS)
    r1, r2 = make_row(0.0, p, 5, ids, BS), make_row(1.0, p, 5, ids, BS)
    assert len(r1.hash_ids) == 3 and r1.hash_ids[:2] == r2.hash_ids[:2]
    assert r1.hash_ids[2] != r2.hash_ids[2]
    aligned = make_row(0.0, start_prompt(8, ids, BS), 1, ids, BS)
    assert len(aligned.hash_ids) == 2


def test_in_order_sorts_stably_and_starts_at_zero() -> None:
    rows = [TraceRow(500, 1, 1, [i]) for i in range(3)] + [TraceRow(200, 1, 1, [9])]
    assert in_order(rows) == 200
    assert [r.timestamp_ms for r in rows] == [0, 300, 300, 300]
    assert [r.hash_ids[0] for r in rows] == [9, 0, 1, 2]


def test_json_line_has_the_mooncake_fields_and_only_the_extras_in_use() -> None:
    plain = TraceRow(7, 10, 3, [1, 2, 3]).as_json()
    assert plain == {"timestamp": 7, "input_length": 10, "output_length": 3, "hash_ids": [1, 2, 3]}
    agent = TraceRow(7, 10, 3, [1], program_id="p", step=2, hot=True).as_json()
    assert agent["program_id"] == "p" and agent["step"] == 2 and agent["hot"] is True
