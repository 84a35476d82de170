"""Benchmark JSON is strict JSON: no NaN or Infinity for a reader like jq to refuse."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from thunderagent.bench.jsonfile import dumps, finite, write_json


def _strict(text: str) -> object:
    def refuse(name: str) -> None:
        raise ValueError(f"not JSON: {name}")

    return json.loads(text, parse_constant=refuse)


def test_non_finite_figures_are_written_as_null(tmp_path: Path) -> None:
    doc = {"p99": math.inf, "runs": [{"p50": math.nan, "n": 3}, (1.5, -math.inf)], "ok": True}
    path = tmp_path / "deep" / "out.json"
    write_json(path, doc)
    assert _strict(path.read_text()) == {
        "p99": None,
        "runs": [{"p50": None, "n": 3}, [1.5, None]],
        "ok": True,
    }
    assert doc["p99"] == math.inf  # the caller's document is left as it was


def test_finite_leaves_numbers_and_text_alone() -> None:
    assert finite({"a": 1, "b": 2.5, "c": "inf", "d": None}) == {
        "a": 1,
        "b": 2.5,
        "c": "inf",
        "d": None,
    }
    with pytest.raises(ValueError):
        _strict(json.dumps({"x": math.inf}))  # what json.dumps alone would have written


def test_what_the_benchmarks_print_is_strict_too() -> None:
    text = dumps({"added_p99_ms": math.nan, "rates": [math.inf, 2.0]}, indent=None)
    assert _strict(text) == {"added_p99_ms": None, "rates": [None, 2.0]}
    assert "\n" not in text
