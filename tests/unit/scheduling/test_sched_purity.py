"""Scheduling policies and workloads are pure: no event loop, sockets, brokers or clock."""

import ast
from pathlib import Path

import pytest

import thunderagent.scheduling as scheduling
import thunderagent.workloads as workloads

FORBIDDEN = {"asyncio", "nats", "redis", "aiohttp", "zmq", "socket", "time", "threading"}


@pytest.mark.parametrize("package", [scheduling, workloads])
def test_modules_import_no_io(package) -> None:
    for path in Path(package.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            for name in names:
                assert name.split(".")[0] not in FORBIDDEN, f"{path.name} imports {name}"
