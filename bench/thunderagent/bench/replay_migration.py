"""``thunderagent bench replay``'s migration options, hot-period window and migration table.

``--migration off|replicate|nixl`` runs the live migration planner in virtual time
(``thunderagent.replay.migration``); ``--migration-param FIELD=VALUE`` overrides one of its
``MigrationParams`` (repeatable); ``--hot-window START,END`` names the hot period in trace
seconds (default: the generator's sidecar ``.meta.json``, else the span of the ``hot`` rows).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from thunderagent.migration import MigrationParams, ParamError
from thunderagent.replay import Record, TraceRequest
from thunderagent.replay.hot import hot_summary, hot_ttft_floor_ms, shared_prefix_blocks
from thunderagent.replay.migration import MODES


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--migration", default="off", choices=MODES,
        help="KV migration planner: off, replicate (the target prefills the prefix: stock "
        "SGLang) or nixl (KV copied over the link)",
    )  # fmt: skip
    p.add_argument(
        "--migration-param", action="append", default=[],
        help="FIELD=VALUE override of the planner's MigrationParams (repeatable)",
    )  # fmt: skip
    p.add_argument(
        "--hot-window", type=_window, default=None,
        help="START,END trace seconds of the hot period (default: the trace's .meta.json, else "
        "the span of its hot rows)",
    )  # fmt: skip


def _window(text: str) -> tuple[float, float]:
    try:
        start, end = (float(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected START,END seconds: {text!r}") from None
    if not 0 <= start < end:
        raise argparse.ArgumentTypeError(f"need 0 <= START < END: {text!r}")
    return start, end


def overrides(items: list[str], p: argparse.ArgumentParser) -> dict:
    """``FIELD=VALUE`` (VALUE as JSON) -> MigrationParams overrides, checked now."""
    out: dict = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            p.error(f"--migration-param {item!r}: expected FIELD=VALUE")
        try:
            out[key] = json.loads(raw)
        except json.JSONDecodeError:
            p.error(f"--migration-param {item!r}: VALUE must be JSON (a number)")
    try:
        MigrationParams.from_dict(out)
    except (ParamError, TypeError) as err:
        p.error(str(err))
    return out


@dataclass(frozen=True, slots=True)
class HotPeriod:
    """The trace's hot period (trace seconds) and hot rows, for each run's ``hot`` entry."""

    window: tuple[float, float] | None
    hot_rows: Sequence[TraceRequest]
    prefix_prefill_s: float
    """A first prefill of the prefix every hot row shares, alone on a worker."""

    @classmethod
    def of(
        cls,
        args: argparse.Namespace,
        trace: Sequence[TraceRequest],
        alone_s: Callable[[int], float],
    ) -> HotPeriod:
        """``alone_s(tokens)``: seconds to prefill that many uncached tokens alone."""
        rows = [r for r in trace if r.hot]
        prefill_s = alone_s(shared_prefix_blocks(rows) * args.block_size)
        return cls(hot_window(args, trace), rows, prefill_s)

    def summary(self, records: Sequence[Record], speed: float) -> dict | None:
        """``hot_summary`` at ``speed``, plus ``floor_p99_ms`` when the trace marks hot rows:
        what no policy can beat, since nothing holds the prefix before its first prefill ends."""
        if self.window is None:
            return None
        ids = {r.request_id for r in self.hot_rows}
        out = hot_summary(records, ids, (self.window[0] / speed, self.window[1] / speed))
        if self.hot_rows:
            arrivals = [r.arrival / speed for r in self.hot_rows]
            out["floor_p99_ms"] = hot_ttft_floor_ms(arrivals, self.prefix_prefill_s)
        return out


def hot_window(args: argparse.Namespace, trace) -> tuple[float, float] | None:
    """The hot period in trace seconds: ``--hot-window``, else the generator's sidecar
    (``hot_start_s``/``hot_end_s``), else the span of the trace's hot rows; None: none."""
    if args.hot_window is not None:
        return args.hot_window
    from thunderagent.bench.gen import meta_path  # gen imports bench.replay, which imports us

    meta = meta_path(args.trace)
    if meta.is_file():
        try:
            doc = json.loads(meta.read_text())
            return float(doc["hot_start_s"]), float(doc["hot_end_s"])
        except (ValueError, KeyError, TypeError):
            pass  # not a hot-spot sidecar
    hot = [r.arrival for r in trace if r.hot]
    return (min(hot), max(hot) + 1e-6) if hot else None


COLUMNS = (
    "| policy | speed | migration | repl | migr | drop | drop refused | failed | GB moved "
    "| move s p50 | move s p99 | hot TTFT p50 | hot TTFT p99 | window p50 | window p99 "
    "| outside p50 | outside p99 | imbalance |"
)


def table(doc: dict) -> str:
    """Moves and the hot period per run (TTFT in ms; "-": no hot window)."""
    lines = [COLUMNS, "|" + "---|" * (COLUMNS.count("|") - 1)]
    for e in doc["results"]:
        hot = e.get("hot")
        ttft = []
        for part in ("hot", "in_window", "outside"):
            d = hot[part] if hot else None
            ttft += [f"{d['ttft_p50_ms']:.0f}", f"{d['ttft_p99_ms']:.0f}"] if d else ["-", "-"]
        x = e["transfer_s"]
        lines.append(
            f"| {e['policy']} | {e['speed']:g} | {e['migration']} | {e['replications']} "
            f"| {e['migrations']} | {e['drops']} | {e['drops_refused']} | {e['failed_moves']} "
            f"| {e['bytes_moved'] / 1e9:.1f} | {x['p50']:.3f} | {x['p99']:.3f} "
            f"| {' | '.join(ttft)} | {e['load_imbalance']:.3f} |"
        )
    return "\n".join(lines)


def shown(doc: dict) -> bool:
    """Whether the run had anything for the table (migration on, or a hot window)."""
    return doc["migration"] != "off" or doc["hot_window_s"] is not None
