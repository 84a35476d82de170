"""``thunderagent bench expiry`` on a small fleet: every figure is there, and the expiry it
times reads the re-announced lists (every block confirmed again, none dropped)."""

from __future__ import annotations

import json
from pathlib import Path

from thunderagent.bench import expiry


def test_the_expiry_benchmark_times_every_call(tmp_path: Path, capsys) -> None:
    out = tmp_path / "expiry.json"
    expiry.main(["--workers", "2", "--blocks", "640", "--duration", "900", "--json", str(out)])
    r = json.loads(out.read_text())
    assert r["expire_calls"] == 900
    assert 0 <= r["expire_p99_ms"] <= r["expire_max_ms"] and r["expire_max_ms"] > 0
    assert r["expired_blocks"] == 0  # re-announced every 120 s: nothing outlives its TTL
    assert r["announce_apply_max_ms"] > 0
    assert len(capsys.readouterr().out.splitlines()) == 1


def test_a_cache_never_re_announced_expires_whole() -> None:
    r = expiry.measure(workers=1, blocks=640, duration_s=700, refresh_s=1e9, tick_s=1)
    assert r["expired_blocks"] == 640
