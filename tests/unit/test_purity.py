"""The pure layer stays pure: no event loop, sockets, brokers, threads or clock in ``libs``'
logic packages (STYLE: three layers, one direction). Shells inject time and do the I/O."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

FORBIDDEN = {"asyncio", "nats", "redis", "aiohttp", "zmq", "socket", "time", "threading"}

PURE_PACKAGES = [
    "thunderagent.engine",
    "thunderagent.hashing",
    "thunderagent.hotness",
    "thunderagent.prefix_index",
    "thunderagent.registry",
    "thunderagent.replay",
    "thunderagent.routing",
    "thunderagent.scheduling",
    "thunderagent.workloads",
]
EXEMPT = {"replay_smoke.py"}
"""Command-line entry points inside a pure package: they time themselves."""


def imported_roots(path: Path) -> set[str]:
    roots = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            roots.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            roots.add(node.module.split(".")[0])
    return roots


@pytest.mark.parametrize("package", PURE_PACKAGES)
def test_pure_packages_import_no_io(package: str) -> None:
    folder = Path(importlib.import_module(package).__file__).parent
    offenders = {
        path.name: sorted(imported_roots(path) & FORBIDDEN)
        for path in folder.glob("*.py")
        if path.name not in EXEMPT and imported_roots(path) & FORBIDDEN
    }
    assert not offenders, f"{package} does I/O or reads a clock: {offenders}"
