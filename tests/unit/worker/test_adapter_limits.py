"""What the adapter registers as the engine's request limit, read from SGLang's server info."""

from __future__ import annotations

import pytest

from thunderagent.worker.adapter import _context_length


@pytest.mark.parametrize(
    ("info", "limit"),
    [
        # stock SGLang: no override; the longest prompt is one less than context or pool
        ({"context_length": None, "max_req_input_len": 32767, "max_total_num_tokens": 10**6},
         32768),
        # --context-length given: it holds, unless the KV pool is smaller still
        ({"context_length": 8192, "max_req_input_len": 8186, "max_total_num_tokens": 10**6},
         8192),
        ({"context_length": 131072, "max_req_input_len": 4095, "max_total_num_tokens": 4096},
         4096),
        ({"context_length": 8192}, 8192),
        ({"max_total_num_tokens": 512}, 512),
        ({}, 0),  # unknown: not checked
    ],
)  # fmt: skip
def test_the_registered_limit_is_the_smaller_of_what_the_engine_reports(info, limit) -> None:
    assert _context_length(info) == limit
