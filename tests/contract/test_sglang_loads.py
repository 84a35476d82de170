"""Contract: the load answer of SGLang 0.5.23 (`/v1/loads`, one `LoadSnapshot` per rank, built
and serialised by SGLang's own class) reads as the adapter expects, and the simulated engine
serves the same fields under the same names.

Needs `pip install --no-deps sglang==0.5.23`; skipped otherwise (see `sglang_shim.py`).
"""

from __future__ import annotations

from types import ModuleType

import pytest
from sglang_shim import SGLANG_VERSION, load_load_snapshot, sglang_version

from thunderagent.engine import EngineLoad
from thunderagent.sglang.load import parse_v1_loads, v1_loads_payload

_installed = sglang_version()
pytestmark = pytest.mark.skipif(
    _installed != SGLANG_VERSION,
    reason=f"needs sglang=={SGLANG_VERSION} (found {_installed})",
)


@pytest.fixture(scope="module")
def snapshots() -> ModuleType:
    return load_load_snapshot()


def test_sglangs_own_answer_reads_as_its_ranks_summed(snapshots: ModuleType) -> None:
    ranks = [
        snapshots.LoadSnapshot(dp_rank=r, num_running_reqs=3 + r, num_waiting_reqs=r,
                               num_used_tokens=640 * (r + 1), max_total_num_tokens=16_000)
        for r in range(2)
    ]  # fmt: skip
    # what the endpoint returns (sglang/srt/entrypoints/v1_loads.py), for our `include=core`
    answer = {"timestamp": "t", "version": SGLANG_VERSION, "accelerator": "H100",
              "num_accelerators": 1, "loads": [s.to_dict({"core"}) for s in ranks]}  # fmt: skip
    figures = parse_v1_loads(answer, block_size=16)
    assert (figures.running, figures.queued, figures.num_tokens) == (7, 1, 1_920)
    assert (figures.kv_used_blocks, figures.kv_total_blocks) == (120, 2_000)


def test_the_simulated_engine_uses_sglangs_field_names(snapshots: ModuleType) -> None:
    ours = v1_loads_payload(EngineLoad(2, 1, 10, 100, 160, 40, 0), block_size=16)["loads"][0]
    theirs = set(snapshots.LoadSnapshot.__struct_fields__)
    extras = {"kv_used_blocks", "kv_total_blocks", "cached_blocks"}  # what SGLang cannot know
    assert set(ours) - extras <= theirs, set(ours) - extras - theirs
