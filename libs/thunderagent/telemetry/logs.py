"""One log format for every process (services and simulated engines alike)."""

from __future__ import annotations

import logging
import os


def configure_logging(name: str) -> None:
    level = os.environ.get("THUNDERAGENT_LOG_LEVEL", "INFO").upper()
    logging.basicConfig(
        level=level,
        format=f"%(asctime)s {name} %(levelname)s %(name)s: %(message)s",
    )
