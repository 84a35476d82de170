"""The /metrics text of a fresh Python process that set up the project's telemetry (metrics on
a free port) and then ran a snippet: what a service exports, without starting the service."""

from __future__ import annotations

import subprocess
import sys
import textwrap

_BEFORE = """
import urllib.request
from thunderagent.telemetry.setup import setup_telemetry
tel = setup_telemetry("thunderagent-probe", metrics_port=0)
"""
_AFTER = """
print(urllib.request.urlopen(f"http://127.0.0.1:{tel.metrics_port}/metrics").read().decode())
tel.shutdown()
"""


def scrape_after(snippet: str) -> str:
    code = _BEFORE + textwrap.dedent(snippet) + _AFTER
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    ).stdout
