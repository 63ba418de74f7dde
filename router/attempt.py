"""One (prefill, decode) attempt of a request, and how a failed leg is described.

An `Attempt` is what one try holds and must give back (the decode reservation, the stranded-KV
entry, a concurrent prefill leg); a `LegFailure` says which side failed, whose breaker pays, and
whether trying again can help.
"""

from __future__ import annotations

import asyncio

from policies.base import Candidate
from router.adapters.errors import parse_error_body
from router.errors import RouterError, Unavailable, UpstreamError, UpstreamRejected

__all__ = ["Attempt", "LegFailure", "upstream_failure"]


class LegFailure(Exception):
    """A prefill or decode leg failed before any byte of it reached the client."""

    def __init__(self, side: str, worker_id: str, error: RouterError, retryable: bool) -> None:
        super().__init__(error.message)
        self.side, self.worker_id, self.error, self.retryable = side, worker_id, error, retryable
        self.kv_handle = False  # the KV handle was bad (expired): nobody's breaker is charged


def upstream_failure(side: str, worker_id: str, status: int, data: bytes) -> LegFailure:
    worker_error = parse_error_body(data, status)  # either vLLM shape, or plain text
    msg, type_, param = worker_error.message, worker_error.type, worker_error.param
    code = worker_error.code
    if 400 <= status < 500 and param == "kv_transfer_params":
        # Not the client's fault: the KV handle the router passed is no longer good (its lease
        # expired on the prefill worker, or it was pulled already). Re-prefill and retry.
        err = UpstreamError(f"{side} worker {worker_id} could not use the KV handle: {msg}")
        failure = LegFailure(side, worker_id, err, True)
        failure.kv_handle = True
        return failure
    if 400 <= status < 500 and status not in (408, 429):
        # The worker judged the client's request bad: its verdict passes through, no retry.
        return LegFailure(
            side,
            worker_id,
            UpstreamRejected(
                status, msg, type_=type_ or "invalid_request_error", param=param, code=code
            ),
            False,
        )
    if status in (429, 503):
        err: RouterError = Unavailable(
            f"{side} worker {worker_id} is overloaded (HTTP {status}): {msg}", retry_after_s=1.0
        )
    else:
        err = UpstreamError(f"{side} worker {worker_id} failed with HTTP {status}: {msg}")
    return LegFailure(side, worker_id, err, True)


class Attempt:
    """One (prefill, decode) try: what it holds and must give back."""

    __slots__ = (
        "reservation_id",
        "decode_id",
        "blocks",
        "stranded_on",
        "stranded_bytes",
        "handoff_by",
        "candidate",
        "grow_at_tokens",
        "overran",
        "growing",
        "partner",
    )

    def __init__(self, candidate: Candidate, reservation_id: str) -> None:
        self.candidate = candidate
        self.reservation_id = reservation_id
        self.decode_id: str | None = candidate.decode_id
        self.blocks = candidate.reserve_blocks
        self.stranded_on: str | None = None
        self.stranded_bytes = 0
        # Event-loop time by which the decode worker must show it took the KV (first event).
        self.handoff_by: float | None = None
        self.grow_at_tokens = 0
        self.overran = False
        self.growing = False  # a reservation growth is on its way to the store
        self.partner: asyncio.Task[bytes] | None = None  # a concurrent prefill leg

    def __repr__(self) -> str:
        return (
            f"Attempt({self.candidate.prefill_id}->{self.candidate.decode_id}, "
            f"blocks={self.blocks}, stranded_on={self.stranded_on})"
        )
