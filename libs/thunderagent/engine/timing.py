"""Roofline timing: how long one engine step takes on the profile's GPU.

A step is either a prefill batch (chunks of new prompt tokens over already-cached context) or a
decode batch (one new token per running request), as in SGLang, which does not mix them by
default. Each step costs ``max(compute time, memory time) + fixed overhead``:

* prefill compute = sum over chunks of ``2*P*n + 4*L*H*(n*c + n*n/2)`` FLOPs at ``flops*mfu``
  (dense GEMMs, plus causal attention QK^T and AV over ``c`` cached and ``n`` new tokens);
* prefill memory  = weights + KV of ``c + n`` tokens per chunk, at ``hbm_bw*bw_eff``;
* decode compute  = ``2*P*B`` FLOPs at ``flops*mfu``;
* decode memory   = weights + KV of all ``T`` context tokens of the batch, at ``hbm_bw*bw_eff``;
* host-tier loads add ``bytes / pcie_bw`` (serialised before the prefill that needs them).

``decode_run_time`` sums k consecutive decode steps in closed form so virtual time can jump over
decode-only stretches without iterating token by token.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from thunderagent.engine.profiles import Profile


class TimingModel:
    """Step durations for one profile; all results in seconds."""

    __slots__ = (
        "_bw",
        "_flops",
        "_kvb",
        "_kvb_block",
        "_layers_hidden",
        "_overhead",
        "_params",
        "_pcie",
        "_prefix_attention",
        "_weights",
        "profile",
    )

    def __init__(self, profile: Profile) -> None:
        gpu, model, eff = profile.gpu, profile.model, profile.eff
        self.profile = profile
        self._flops = gpu.flops * gpu.count * eff.mfu
        self._bw = gpu.hbm_bw * gpu.count * eff.bw_eff
        self._pcie = gpu.pcie_bw * gpu.count
        self._params = model.params
        self._weights = model.weight_bytes
        self._kvb = model.kv_bytes_per_token
        self._kvb_block = profile.kv_bytes_per_block
        self._layers_hidden = model.layers * model.hidden
        self._overhead = eff.step_overhead_s
        self._prefix_attention = eff.prefix_attention

    def prefill_flops(self, new: int, cached: int) -> float:
        """``2*P*n + 4*L*H*(n*c + n*n/2)``: GEMMs plus causal attention FLOPs."""
        attn = 4.0 * self._layers_hidden * (new * cached + new * new / 2.0)
        return 2.0 * self._params * new + attn

    def compute_seconds(self, flops: float) -> float:
        """``flops`` at the profile's sustained rate."""
        return flops / self._flops

    def kv_read_seconds(self, tokens: float) -> float:
        """Reading the KV of ``tokens`` tokens from HBM."""
        return tokens * self._kvb / self._bw

    def prefill_time(self, chunks: Iterable[tuple[int, int]], host_load_blocks: int = 0) -> float:
        """One prefill step over ``(new_tokens, cached_tokens)`` chunks, plus host-tier loads."""
        flops = 0.0
        kv_tokens = 0
        for new, cached in chunks:
            if not self._prefix_attention:
                cached = 0
            flops += self.prefill_flops(new, cached)
            kv_tokens += new + cached
        compute = flops / self._flops
        memory = (self._weights + kv_tokens * self._kvb) / self._bw
        return max(compute, memory) + self._overhead + self.load_time(host_load_blocks)

    def load_time(self, blocks: int) -> float:
        """Host -> GPU copy of ``blocks`` KV blocks over PCIe."""
        return blocks * self._kvb_block / self._pcie if blocks else 0.0

    def decode_time(self, batch: int, context_tokens: int) -> float:
        """One decode step: B requests whose KV totals ``context_tokens`` tokens."""
        compute = 2.0 * self._params * batch / self._flops
        memory = (self._weights + context_tokens * self._kvb) / self._bw
        return max(compute, memory) + self._overhead

    def decode_run_time(self, batch: int, context_tokens: int, steps: int) -> float:
        """Sum of ``steps`` consecutive decode steps; the context grows by ``batch`` per step.

        Step i costs ``max(c, a + b*i) + o``; the sum is split where the memory line crosses
        the compute constant, giving O(1) work for any number of steps.
        """
        if steps <= 0:
            return 0.0
        c = 2.0 * self._params * batch / self._flops
        a = (self._weights + context_tokens * self._kvb) / self._bw
        b = batch * self._kvb / self._bw
        if b <= 0.0:
            return steps * (max(c, a) + self._overhead)
        m = min(steps, max(0, math.ceil((c - a) / b)))
        linear = (steps - m) * a + b * ((steps - 1) * steps - (m - 1) * m) / 2.0
        return m * c + linear + steps * self._overhead

    def decode_steps_until(
        self, batch: int, context_tokens: int, budget_s: float, max_steps: int
    ) -> int:
        """Fewest steps (>= 1, <= max_steps) whose total time reaches ``budget_s``.

        Used to stop a fused decode run at the first step boundary at or after the next
        arrival, which is where a real engine would first see that arrival.
        """
        if max_steps <= 1 or self.decode_run_time(batch, context_tokens, 1) >= budget_s:
            return 1
        if self.decode_run_time(batch, context_tokens, max_steps) < budget_s:
            return max_steps
        lo, hi = 1, max_steps  # run_time(lo) < budget <= run_time(hi)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if self.decode_run_time(batch, context_tokens, mid) >= budget_s:
                hi = mid
            else:
                lo = mid
        return hi
