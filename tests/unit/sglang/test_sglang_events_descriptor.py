"""``/server_info``'s ``kv_events``: the publisher as SGLang 0.5.23 advertises it to routers,
built from the events config the engine runs with."""

from __future__ import annotations

import pytest

from thunderagent.sglang.zmq_publisher import KvEventsConfig
from thunderagent.worker.engine_info import dp_size


def test_a_tcp_publisher_is_described_with_its_ports_block_and_ranks() -> None:
    config = KvEventsConfig(publisher="zmq", endpoint="tcp://*:5557",
                            replay_endpoint="tcp://*:5558", topic="kv")  # fmt: skip
    described = config.descriptor(block_size=64, dp_size=2)
    assert described == {
        "publisher": "zmq", "endpoint_host": "*", "endpoint_port_base": 5557, "topic": "kv",
        "block_size": 64, "dp_size": 2, "replay_endpoint_port_base": 5558,
    }  # fmt: skip
    assert dp_size({"kv_events": described, "dp_size": 1}) == 2, "the adapter reads it first"


@pytest.mark.parametrize(
    "config",
    [
        KvEventsConfig(),  # publisher "null"
        KvEventsConfig(publisher="zmq", endpoint="ipc:///tmp/kv"),
        KvEventsConfig(publisher="zmq", endpoint="tcp://127.0.0.1:*"),  # no port bound yet
    ],
)
def test_nothing_a_router_could_dial_is_not_described(config) -> None:
    assert config.descriptor(block_size=16, dp_size=1) is None


def test_no_replay_socket_no_replay_port() -> None:
    config = KvEventsConfig(publisher="zmq", endpoint="tcp://10.0.0.5:6000")
    assert "replay_endpoint_port_base" not in config.descriptor(block_size=16, dp_size=1)
