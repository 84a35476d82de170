"""What the adapter registers as the engine's request limit, read from SGLang's server info."""

from __future__ import annotations

import pytest

from thunderagent.worker.adapter import _context_length


@pytest.mark.parametrize(
    ("info", "limit"),
    [
        # stock SGLang: no override; the longest prompt is one less than context or pool
        ({"context_length": None, "max_req_input_len": 32767}, 32768),
        # --context-length given, the KV pool smaller still: the pool bounds it
        ({"context_length": 131072, "max_req_input_len": 4095}, 4096),
        ({"context_length": 8192, "max_req_input_len": 131071}, 8192),
        ({"context_length": 8192}, 8192),
        ({}, 0),  # unknown: not checked
    ],
)
def test_the_registered_limit_is_the_smaller_of_what_the_engine_reports(info, limit) -> None:
    assert _context_length(info) == limit
