"""Worker adapters, one module per engine protocol."""

from router.adapters.base import ProtocolViolation, WorkerAdapter
from router.adapters.vllm import VllmNixlAdapter

__all__ = ["ProtocolViolation", "WorkerAdapter", "VllmNixlAdapter", "adapter_for"]


def adapter_for(name: str) -> WorkerAdapter:
    # The simulated worker speaks vLLM's NIXL protocol, so it shares the vLLM adapter.
    if name in ("vllm", "sim"):
        return VllmNixlAdapter()
    raise ValueError(f"unknown worker adapter {name!r}; known: vllm, sim")
