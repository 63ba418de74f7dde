"""vLLM with the NIXL connector in pull mode (docs/design.md §3): three plain OpenAI HTTP calls.

1. prefill: the client's body with `stream: false`, `max_tokens: 1` (and `max_completion_tokens: 1`
   when present), `min_tokens`/`min_completion_tokens`/`stream_options` removed, and the null
   `kv_transfer_params` skeleton with `do_remote_decode: true`;
2. the prefill answer carries a top-level `kv_transfer_params` object — opaque and
   version-dependent, so it is copied verbatim;
3. decode: the client's original body plus that object.
"""

from __future__ import annotations

from typing import Any

from router.adapters.base import ProtocolViolation

__all__ = ["VllmNixlAdapter"]

_DROP_FROM_PREFILL = ("min_tokens", "min_completion_tokens", "stream_options")


class VllmNixlAdapter:
    name = "vllm"

    def prefill_body(self, body: dict[str, Any]) -> dict[str, Any]:
        out = {k: v for k, v in body.items() if k not in _DROP_FROM_PREFILL}
        out["stream"] = False
        out["max_tokens"] = 1
        if "max_completion_tokens" in body:
            out["max_completion_tokens"] = 1
        out["kv_transfer_params"] = {
            "do_remote_decode": True,
            "do_remote_prefill": False,
            "remote_engine_id": None,
            "remote_block_ids": None,
            "remote_host": None,
            "remote_port": None,
        }
        return out

    def kv_params(self, prefill_answer: Any) -> dict[str, Any]:
        params = (
            prefill_answer.get("kv_transfer_params") if isinstance(prefill_answer, dict) else None
        )
        if not isinstance(params, dict):
            raise ProtocolViolation(
                "the prefill worker's answer has no kv_transfer_params object: is it started "
                "with --kv-transfer-config and kv_role kv_producer (or kv_both)?"
            )
        return params

    def decode_body(self, body: dict[str, Any], kv_params: dict[str, Any]) -> dict[str, Any]:
        out = dict(body)
        out["kv_transfer_params"] = kv_params
        return out
