"""The worker-adapter extension point: how one engine's prefill/decode handoff looks on the wire.

An adapter only shapes bodies and reads answers; the request lifecycle does the HTTP, so the
same retry, deadline and release logic serves every engine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Protocol, runtime_checkable
from urllib.parse import urlsplit

__all__ = [
    "WorkerAdapter",
    "ConcurrentAdapter",
    "PrefillTarget",
    "ProtocolViolation",
    "prefill_target",
]


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


@dataclass(frozen=True, slots=True)
class PrefillTarget:
    """What a concurrent-legs protocol tells the decode worker about its prefill partner."""

    host: str  # as the decode worker must reach it (IPv6 without brackets)
    bootstrap_port: int | None  # the KV side channel; None = the engine's default / none
    engine_id: str | None = None  # Mooncake: the prefill engine's id from its /query
    # A data-parallel prefill: the rank that prefills, of `dp_size` (router/adapters/dp_rank.py)
    dp_rank: int | None = None
    dp_size: int = 1

    def __repr__(self) -> str:
        rank = "" if self.dp_rank is None else f", rank {self.dp_rank}/{self.dp_size}"
        return f"PrefillTarget({self.host}:{self.bootstrap_port}, engine={self.engine_id}{rank})"


def prefill_target(
    url: str,
    bootstrap_port: int | None,
    engine_id: str | None = None,
    dp_rank: int | None = None,
    dp_size: int = 1,
) -> PrefillTarget:
    """The target for a prefill worker's base URL (its host is what the decode connects to)."""
    host = urlsplit(url).hostname
    if not host:
        raise ValueError(f"prefill worker URL {url!r} has no host")
    return PrefillTarget(host, bootstrap_port, engine_id, dp_rank, dp_size)


@runtime_checkable
class ConcurrentAdapter(Protocol):
    """Protocols whose two legs start together (SGLang rooms, vLLM Mooncake).

    `legs` returns (prefill body, decode body) from the client's body; the lifecycle sends both
    at once, streams only the decode answer, reads and drops the prefill answer, and cancels
    one leg when the other fails.
    """

    name: str
    concurrent_legs: Literal[True]

    def legs(
        self, body: dict[str, Any], prefill: PrefillTarget, request_id: str
    ) -> tuple[dict[str, Any], dict[str, Any]]: ...
