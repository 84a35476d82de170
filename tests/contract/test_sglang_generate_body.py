"""Contract: every field the worker adapter sends to SGLang's ``/generate`` is a field of SGLang
0.5.23's ``GenerateReqInput`` (``sglang/srt/managers/io_struct.py``), including the PD pairing
(``bootstrap_host``, ``bootstrap_port``, ``bootstrap_room``) and the data-parallel rank, and the
server arguments the adapter reads for SGLang's PD mode are SGLang's.

The class is read from its source (``import sglang`` pulls in torch): its annotated fields, and
the types they admit for a single request. Needs ``pip install --no-deps sglang==0.5.23``;
skipped otherwise.
"""

from __future__ import annotations

import ast

import pytest
from sglang_shim import SGLANG_VERSION, sglang_root, sglang_version

from thunderagent.schemas import PdBootstrap
from thunderagent.worker.engine_client import EngineClient

_installed = sglang_version()
pytestmark = pytest.mark.skipif(
    _installed != SGLANG_VERSION,
    reason=f"needs sglang=={SGLANG_VERSION} (found {_installed})",
)


def _class_fields(relative: str, name: str) -> dict[str, str]:
    """Annotated field -> its annotation's source, of dataclass ``name`` in ``relative``."""
    root = sglang_root()
    assert root is not None
    tree = ast.parse((root / relative).read_text())
    cls = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == name)
    return {
        node.target.id: ast.unparse(node.annotation)
        for node in cls.body
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
    }


def test_every_field_of_a_paired_ranked_run_is_sglangs() -> None:
    fields = _class_fields("srt/managers/io_struct.py", "GenerateReqInput")
    pairing = PdBootstrap(host="10.0.0.7", port=8998, room=2**63 - 1, prefill_dp_rank=1)
    body = EngineClient("http://127.0.0.1:30000").for_rank(1).generate_body(
        "r1", [1, 2, 3], {"max_new_tokens": 4}, cache_salt="tenant-a", lora_name="sql",
        bootstrap=pairing,
    )  # fmt: skip
    assert set(body) <= set(fields), set(body) - set(fields)
    # one request's values where SGLang takes one value or a batch's list
    assert "str" in fields["bootstrap_host"] and isinstance(body["bootstrap_host"], str)
    for name in (
        "bootstrap_port",
        "bootstrap_room",
        "data_parallel_rank",
        "disagg_prefill_dp_rank",
    ):
        assert "int" in fields[name] and isinstance(body[name], int), name
    assert "str" in fields["lora_path"] and "str" in fields["cache_salt"]


def test_the_pd_server_arguments_the_adapter_reads_are_sglangs() -> None:
    """``/server_info`` carries the server arguments (``ServerArgs``, whose fields
    ``arg_groups/field_order.py`` lists): the adapter reads the PD mode and the prefill
    engine's bootstrap port by these names."""
    root = sglang_root()
    assert root is not None
    tree = ast.parse((root / "srt/arg_groups/field_order.py").read_text())
    listed = next(
        ast.literal_eval(n.value)
        for n in tree.body
        if isinstance(n, ast.Assign) and ast.unparse(n.targets[0]) == "POSITIONAL_FIELD_ORDER"
    )
    assert {"disaggregation_mode", "disaggregation_bootstrap_port"} <= set(listed)


def test_the_events_descriptor_uses_sglangs_keys() -> None:
    """The simulated engine's ``kv_events`` (``KvEventsConfig.descriptor``) has only keys
    SGLang's ``describe_kv_events_publisher`` writes."""
    from thunderagent.sglang.zmq_publisher import KvEventsConfig

    root = sglang_root()
    assert root is not None
    tree = ast.parse((root / "srt/runtime_context.py").read_text())
    name = "describe_kv_events_publisher"
    fn = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == name)
    keys = {k.value for n in ast.walk(fn) if isinstance(n, ast.Dict)
            for k in n.keys if isinstance(k, ast.Constant)}  # fmt: skip
    keys |= {n.slice.value for n in ast.walk(fn)
             if isinstance(n, ast.Subscript) and isinstance(n.slice, ast.Constant)}  # fmt: skip
    config = KvEventsConfig(
        publisher="zmq", endpoint="tcp://*:5557", replay_endpoint="tcp://*:5558"
    )
    described = config.descriptor(block_size=16, dp_size=2)
    assert described is not None and set(described) <= keys, set(described) - keys
