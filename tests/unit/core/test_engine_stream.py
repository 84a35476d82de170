"""Reading SGLang's /generate stream lines: deltas from cumulative chunks, lines that arrived
together merged into one chunk, and a clear ``EngineError`` for a line that is not a generate
chunk."""

from __future__ import annotations

import itertools

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from thunderagent.worker.engine_client import EngineError, _Deltas


def test_cumulative_chunks_become_deltas() -> None:
    deltas = _Deltas()
    first = deltas.next(
        b'{"output_ids": [1, 2], "text": "ab", "meta_info": {"completion_tokens": 2}}'
    )
    second = deltas.next(
        b'{"output_ids": [1, 2, 3], "text": "abc", "meta_info": {"completion_tokens": 3}}'
    )
    assert first is not None and first.new_token_ids == [1, 2] and first.new_text == "ab"
    assert second is not None and second.new_token_ids == [3] and second.new_text == "c"
    assert deltas.next(b"[DONE]") is None and deltas.done


@pytest.mark.parametrize(
    "line",
    [
        b"not json",
        b"[1, 2]",
        b'{"output_ids": 5}',
        b'{"output_ids": [1], "text": 7}',
        b'{"output_ids": [1], "meta_info": ["x"]}',
    ],
)
def test_a_line_that_is_not_a_generate_chunk_is_an_engine_error(line: bytes) -> None:
    with pytest.raises(EngineError):
        _Deltas().next(line)


def _stream_lines(outputs: list[list[int]], cumulative: bool) -> list[bytes]:
    """SGLang's SSE lines for a run whose steps produced ``outputs``, then ``[DONE]``."""
    lines, ids = [], []
    for i, step in enumerate(outputs):
        ids = ids + step
        sent = ids if cumulative else step
        text = "".join(chr(97 + t % 26) for t in sent)
        meta = {"completion_tokens": len(ids)}
        if i == len(outputs) - 1:
            meta["finish_reason"] = {"type": "length"}
        body = msgspec.json.encode({"output_ids": sent, "text": text, "meta_info": meta})
        lines += [b"data: " + body, b""]
    return [*lines, b"data: [DONE]", b""]


@settings(max_examples=200, deadline=None)
@given(
    outputs=st.lists(st.lists(st.integers(0, 99), min_size=1, max_size=3), min_size=1, max_size=8),
    cuts=st.lists(st.integers(0, 30), max_size=10),
    cumulative=st.booleans(),
)
def test_lines_that_arrive_together_become_one_chunk_of_the_same_tokens(
    outputs: list[list[int]], cuts: list[int], cumulative: bool
) -> None:
    lines = _stream_lines(outputs, cumulative)
    bounds = sorted({0, len(lines), *(c % (len(lines) + 1) for c in cuts)})
    batches = [lines[a:b] for a, b in itertools.pairwise(bounds)]
    deltas = _Deltas()
    chunks = [c for c in map(deltas.merged, batches) if c is not None]
    expect = [t for step in outputs for t in step]
    assert [t for c in chunks for t in c.new_token_ids] == expect
    assert "".join(c.new_text for c in chunks) == "".join(chr(97 + t % 26) for t in expect)
    assert chunks[-1].finished and not any(c.finished for c in chunks[:-1])
    # one chunk per batch that held a data line: nothing is split, nothing held back
    assert len(chunks) == sum(any(x.startswith(b"data: {") for x in b) for b in batches)
    assert deltas.done
