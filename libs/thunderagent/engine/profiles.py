"""Engine profiles: a model, a GPU, efficiency factors and engine settings.

A profile is everything the roofline timing model and the KV allocator need to know about one
engine instance. All sizes are in bytes, rates in per-second units, times in seconds.
Presets are plain constants so a benchmark names them (``get_profile("llama-3.1-8b-h100")``) and
tweaks one field with ``dataclasses.replace``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

MIB = 1024**2
GIB = 1024**3


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelSpec:
    """Dense decoder-only transformer shape (GQA aware)."""

    name: str
    params: float
    """Parameter count (weights read once per forward pass)."""
    layers: int
    hidden: int
    q_heads: int
    kv_heads: int
    head_dim: int
    dtype_bytes: int = 2
    """Bytes per weight and per KV element (bf16 = 2)."""
    context_length: int = 131072
    """Longest sequence (prompt + output) the model serves (Llama 3.1: 128k)."""
    vocab_size: int = 128256
    """Token ids are below this (Llama 3's tokenizer)."""

    @property
    def weight_bytes(self) -> float:
        return self.params * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V, every layer, every KV head: 2 * layers * kv_heads * head_dim * dtype_bytes."""
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes


@dataclass(frozen=True, slots=True, kw_only=True)
class GpuSpec:
    """One accelerator, or a tensor-parallel group of ``count`` identical ones.

    Rates and memory are per device; ``count`` multiplies them (TP splits weights and KV heads
    evenly, so the group behaves like one device with ``count`` times the resources, minus
    all-reduce cost, which the per-step overhead absorbs).
    """

    name: str
    flops: float
    """Dense bf16 FLOP/s per device (no sparsity)."""
    hbm_bw: float
    """HBM bytes/s per device."""
    mem_bytes: float
    """Usable device memory in bytes (what the driver reports)."""
    pcie_bw: float = 50e9
    """Host<->device bytes/s per device for hierarchical-cache loads (PCIe Gen5 x16, effective)."""
    count: int = 1


@dataclass(frozen=True, slots=True, kw_only=True)
class Efficiency:
    """How far below peak real kernels run; calibrated against published SGLang figures."""

    mfu: float = 0.5
    """Fraction of peak FLOP/s reached by prefill GEMMs (and by decode when compute bound)."""
    bw_eff: float = 0.8
    """Fraction of peak HBM bandwidth reached by decode (weights + KV streaming)."""
    step_overhead_s: float = 0.0005
    """Fixed cost per engine step: scheduling, sampling, kernel launches (CUDA graphs help)."""
    prefix_attention: bool = True
    """A prefill chunk pays its attention over the cached prefix (the FLOPs and the prefix's KV
    reads). False prices a chunk by its new tokens alone, as Dynamo 1.6.1's mocker does: a
    what-if (``bench replay --engine-pricing dynamo-mocker``), not how the GPU works."""
    shared_kv_once: bool = False
    """A decode step reads each KV page in use once however many running requests share it
    (cascade attention; Dynamo 1.6.1's mocker counts the pages in use). False: each request
    reads its own context, shared pages included (paged attention without cascade)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineSettings:
    """Engine knobs with SGLang's meaning."""

    block_size: int = 16
    """Tokens per KV block; the cache key granularity."""
    mem_fraction_static: float = 0.88
    """Share of device memory for weights + KV pool (SGLang's default on large GPUs)."""
    chunked_prefill_size: int = 8192
    """Max new prompt tokens per prefill step (SGLang's default on 80-160 GB GPUs)."""
    max_running_requests: int = 1024
    kv_blocks_override: int | None = None
    """Fixed KV capacity in blocks; used by the tiny test profile instead of the memory formula."""
    host_blocks: int = 0
    """Host-memory (HiCache) tier capacity in blocks; 0 disables the tier."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Profile:
    """A model on a GPU with engine settings: the unit an engine core is built from."""

    name: str
    model: ModelSpec
    gpu: GpuSpec
    eff: Efficiency = dataclasses.field(default_factory=Efficiency)
    engine: EngineSettings = dataclasses.field(default_factory=EngineSettings)

    @property
    def kv_bytes_per_token(self) -> int:
        return self.model.kv_bytes_per_token

    @property
    def kv_bytes_per_block(self) -> int:
        return self.model.kv_bytes_per_token * self.engine.block_size

    @property
    def capacity_blocks(self) -> int:
        """(gpu_mem * mem_fraction - weight bytes) / (kv bytes per token * block_size)."""
        if self.engine.kv_blocks_override is not None:
            return self.engine.kv_blocks_override
        pool = self.gpu.mem_bytes * self.gpu.count * self.engine.mem_fraction_static
        free = pool - self.model.weight_bytes
        if free <= 0:
            raise ValueError(f"profile {self.name}: weights do not fit in the memory fraction")
        return int(free // self.kv_bytes_per_block)

    @property
    def capacity_tokens(self) -> int:
        return self.capacity_blocks * self.engine.block_size

    def with_engine(self, **changes: object) -> Profile:
        """Copy with some engine settings changed (e.g. ``block_size=512`` for trace replay)."""
        return dataclasses.replace(self, engine=dataclasses.replace(self.engine, **changes))


LLAMA_31_8B = ModelSpec(
    name="meta-llama/Llama-3.1-8B-Instruct",
    params=8.03e9,
    layers=32,
    hidden=4096,
    q_heads=32,
    kv_heads=8,
    head_dim=128,
)
LLAMA_31_70B = ModelSpec(
    name="meta-llama/Llama-3.1-70B-Instruct",
    params=70.6e9,
    layers=80,
    hidden=8192,
    q_heads=64,
    kv_heads=8,
    head_dim=128,
)
TINY_MODEL = ModelSpec(
    name="tiny",
    params=1e9,
    layers=4,
    hidden=1024,
    q_heads=8,
    kv_heads=2,
    head_dim=128,
)

# 81559 MiB / 143771 MiB are what nvidia-smi reports for H100 SXM 80GB / H200 141GB.
H100_SXM = GpuSpec(name="H100-SXM", flops=989e12, hbm_bw=3.35e12, mem_bytes=81559 * MIB)
H200 = GpuSpec(name="H200", flops=989e12, hbm_bw=4.8e12, mem_bytes=143771 * MIB)
TINY_GPU = GpuSpec(name="tiny", flops=100e12, hbm_bw=1e12, mem_bytes=8 * GIB, pcie_bw=10e9)

PRESETS: dict[str, Profile] = {
    "tiny": Profile(
        name="tiny",
        model=TINY_MODEL,
        gpu=TINY_GPU,
        eff=Efficiency(mfu=0.5, bw_eff=0.5, step_overhead_s=0.001),
        engine=EngineSettings(
            block_size=4, chunked_prefill_size=32, max_running_requests=8, kv_blocks_override=32
        ),
    ),
    "llama-3.1-8b-h100": Profile(
        name="llama-3.1-8b-h100",
        model=LLAMA_31_8B,
        gpu=H100_SXM,
        eff=Efficiency(mfu=0.5, bw_eff=0.8, step_overhead_s=0.0005),
        engine=EngineSettings(block_size=16, chunked_prefill_size=8192, max_running_requests=1024),
    ),
    "llama-3.1-70b-h200-tp2": Profile(
        name="llama-3.1-70b-h200-tp2",
        model=LLAMA_31_70B,
        gpu=dataclasses.replace(H200, count=2),
        eff=Efficiency(mfu=0.5, bw_eff=0.75, step_overhead_s=0.001),
        engine=EngineSettings(block_size=16, chunked_prefill_size=8192, max_running_requests=1024),
    ),
}


def get_profile(name: str) -> Profile:
    """Look up a preset by name; the error lists the known names."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown engine profile {name!r}; known: {sorted(PRESETS)}") from None
