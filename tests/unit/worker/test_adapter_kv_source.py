"""Where the adapter finds its engine's KV events, read from SGLang's ``/server_info``
(``kv_events_config``, with SGLang's defaults: no publisher unless it says "zmq", endpoint
``tcp://*:5557``), and the two ways an engine can publish nothing the adapter receives."""

from __future__ import annotations

import asyncio
import json
import logging

import pytest

from thunderagent.worker.adapter import AdapterConfig, WorkerAdapter


class _Engine:
    base_url = "http://10.0.0.7:30000"

    def __init__(self, events: dict | None) -> None:
        self.info = {"kv_events_config": json.dumps(events) if events is not None else None}

    async def get_json(self, path: str) -> dict:
        assert path == "/server_info"
        return self.info


def _source(events: dict | None, *, override: str | None = None, dp_rank: int | None = None):
    config = AdapterConfig(worker_id="w0", engine_url=_Engine.base_url,
                           kv_events_endpoint=override, dp_rank=dp_rank)  # fmt: skip
    adapter = WorkerAdapter(config, bus=None, engine=_Engine(events))  # type: ignore[arg-type]
    return asyncio.run(adapter._kv_event_source())


def test_a_wildcard_endpoint_is_reached_at_the_engines_host() -> None:
    events = {"publisher": "zmq", "endpoint": "tcp://*:5557", "topic": "kv",
              "replay_endpoint": "tcp://0.0.0.0:5558"}  # fmt: skip
    assert _source(events) == ("tcp://10.0.0.7:5557", "tcp://10.0.0.7:5558", "kv")
    assert _source({"publisher": "zmq"}) == ("tcp://10.0.0.7:5557", None, "")  # the default


@pytest.mark.parametrize("events", [None, {}, {"endpoint": "tcp://*:5557"}, {"publisher": "null"}])
def test_no_zmq_publisher_means_no_events_said_with_the_flag_to_set(events, caplog) -> None:
    with caplog.at_level(logging.WARNING):
        assert _source(events) is None
    assert '"publisher": "zmq"' in caplog.text


def test_a_publisher_that_connects_is_named_as_the_reason_nothing_arrives(caplog) -> None:
    with caplog.at_level(logging.WARNING):
        source = _source({"publisher": "zmq", "endpoint": "tcp://127.0.0.1:5557"})
    assert source is not None and "connects to tcp://127.0.0.1:5557" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING):  # it binds a concrete address when told to
        _source({"publisher": "zmq", "endpoint": "tcp://127.0.0.1:5557", "bind": True})
    assert "connects" not in caplog.text


def test_the_workers_own_setting_wins() -> None:
    assert _source(None, override="tcp://127.0.0.1:6000") == ("tcp://127.0.0.1:6000", None, "")


def test_a_data_parallel_rank_reads_the_ports_its_rank_publishes_on() -> None:
    """SGLang's rank r binds rank 0's ports + r (``offset_endpoint_port``; the contract test
    checks it against SGLang's own); rank 0 and an adapter of the whole engine read the base."""
    events = {"publisher": "zmq", "endpoint": "tcp://*:5557", "topic": "kv",
              "replay_endpoint": "tcp://*:6000"}  # fmt: skip
    assert _source(events, dp_rank=0) == _source(events) == (
        "tcp://10.0.0.7:5557", "tcp://10.0.0.7:6000", "kv",
    )  # fmt: skip
    assert _source(events, dp_rank=3) == ("tcp://10.0.0.7:5560", "tcp://10.0.0.7:6003", "kv")
    assert _source(None, override="tcp://127.0.0.1:6000", dp_rank=1)[0] == "tcp://127.0.0.1:6001"
