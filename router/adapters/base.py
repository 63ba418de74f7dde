"""The worker-adapter extension point: how one engine's prefill/decode handoff looks on the wire.

An adapter only shapes bodies and reads answers; the request lifecycle does the HTTP, so the
same retry, deadline and release logic serves every engine.
"""

from __future__ import annotations

from typing import Any, Protocol

__all__ = ["WorkerAdapter", "ProtocolViolation"]


class ProtocolViolation(ValueError):
    """A worker's answer does not follow its engine's protocol."""


class WorkerAdapter(Protocol):
    name: str

    def prefill_body(self, body: dict[str, Any]) -> dict[str, Any]:
        """The body sent to the prefill worker, derived from the client's body."""

    def kv_params(self, prefill_answer: Any) -> dict[str, Any]:
        """The KV handle from the prefill worker's answer (raises ProtocolViolation)."""

    def decode_body(self, body: dict[str, Any], kv_params: dict[str, Any]) -> dict[str, Any]:
        """The body sent to the decode worker: the client's body plus the KV handle."""
