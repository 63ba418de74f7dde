"""Roofline performance model of one LLM worker: prefill time, decode step time, KV transfer time.

One model serves three users, so their numbers agree: placement policies predict TTFT and
inter-token latency with it, the simulated GPU workers time their work with it, and the cluster
simulator advances its clock with it (docs/design.md §1).

- Prefill is compute-bound: 2 × params × tokens FLOPs plus causal attention, at `mfu` of peak.
- A decode step is bandwidth-bound: it reads every weight once plus the KV of every resident
  sequence, at `mbu` of peak HBM bandwidth (or is compute-bound for huge batches).
- A KV handoff moves prompt tokens × KV bytes per token over the link.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

__all__ = ["ModelProfile", "GPUProfile", "PerfModel", "MODELS", "GPUS", "perf_model"]


@dataclass(frozen=True, slots=True)
class ModelProfile:
    name: str
    layers: int
    hidden: int
    kv_heads: int
    head_dim: int
    params: float  # parameter count
    dtype_bytes: int = 2  # BF16
    max_model_len: int = 131_072
    default_tp: int = 1

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes

    @property
    def weight_bytes(self) -> float:
        return self.params * self.dtype_bytes


@dataclass(frozen=True, slots=True)
class GPUProfile:
    name: str
    bf16_flops: float  # dense peak, FLOP/s
    hbm_bytes: float
    hbm_bytes_per_s: float
    nic_bytes_per_s: float  # scale-out NIC, per GPU


# Public spec-sheet figures (docs/design.md §1).
GPUS: dict[str, GPUProfile] = {
    "a100": GPUProfile("a100", 312e12, 80e9, 2.0e12, 200e9 / 8),
    "h100": GPUProfile("h100", 989e12, 80e9, 3.35e12, 400e9 / 8),
    "h200": GPUProfile("h200", 989e12, 141e9, 4.8e12, 400e9 / 8),
    "l40s": GPUProfile("l40s", 362e12, 48e9, 0.86e12, 200e9 / 8),
}

MODELS: dict[str, ModelProfile] = {
    # Llama-3-8B: 32 layers, GQA 8 KV heads x 128, 128 KiB of KV per token in BF16.
    "llama-3-8b": ModelProfile("llama-3-8b", 32, 4096, 8, 128, 8.0e9, max_model_len=8192 * 16),
    # Llama-3-70B: 80 layers, GQA 8 KV heads x 128, 320 KiB per token; needs TP 4 on 80 GB parts.
    "llama-3-70b": ModelProfile(
        "llama-3-70b", 80, 8192, 8, 128, 70.6e9, max_model_len=8192 * 16, default_tp=4
    ),
    # Llama-2-7B: MHA, 512 KiB per token in FP16.
    "llama-2-7b": ModelProfile("llama-2-7b", 32, 4096, 32, 128, 6.7e9, max_model_len=4096),
    # The tiny 2-layer model used with the real vLLM CPU build in tests.
    "tiny-llama": ModelProfile("tiny-llama", 2, 128, 2, 32, 1.0e6, max_model_len=1024),
}


@dataclass(frozen=True, slots=True)
class PerfModel:
    model: ModelProfile
    gpu: GPUProfile
    tp_size: int = 1
    mfu: float = 0.5  # fraction of peak FLOP/s reached in prefill
    mbu: float = 0.7  # fraction of peak HBM bandwidth reached in decode
    gpu_memory_utilization: float = 0.9
    block_size: int = 16
    step_overhead_s: float = 0.0015  # scheduler, sampling, kernel launches per step
    prefill_overhead_s: float = 0.005

    @property
    def kv_bytes_per_token(self) -> int:
        return self.model.kv_bytes_per_token

    @property
    def kv_bytes_per_block(self) -> int:
        return self.model.kv_bytes_per_token * self.block_size

    @property
    def _flops(self) -> float:
        return self.gpu.bf16_flops * self.tp_size * self.mfu

    @property
    def _bandwidth(self) -> float:
        return self.gpu.hbm_bytes_per_s * self.tp_size * self.mbu

    def prefill_s(self, prompt_tokens: int, cached_tokens: int = 0) -> float:
        """Seconds to prefill `prompt_tokens`, of which `cached_tokens` hit the prefix cache."""
        n = max(0, prompt_tokens - cached_tokens)
        if n == 0:
            return self.prefill_overhead_s
        linear = 2.0 * self.model.params * n
        # Causal attention: QK^T and AV over the new tokens against the whole context.
        attn = 2.0 * self.model.layers * self.model.hidden * n * (cached_tokens + prompt_tokens)
        return self.prefill_overhead_s + (linear + attn) / self._flops

    def prefill_tokens_per_s(self, typical_prompt_tokens: int = 1024) -> float:
        return typical_prompt_tokens / self.prefill_s(typical_prompt_tokens)

    def decode_step_s(self, batch_kv_tokens: int, batch_size: int) -> float:
        """One continuous-batching step: every resident sequence advances one token."""
        if batch_size <= 0:
            return 0.0
        memory = (
            self.model.weight_bytes + batch_kv_tokens * self.kv_bytes_per_token
        ) / self._bandwidth
        compute = 2.0 * self.model.params * batch_size / self._flops
        return self.step_overhead_s + max(memory, compute)

    @property
    def step_base_s(self) -> float:
        """Step time of a batch whose KV is negligible (the weights-only read)."""
        return self.step_overhead_s + self.model.weight_bytes / self._bandwidth

    @property
    def step_s_per_block(self) -> float:
        """Extra step time per resident KV block (memory-bound regime)."""
        return self.kv_bytes_per_block / self._bandwidth

    def transfer_s(self, prompt_tokens: int, link_bytes_per_s: float | None = None) -> float:
        bw = link_bytes_per_s or self.gpu.nic_bytes_per_s * self.tp_size
        return prompt_tokens * self.kv_bytes_per_token / bw

    @property
    def kv_capacity_blocks(self) -> int:
        usable = self.gpu.hbm_bytes * self.tp_size * self.gpu_memory_utilization
        # Weights plus a small activation reserve (5 % of memory) are not available for KV.
        free = usable - self.model.weight_bytes - 0.05 * self.gpu.hbm_bytes * self.tp_size
        if free <= 0:
            raise ValueError(
                f"{self.model.name} does not fit on {self.tp_size} x {self.gpu.name}: raise tp_size"
            )
        return int(free // self.kv_bytes_per_block)

    def with_(self, **changes: object) -> PerfModel:
        return replace(self, **changes)  # type: ignore[arg-type]


def perf_model(model: str, gpu: str, tp_size: int | None = None, **kwargs: object) -> PerfModel:
    """A PerfModel from profile names; an unknown name raises a ValueError listing the known."""
    try:
        m = MODELS[model]
    except KeyError:
        raise ValueError(f"unknown model profile {model!r}; known: {sorted(MODELS)}") from None
    try:
        g = GPUS[gpu]
    except KeyError:
        raise ValueError(f"unknown GPU profile {gpu!r}; known: {sorted(GPUS)}") from None
    return PerfModel(m, g, tp_size=tp_size or m.default_tp, **kwargs)  # type: ignore[arg-type]
