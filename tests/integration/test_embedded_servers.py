"""The embedded nats-server's runtime setting: one Go thread unless the environment says
otherwise (what the stack, the benchmarks and these tests all run)."""

from __future__ import annotations

from pathlib import Path

import pytest

from thunderagent.embedded import NatsServer, nats_gomaxprocs

pytestmark = pytest.mark.integration


def _gomaxprocs(server: NatsServer) -> str | None:
    assert server.child is not None
    raw = Path(f"/proc/{server.child.pid}/environ").read_bytes()
    pairs = dict(item.split(b"=", 1) for item in raw.split(b"\0") if b"=" in item)
    value = pairs.get(b"GOMAXPROCS")
    return value.decode() if value is not None else None


@pytest.mark.parametrize(
    ("outside", "go_procs", "expected"),
    [(None, 1, "1"), (None, None, None), ("2", 1, "2")],
    ids=["default", "go-default", "environment-wins"],
)
def test_the_nats_server_runs_on_the_threads_it_is_given(
    tmp_path, monkeypatch, outside, go_procs, expected
) -> None:
    if outside is None:
        monkeypatch.delenv("GOMAXPROCS", raising=False)
    else:
        monkeypatch.setenv("GOMAXPROCS", outside)
    server = NatsServer(tmp_path / "nats", go_procs=go_procs).start()
    try:
        assert _gomaxprocs(server) == expected
        assert nats_gomaxprocs(go_procs) == (expected or "default"), "what reports record"
    finally:
        server.stop()
