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
    "thunderagent.tokenizer",
    "thunderagent.plugins",
    "thunderagent.router_core",
    "thunderagent.stats",
    "thunderagent.prefix_index",
    "thunderagent.fleet",
    "thunderagent.replay",
    "thunderagent.routing",
    "thunderagent.scheduling",
    "thunderagent.workloads",
]


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
        if imported_roots(path) & FORBIDDEN
    }
    assert not offenders, f"{package} does I/O or reads a clock: {offenders}"
