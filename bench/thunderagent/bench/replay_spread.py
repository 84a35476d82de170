"""``bench replay --repeats N``: the whole sweep again on jittered copies of the trace (seeds
``S .. S+N-1``, ``--arrival-jitter-ms``), and the spread of each (policy, speed) cell's figures
over the copies.

Why: near a capacity edge a replay is chaotic. One decision made differently (a copy, a tie)
re-deals every later one, and a TTFT p99 moves by several percent with nothing else changed;
at one run per cell, a 2 % target cannot tell a change from that. The mean over jittered copies,
with its spread, can.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable

CELL_FIGURES: dict[str, Callable[[dict], float | None]] = {
    "ttft_p99_ms": lambda e: e["ttft_ms"]["p99"],
    "ttft_p50_ms": lambda e: e["ttft_ms"]["p50"],
    "wait_p99_ms": lambda e: e["queue_ms"]["p99"],
    "prefix_hit_ratio": lambda e: e["prefix_hit_ratio"],
    "hot_ttft_p99_ms": lambda e: e["hot"]["hot"]["ttft_p99_ms"] if "hot" in e else None,
}
"""What a cell reports over the copies, read from each run's JSON entry (None: not measured)."""


def stats(values: list[float]) -> dict:
    """Mean, sample standard deviation (0 for one value), min, max and the values."""
    return {
        "mean": statistics.fmean(values),
        "sd": statistics.stdev(values) if len(values) > 1 else 0.0,
        "min": min(values),
        "max": max(values),
        "values": values,
    }


def spread(docs: list[dict], seeds: list[int], jitter_ms: float | None) -> dict:
    """The ``repeats`` entry of the JSON: one row per (policy, speed) with each figure's stats
    over ``docs`` (one ``bench replay`` document per seed), and each policy's highest speed
    meeting the SLO in each copy."""
    cells: dict[tuple[str, float], list[dict]] = {}
    for doc in docs:
        for e in doc["results"]:
            cells.setdefault((e["policy"], e["speed"]), []).append(e)
    rows = []
    for (policy, speed), entries in cells.items():
        row: dict = {"policy": policy, "speed": speed, "runs": len(entries)}
        for name, read in CELL_FIGURES.items():
            values = [read(e) for e in entries]
            if all(v is not None for v in values):
                row[name] = stats(values)  # type: ignore[arg-type]
        rows.append(row)
    policies = dict.fromkeys(e["policy"] for doc in docs for e in doc["results"])
    return {
        "seeds": seeds,
        "arrival_jitter_ms": jitter_ms or 0.0,
        "cells": rows,
        "max_speed_meeting_slo": {
            p: [doc["capacity"][p]["max_speed_meeting_slo"] for doc in docs] for p in policies
        },
    }


def table(repeats: dict) -> str:
    """The cells as a markdown table: mean ± sample sd (min-max) over the copies."""
    lines = [
        f"Over {len(repeats['seeds'])} copies (seeds {repeats['seeds'][0]}-"
        f"{repeats['seeds'][-1]}, arrivals jittered by up to ±{repeats['arrival_jitter_ms']:g} "
        "ms of trace time):",
        "",
        "| policy | speed | TTFT p99 ms | wait p99 ms | hit | hot TTFT p99 ms |",
        "|---|---|---|---|---|---|",
    ]
    for row in repeats["cells"]:
        lines.append(
            f"| {row['policy']} | {row['speed']:g} | {_cell(row, 'ttft_p99_ms', '.0f')} "
            f"| {_cell(row, 'wait_p99_ms', '.0f')} | {_cell(row, 'prefix_hit_ratio', '.3f')} "
            f"| {_cell(row, 'hot_ttft_p99_ms', '.0f')} |"
        )
    return "\n".join([*lines, "", *_capacity_lines(repeats["max_speed_meeting_slo"])])


def _capacity_lines(per_copy: dict[str, list[float | None]]) -> list[str]:
    """Each policy's capacity over the copies: met in every copy, in at least half of them,
    and the count of copies at each (a cell on the edge meets the SLO in some copies only)."""
    lines = [
        "Capacity over the copies (the highest swept speed meeting the SLO in each):",
        "",
        "| policy | in every copy | in at least half | copies at each |",
        "|---|---|---|---|",
    ]
    for policy, speeds in per_copy.items():
        ranked = sorted(speeds, key=lambda s: -math.inf if s is None else s, reverse=True)
        half = ranked[(len(ranked) - 1) // 2]
        counts = ", ".join(f"{_speed(s)} in {speeds.count(s)}" for s in dict.fromkeys(ranked))
        lines.append(f"| {policy} | {_speed(ranked[-1])} | {_speed(half)} | {counts} |")
    return lines


def _speed(s: float | None) -> str:
    return "none swept" if s is None else f"{s:g}x"


def _cell(row: dict, name: str, fmt: str) -> str:
    s = row.get(name)
    if s is None:
        return "–"
    return f"{s['mean']:{fmt}} ± {s['sd']:{fmt}} ({s['min']:{fmt}}-{s['max']:{fmt}})"
