"""Ports for children are chosen where the kernel does not hand out ports by itself."""

from __future__ import annotations

import socket

import pytest

from thunderagent.embedded import ports
from thunderagent.embedded.ports import _ephemeral_start, free_port, port_is_free

pytestmark = pytest.mark.integration  # binds the ports it checks: one test process at a time


def test_free_ports_lie_below_the_ephemeral_range_and_are_free() -> None:
    top = _ephemeral_start()
    ports = [free_port() for _ in range(50)]
    if top > 11_000:  # else the range leaves no room below it: the kernel's pick is used
        assert all(10_000 <= p < top for p in ports)
    assert all(port_is_free(p) for p in ports)


def test_a_port_taken_is_not_free() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        assert not port_is_free(sock.getsockname()[1])


def test_ports_handed_out_before_any_is_bound_differ(monkeypatch) -> None:
    """Two picks in a row, neither bound yet (an engine's KV-event and replay sockets), never
    name the same port: forced here by a draw that repeats itself."""
    if _ephemeral_start() <= 11_000:
        pytest.skip("no room below the ephemeral range: the kernel picks the ports")
    draws = iter([20_000, 20_000, 20_001])
    monkeypatch.setattr(ports.random, "SystemRandom", lambda: _Draw(draws))
    monkeypatch.setattr(ports, "port_is_free", lambda port, host="127.0.0.1": True)
    monkeypatch.setattr(ports, "_handed_out", ports.deque(maxlen=8))
    assert [free_port(), free_port()] == [20_000, 20_001]


class _Draw:
    def __init__(self, draws) -> None:
        self.draws = draws

    def randrange(self, low: int, high: int) -> int:
        return next(self.draws)


def test_ports_come_from_the_range_the_environment_names(monkeypatch) -> None:
    """THUNDERAGENT_PORTS confines every pick, the usual ports included (two test runners on one
    machine, each with its own slice)."""
    monkeypatch.setenv(ports.PORTS_ENV, "23000-23100")
    picked = [free_port() for _ in range(20)]
    assert all(23_000 <= p < 23_100 for p in picked)
    assert len(set(picked)) == len(picked)
    assert 23_000 <= ports.preferred_port(4222) < 23_100
    inside = free_port()
    assert ports.preferred_port(inside) == inside


@pytest.mark.parametrize("value", ["23000", "a-b", "23100-23000", "80-90", "1-2-3"])
def test_a_malformed_range_is_a_clear_error(monkeypatch, value: str) -> None:
    monkeypatch.setenv(ports.PORTS_ENV, value)
    with pytest.raises(ValueError, match=ports.PORTS_ENV):
        free_port()


def test_a_full_range_is_an_error_not_a_port_outside_it(monkeypatch) -> None:
    monkeypatch.setenv(ports.PORTS_ENV, "23000-23002")
    monkeypatch.setattr(ports, "port_is_free", lambda port, host="127.0.0.1": False)
    with pytest.raises(RuntimeError, match="no free port in THUNDERAGENT_PORTS=23000-23002"):
        free_port()
