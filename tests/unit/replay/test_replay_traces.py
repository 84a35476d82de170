"""Trace loaders: Mooncake JSONL and Azure CSV, including malformed lines."""

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from thunderagent.replay import TraceError, TraceRequest, load_azure, load_mooncake, load_trace
from thunderagent.replay.traces import AZURE_ID_BASE, jitter_arrivals

ROWS = [
    {"timestamp": 1000, "input_length": 1100, "output_length": 5, "hash_ids": [0, 1, 2]},
    {"timestamp": 0, "input_length": 600, "output_length": 0, "hash_ids": [0, 3]},
    {
        "timestamp": 1000,
        "input_length": 10,
        "output_length": 2,
        "hash_ids": [7],
        "session_id": "s1",
        "step": 2,
    },
]


def write_jsonl(tmp_path: Path, lines: list[str]) -> Path:
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_mooncake_rows_in_arrival_order_with_seconds(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path, [json.dumps(r) for r in ROWS[:2]] + ["", json.dumps(ROWS[2])])
    reqs = load_mooncake(path)
    assert [r.request_id for r in reqs] == ["1", "0", "2"]  # sorted, stable on ties
    assert [r.arrival for r in reqs] == [0.0, 1.0, 1.0]
    assert reqs[0].output_len == 1  # zero output becomes one token
    assert reqs[1].block_ids == [0, 1, 2]
    assert (reqs[2].session, reqs[2].step) == ("s1", 2)
    assert [r.request_id for r in load_trace(path, limit=2)] == ["1", "0"]


@pytest.mark.parametrize(
    ("bad", "reason"),
    [
        ("{not json", "not JSON: Expecting property name enclosed in double quotes at column 2"),
        ('{"timestamp": 0,', "not JSON: Expecting property name"),  # cut short: no "line 2"
        (
            '{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1, 2]}',
            "2 hash_ids for 10 prompt tokens: more than one per 512-token block",
        ),
        ('{"timestamp": 0, "input_length": 5, "output_length": 1}', "missing field 'hash_ids'"),
        ('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [-1]}', "hash_ids"),
        ('{"timestamp": 0, "input_length": 0, "output_length": 1, "hash_ids": []}', ">= 1"),
        ('{"timestamp": -5, "input_length": 5, "output_length": 1, "hash_ids": []}', "timestamp"),
        ('{"timestamp": 0, "input_length": "5", "output_length": 1, "hash_ids": []}', "integer"),
        ("[1, 2]", "JSON object"),
    ],
)
def test_mooncake_malformed_line_names_file_and_line(tmp_path: Path, bad: str, reason: str) -> None:
    path = write_jsonl(tmp_path, [json.dumps(ROWS[0]), "", bad])
    with pytest.raises(TraceError) as info:
        load_mooncake(path)
    assert info.value.line == 3
    assert str(info.value).startswith(f"{path}:3: ")
    assert reason in info.value.reason and "line 2" not in info.value.reason


def test_hash_ids_are_checked_against_the_replay_block_size(tmp_path: Path) -> None:
    row = {"timestamp": 0, "input_length": 1024, "output_length": 1, "hash_ids": [1, 2]}
    path = write_jsonl(tmp_path, [json.dumps(row)])
    assert load_trace(path, block_size=512)[0].block_ids == [1, 2]
    with pytest.raises(TraceError, match="per 1024-token block"):
        load_trace(path, block_size=1024)


AZURE = """TIMESTAMP,ContextTokens,GeneratedTokens
2023-11-16 18:17:03.9799600,1200,10
2023-11-16 18:17:04.0319600,300,8
2023-11-16 18:17:03.5000000,512,0
"""


def test_azure_rows_get_unique_blocks_and_relative_times(tmp_path: Path) -> None:
    path = tmp_path / "a.csv"
    path.write_text(AZURE)
    reqs = load_trace(path, block_size=512)
    assert [r.request_id for r in reqs] == ["2", "0", "1"]
    assert [round(r.arrival, 6) for r in reqs] == [0.0, 0.47996, 0.53196]
    blocks = [r.block_ids for r in reqs]
    assert [len(b) for b in blocks] == [1, 3, 1]
    flat = [b for bs in blocks for b in bs]
    assert len(set(flat)) == len(flat) and min(flat) == AZURE_ID_BASE
    assert reqs[0].output_len == 1


@pytest.mark.parametrize(
    ("row", "reason"),
    [
        ("2023-11-16 18:17:05.1,abc,3", "invalid literal"),
        ("2023-11-16 18:17:05.1,10", "3 columns"),
        ("yesterday,10,3", "does not match"),
        ("2023-11-16 18:17:05.1,0,3", "bad lengths"),
    ],
)
def test_azure_malformed_line_names_line(tmp_path: Path, row: str, reason: str) -> None:
    path = tmp_path / "a.csv"
    path.write_text(AZURE + row + "\n")
    with pytest.raises(TraceError) as info:
        load_azure(path)
    assert info.value.line == 5
    assert reason in info.value.reason


def test_azure_wrong_header(tmp_path: Path) -> None:
    path = tmp_path / "a.csv"
    path.write_text("time,ctx,gen\n1,2,3\n")
    with pytest.raises(TraceError, match=r"a\.csv:1: expected header"):
        load_azure(path)


@pytest.mark.parametrize("name", ["missing.jsonl", "missing.csv", "folder.jsonl", "binary.jsonl"])
def test_a_file_that_cannot_be_read_is_a_trace_error_naming_it(tmp_path: Path, name: str) -> None:
    path = tmp_path / name
    if name.startswith("folder"):
        path.mkdir()
    if name.startswith("binary"):
        path.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(TraceError) as info:
        load_trace(path)
    assert info.value.line == 0 and str(info.value).startswith(f"{path}: cannot read the trace")


def _trace(arrivals: list[float], sessions: list[str | None]) -> list[TraceRequest]:
    return [
        TraceRequest(str(i), t, 16, 1, [i], session=s)
        for i, (t, s) in enumerate(zip(arrivals, sessions, strict=True))
    ]


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(st.floats(0, 5, allow_nan=False), st.sampled_from([None, "a", "b", "c"])),
        max_size=40,
    ).map(lambda rows: sorted(rows, key=lambda r: r[0])),
    st.floats(1e-4, 0.5, allow_nan=False),
    st.integers(0, 2**16),
)
def test_jittered_arrivals_keep_every_request_its_bound_and_each_session_in_order(
    rows, jitter_s, seed
) -> None:
    trace = _trace([t for t, _ in rows], [s for _, s in rows])
    out = jitter_arrivals(trace, jitter_s, seed)
    assert sorted(r.request_id for r in out) == sorted(r.request_id for r in trace)
    assert [r.arrival for r in out] == sorted(r.arrival for r in out)
    before = {r.request_id: r for r in trace}
    for r in out:
        old = before[r.request_id]
        assert r.arrival >= 0
        assert r.block_ids == old.block_ids and r.session == old.session
        # a request is moved by the draw, or later to stay behind its session's previous one
        assert r.arrival >= old.arrival - jitter_s - 1e-12
        if old.session is None:
            assert r.arrival <= old.arrival + jitter_s + 1e-12
    for s in ("a", "b", "c"):
        ids = [r.request_id for r in trace if r.session == s]
        assert [r.request_id for r in out if r.session == s] == ids
    assert out == jitter_arrivals(trace, jitter_s, seed)  # the seed decides
    assert [r.arrival for r in trace] == [t for t, _ in rows]  # the input is left as it was


def test_jitter_zero_is_the_trace_and_two_seeds_give_two_copies() -> None:
    trace = _trace([0.1 * i for i in range(50)], [None] * 50)
    assert jitter_arrivals(trace, 0.0, 3) == trace
    a, b = jitter_arrivals(trace, 0.001, 1), jitter_arrivals(trace, 0.001, 2)
    assert [r.arrival for r in a] != [r.arrival for r in b]
    assert max(abs(x.arrival - y.arrival) for x, y in zip(a, trace, strict=True)) <= 0.001
