"""Ports for children are chosen where the kernel does not hand out ports by itself."""

from __future__ import annotations

import socket

from thunderagent.embedded.ports import _ephemeral_start, free_port, port_is_free


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
