"""An engine in SGLang's PD mode (``disaggregation_mode``), as its worker adapter reads it: the
worker's role, the prefill engine's bootstrap port, and the runs such an engine cannot take."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

from thunderagent.schemas import WorkerGenerate, WorkerRole


class PdMode(NamedTuple):
    mode: str
    """``prefill``, ``decode`` or ``null`` (a whole engine)."""
    role: WorkerRole
    bootstrap_port: int
    """A prefill engine's KV bootstrap port (0: none)."""


def pd_mode(info: Mapping[str, Any], configured: WorkerRole) -> PdMode:
    """The engine's PD mode from its ``/server_info``: it gives the worker its role, which
    ``--role`` (``configured``) may only repeat. Raises ``RuntimeError`` saying why not."""
    mode = str(info.get("disaggregation_mode") or "null")
    if mode not in ("prefill", "decode"):
        return PdMode("null", configured, 0)
    if configured not in (WorkerRole.BOTH, mode):
        raise RuntimeError(f"the engine runs SGLang's PD {mode} mode; the worker was started "
                           f"with --role {configured.value}")  # fmt: skip
    port = 0
    if mode == "prefill":
        port = int(info.get("disaggregation_bootstrap_port") or 0)
        if port <= 0:
            raise RuntimeError("the engine runs SGLang's PD prefill mode but reports no "
                               "disaggregation_bootstrap_port")  # fmt: skip
    return PdMode(mode, WorkerRole(mode), port)


def pd_refusal(mode: str, work: WorkerGenerate) -> str:
    """Why an engine in PD ``mode`` cannot take ``work`` ("" when it can): a prefill engine
    only runs paired with a decode worker, a decode engine only takes a pairing."""
    if mode == "prefill" and not work.decode_worker:
        return "its engine runs SGLang's PD prefill mode: a run needs a decode worker"
    if mode == "decode" and work.bootstrap is None:
        return "its engine runs SGLang's PD decode mode: a run needs a prefill pairing"
    if mode != "decode" and work.bootstrap is not None:
        return "its engine is not in SGLang's PD decode mode: it cannot take a pairing"
    return ""
