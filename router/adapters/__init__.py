"""Worker adapters, one module per engine protocol."""

from router.adapters.base import (
    ConcurrentAdapter,
    PrefillTarget,
    ProtocolViolation,
    WorkerAdapter,
    prefill_target,
)
from router.adapters.mooncake import MooncakeAdapter, query_engine_ids
from router.adapters.sglang import SglangAdapter
from router.adapters.vllm import VllmNixlAdapter

__all__ = [
    "ConcurrentAdapter",
    "MooncakeAdapter",
    "PrefillTarget",
    "ProtocolViolation",
    "SglangAdapter",
    "VllmNixlAdapter",
    "WorkerAdapter",
    "ADAPTERS",
    "adapter_for",
    "prefill_target",
    "query_engine_ids",
]

# The simulated worker speaks vLLM's NIXL protocol (adapter "sim") and SGLang's ("sglang").
ADAPTERS = ("vllm", "sim", "sglang", "mooncake")


def adapter_for(name: str) -> WorkerAdapter | ConcurrentAdapter:
    if name in ("vllm", "sim"):
        return VllmNixlAdapter()
    if name == "sglang":
        return SglangAdapter()
    if name == "mooncake":
        return MooncakeAdapter()
    raise ValueError(f"unknown worker adapter {name!r}; known: {', '.join(ADAPTERS)}")
