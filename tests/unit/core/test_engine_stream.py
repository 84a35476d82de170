"""Reading SGLang's /generate stream lines: deltas from cumulative chunks, and a clear
``EngineError`` for a line that is not a generate chunk."""

from __future__ import annotations

import pytest

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
