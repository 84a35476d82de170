"""What the adapter registers as the engine's limits, read from SGLang's server info and loads."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from thunderagent.schemas import WorkerRole
from thunderagent.sglang.load import LOADS_PATH
from thunderagent.worker.adapter import (
    AdapterConfig,
    WorkerAdapter,
)
from thunderagent.worker.engine_client import EngineError
from thunderagent.worker.engine_info import context_length, dp_size
from thunderagent.worker.service import rank_configs


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
    assert context_length(info) == limit


class _Engine:
    base_url = "http://127.0.0.1:30000"

    def __init__(self, info: dict, loads: dict | None) -> None:
        self.answers = {"/server_info": info, LOADS_PATH: loads}
        self.bootstrap_port = 0

    async def get_json(self, path: str) -> dict:
        answer = self.answers[path]
        if answer is None:
            raise EngineError(404, "Not Found")
        return answer


@pytest.mark.parametrize(
    ("max_running", "loads", "registered"),
    [
        (32, None, 32),  # --max-running-requests given, SGLang before /v1/loads: as given
        (None, {"loads": [{"max_running_requests": 48}, {"max_running_requests": 48}]}, 96),
        # given, and bounded by the KV pool (or divided among attention-DP ranks): as derived
        (64, {"loads": [{"max_running_requests": 16}, {"max_running_requests": 16}]}, 32),
        (None, None, 0),  # SGLang before /v1/loads: unknown (the scheduler's fallback applies)
    ],
)
def test_the_running_cap_sglang_derived_is_read_from_its_loads(max_running, loads, registered):
    info = {"model_path": "m", "page_size": 16, "max_total_num_tokens": 16_000,
            "max_running_requests": max_running}  # fmt: skip
    config = AdapterConfig(worker_id="w0", engine_url=_Engine.base_url)
    adapter = WorkerAdapter(config, bus=None, engine=_Engine(info, loads))  # type: ignore[arg-type]
    assert asyncio.run(adapter.describe_engine()).max_running_requests == registered


@pytest.mark.parametrize(
    ("info", "block_size"),
    [
        ({"page_size": 16}, 16),
        # SGLang 0.5 advertises the events' block: page_size x dcp_size under decode context
        # parallelism, where a page of 16 is keyed in blocks of 64
        ({"page_size": 16, "kv_events": {"block_size": 64, "dp_size": 1}}, 64),
        ({"page_size": 16, "kv_events": None}, 16),  # no publisher
    ],
)
def test_the_block_size_is_the_one_the_engines_events_use(info, block_size):
    info = {"model_path": "m", "max_total_num_tokens": 16_000, "max_running_requests": 8, **info}
    config = AdapterConfig(worker_id="w0", engine_url=_Engine.base_url)
    adapter = WorkerAdapter(config, bus=None, engine=_Engine(info, None))  # type: ignore[arg-type]
    assert asyncio.run(adapter.describe_engine()).block_size == block_size


@pytest.mark.parametrize(
    ("mode", "port", "flag", "expected"),
    [
        ("null", None, WorkerRole.BOTH, (WorkerRole.BOTH, 0)),
        ("null", None, WorkerRole.DECODE, (WorkerRole.DECODE, 0)),  # the workers move the KV
        ("prefill", 8998, WorkerRole.BOTH, (WorkerRole.PREFILL, 8998)),
        ("prefill", 8998, WorkerRole.PREFILL, (WorkerRole.PREFILL, 8998)),
        ("decode", 8998, WorkerRole.BOTH, (WorkerRole.DECODE, 0)),  # its port names a prefill's
        ("decode", None, WorkerRole.PREFILL, "--role prefill"),
        ("prefill", None, WorkerRole.BOTH, "no disaggregation_bootstrap_port"),
    ],
)
def test_an_engine_in_sglangs_pd_mode_gives_the_worker_its_role(mode, port, flag, expected):
    info = {"model_path": "m", "page_size": 16, "max_total_num_tokens": 16_000,
            "disaggregation_mode": mode, "disaggregation_bootstrap_port": port}  # fmt: skip
    config = AdapterConfig(worker_id="w0", engine_url=_Engine.base_url, role=flag)
    adapter = WorkerAdapter(config, bus=None, engine=_Engine(info, None))  # type: ignore[arg-type]
    if isinstance(expected, str):
        with pytest.raises(RuntimeError, match=expected):
            asyncio.run(adapter.describe_engine())
        return
    reg = asyncio.run(adapter.describe_engine())
    assert (reg.role, reg.bootstrap_port) == expected


def test_a_rank_registers_its_own_running_cap() -> None:
    info = {"model_path": "m", "page_size": 16, "max_total_num_tokens": 16_000}
    loads = {"loads": [{"dp_rank": 0, "max_running_requests": 48},
                       {"dp_rank": 1, "max_running_requests": 40}]}  # fmt: skip
    caps = []
    for rank in (None, 0, 1):
        config = AdapterConfig(worker_id="w0", engine_url=_Engine.base_url, dp_rank=rank)
        adapter = WorkerAdapter(config, bus=None, engine=_Engine(info, loads))  # type: ignore[arg-type]
        caps.append(asyncio.run(adapter.describe_engine()).max_running_requests)
    assert caps == [88, 48, 40]


@pytest.mark.parametrize(
    ("info", "ranks"),
    [
        ({}, 1),  # SGLang before data parallelism, or the simulated engine's default
        ({"dp_size": 4}, 4),  # its server argument
        ({"dp_size": 1, "attn_dp_size": 4, "kv_events": None}, 4),  # DP attention, no events
        ({"dp_size": 4, "kv_events": {"dp_size": 4, "block_size": 16}}, 4),  # 0.5's publishers
        ({"dp_size": None, "kv_events": None}, 1),
    ],
)
def test_the_ranks_are_read_from_the_engine_and_each_is_a_worker(info, ranks) -> None:
    assert dp_size(info) == ranks
    config = AdapterConfig(worker_id="w0", engine_url=_Engine.base_url)
    configs = rank_configs(config, ranks)
    if ranks == 1:
        assert configs == [config]  # one rank: the engine is the worker, its id unchanged
    else:
        assert [(c.worker_id, c.dp_rank) for c in configs] == [
            (f"w0-dp{r}", r) for r in range(ranks)
        ]
    # an adapter told its rank stands for that rank alone (a process per rank)
    one = AdapterConfig(worker_id="w0", engine_url=_Engine.base_url, dp_rank=ranks - 1)
    [alone] = rank_configs(one, ranks)
    assert alone.dp_rank == ranks - 1
    assert alone.worker_id == ("w0" if ranks == 1 else f"w0-dp{ranks - 1}")
    with pytest.raises(ValueError, match="has"):
        rank_configs(dataclasses.replace(one, dp_rank=ranks), ranks)


class _Lease:
    def __init__(self) -> None:
        self.amended: list = []

    def amend(self, registration) -> None:
        self.amended.append(registration.lora_adapters)


def test_the_loaded_lora_adapters_are_registered_and_followed() -> None:
    """SGLang lists each loaded adapter in ``/v1/models`` as a card with the base as parent;
    the adapter registers them and amends its registration when they change at run time."""
    info = {"model_path": "m", "page_size": 16, "max_total_num_tokens": 16_000,
            "max_running_requests": 8, "enable_lora": True}  # fmt: skip
    base = {"id": "m", "object": "model", "root": "m", "parent": None}
    models = {"object": "list", "data": [base, {"id": "sql", "root": "/a/sql", "parent": "m"}]}
    engine = _Engine(info, None)
    engine.answers["/v1/models"] = models
    adapter = WorkerAdapter(AdapterConfig(worker_id="w0", engine_url=_Engine.base_url),
                            bus=None, engine=engine)  # type: ignore[arg-type]  # fmt: skip
    adapter.registration = asyncio.run(adapter.describe_engine())
    assert adapter.registration.lora_adapters == ["sql"]
    adapter.lease = _Lease()  # type: ignore[assignment]
    models["data"].append({"id": "chat", "root": "/a/chat", "parent": "m"})  # loaded later
    asyncio.run(adapter._refresh_adapters())
    asyncio.run(adapter._refresh_adapters())  # nothing changed: nothing amended
    assert adapter.lease.amended == [["chat", "sql"]]
    assert adapter.registration.lora_adapters == ["chat", "sql"]
    del models["data"][1]  # "sql" evicted (--max-loaded-loras): SGLang reloads it on demand
    asyncio.run(adapter._refresh_adapters())
    assert adapter.registration.lora_adapters == ["chat", "sql"]
    engine.answers["/v1/models"] = {"detail": "Not Found"}  # an answer that is not a list
    asyncio.run(adapter._refresh_adapters())  # said, and the last known list kept
    assert adapter.registration.lora_adapters == ["chat", "sql"]
    no_lora = WorkerAdapter(AdapterConfig(worker_id="w1", engine_url=_Engine.base_url),
                            bus=None, engine=_Engine({**info, "enable_lora": False}, None))  # type: ignore[arg-type]  # fmt: skip
    assert asyncio.run(no_lora.describe_engine()).lora_adapters == []
