"""The migration planner is pure: no event loop, sockets, broker, threads or clock (the shell
and the replay pass ``now``), like every other decision core in libs."""

from __future__ import annotations

import ast
from pathlib import Path

import thunderagent.migration

FORBIDDEN = {"asyncio", "nats", "redis", "aiohttp", "zmq", "socket", "time", "threading", "random"}


def test_the_planner_imports_no_io() -> None:
    folder = Path(thunderagent.migration.__file__).parent
    offenders = {}
    for path in folder.glob("*.py"):
        roots = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                roots.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                roots.add(node.module.split(".")[0])
        if roots & FORBIDDEN:
            offenders[path.name] = sorted(roots & FORBIDDEN)
    assert not offenders, f"thunderagent.migration does I/O or reads a clock: {offenders}"
