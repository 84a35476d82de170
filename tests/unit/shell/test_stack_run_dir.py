"""What a stopped stack leaves in its run folder: logs and credentials always; the NATS
server's JetStream store (megabytes of KV events per run) only in a folder the caller named."""

from __future__ import annotations

from pathlib import Path

import pytest

from thunderagent.stack.up import Stack, StackConfig


@pytest.mark.parametrize("named", [False, True])
def test_a_stopped_stack_keeps_its_logs_and_drops_the_streams_of_its_own_folder(
    tmp_path: Path, named: bool
) -> None:
    store = tmp_path / "nats" / "jetstream" / "stream"
    store.mkdir(parents=True)
    (store / "1.blk").write_bytes(b"x" * 1024)
    (tmp_path / "nats" / "nats-server.log").write_text("log")
    (tmp_path / "router-0.log").write_text("log")
    config = StackConfig(run_dir=tmp_path if named else None)
    Stack(config=config, run_dir=tmp_path).stop()
    assert (tmp_path / "router-0.log").exists() and (tmp_path / "nats" / "nats-server.log").exists()
    assert (tmp_path / "nats" / "jetstream").exists() == named
