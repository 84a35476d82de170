"""``thunderagent bench mirror`` on a small cache: every figure is there and the export it
times finds the whole chain (the benchmark refuses to print a figure for a wrong answer)."""

from __future__ import annotations

import json
from pathlib import Path

from thunderagent.bench import mirror


def test_the_mirror_benchmark_times_stores_removals_and_an_export(tmp_path: Path, capsys) -> None:
    out = tmp_path / "mirror.json"
    mirror.main(["--blocks", "300,1000", "--chain", "64", "--json", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [r["blocks"] for r in rows] == [300, 1000]
    assert all(r["export_chain_blocks"] == 64 for r in rows)
    timed = ("store_us_per_block_1_per_event", "store_us_per_block_16_per_event",
             "remove_us_per_block", "export_leading_run_us", "export_chain_to_us", "dump_ms",
             "dump_longest_piece_ms", "dump_decode_ms")  # fmt: skip
    assert all(r[key] > 0 for r in rows for key in timed)
    # the re-announcement: one event per 64-block chain, every block in it
    assert [r["dump_events"] for r in rows] == [5, 16]
    assert all(r["dump_bytes"] > 40 * r["blocks"] and r["dump_apply_ms"] >= 0 for r in rows)
    assert len(capsys.readouterr().out.splitlines()) == 2


def test_the_events_chain_from_the_root_every_64_blocks() -> None:
    events = mirror.stored_events(130, 16)
    assert sum(len(e.block_hashes) for e in events) == 130
    roots = [e for e in events if e.parent_block_hash is None]
    assert len(roots) == 3  # blocks 0, 64 and 128 start chains
    assert all(len(e.token_ids) == len(e.block_hashes) * mirror.PAGE for e in events)
