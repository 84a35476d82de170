"""The engine package is pure logic: no event loop, sockets or brokers."""

import ast
from pathlib import Path

import thunderagent.engine as engine

FORBIDDEN = {"asyncio", "nats", "redis", "aiohttp", "zmq", "socket", "time", "threading"}


def test_engine_modules_import_no_io() -> None:
    root = Path(engine.__file__).parent
    for path in root.glob("*.py"):
        if path.name == "replay_smoke.py":  # the CLI reads a file and times itself
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            for name in names:
                assert name.split(".")[0] not in FORBIDDEN, f"{path.name} imports {name}"
