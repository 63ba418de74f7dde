"""What the request path's stages share: the request (`Call`), what one try asks the workers
for (`Ask`), what one try holds (`Attempt`), and how a failed leg is described (`LegFailure`).

A `Call` is immutable: the stages (router/request/reserve.py, legs.py, respond.py, resume.py,
release.py) read the request from it and keep no state of their own. An `Attempt` is what one
try holds and must give back: the decode reservation and the stranded-KV entry, each with its
owner (router/request/holdings.py), a concurrent prefill leg, and the verdict the decode
worker's breaker is owed; a `LegFailure` says which side failed, whose breaker pays, and
whether trying again can help.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from policies.base import Candidate
from router.adapters.errors import parse_error_body
from router.errors import RouterError, Unavailable, UpstreamError, UpstreamRejected
from router.openai.api import ParsedRequest
from router.request.holdings import Reservation, StrandedEntry
from router.tracing import RequestTrace
from router.workers.breaker import Verdict

__all__ = ["Ask", "Attempt", "Call", "LegFailure", "upstream_failure"]


@dataclass(frozen=True, slots=True)
class Call:
    """One request as every stage sees it."""

    parsed: ParsedRequest
    headers: Mapping[str, str]  # the client's
    request_id: str
    started: float  # the router's clock at arrival
    trace: RequestTrace
    prefixes: tuple[int, ...]
    # Asked for whole, streamed from the decode worker and assembled (router/request/assemble.py).
    assembling: bool
    tenant: str = ""  # whose request it is (preemption takes a tenant's own streams first)
    priority: int = 0  # its class (router/request/priority_class.py; lower: more urgent)

    def __repr__(self) -> str:
        return f"Call({self.request_id}, {self.parsed!r})"


@dataclass(frozen=True, slots=True)
class Ask:
    """What one try asks the workers for: the client's body, or the body that resumes a broken
    stream (router/request/resume.py) with its prompt size, token cap and the tokens already
    sent."""

    body: dict[str, Any]
    prompt_tokens: int
    max_tokens: int
    resumed: int = 0
    resume: bool = False  # continues a stream that broke after bytes reached the client

    def __repr__(self) -> str:
        return f"Ask(prompt_tokens={self.prompt_tokens}, resumed={self.resumed})"


class LegFailure(Exception):
    """A prefill or decode leg failed before any byte of it reached the client."""

    def __init__(self, side: str, worker_id: str, error: RouterError, retryable: bool) -> None:
        super().__init__(error.message)
        self.side, self.worker_id, self.error, self.retryable = side, worker_id, error, retryable
        self.kv_handle = False  # the KV handle was bad (expired): nobody's breaker is charged
        self.status: int | None = None  # the worker's HTTP status, when it answered with one
        self.kind: str | None = None  # the upstream_errors label, when not the status's


def upstream_failure(side: str, worker_id: str, status: int, data: bytes) -> LegFailure:
    worker_error = parse_error_body(data, status)  # either vLLM shape, or plain text
    msg, type_, param = worker_error.message, worker_error.type, worker_error.param
    code = worker_error.code
    retryable, kv_handle = True, False
    err: RouterError
    if 400 <= status < 500 and param == "kv_transfer_params":
        # Not the client's fault: the KV handle the router passed is no longer good (its lease
        # expired on the prefill worker, or it was pulled already). Re-prefill and retry.
        err = UpstreamError(f"{side} worker {worker_id} could not use the KV handle: {msg}")
        kv_handle = True
    elif 400 <= status < 500 and status not in (408, 429):
        # The worker judged the client's request bad: its verdict passes through, no retry.
        err = UpstreamRejected(
            status, msg, type_=type_ or "invalid_request_error", param=param, code=code
        )
        retryable = False
    elif status in (429, 503):
        err = Unavailable(
            f"{side} worker {worker_id} is overloaded (HTTP {status}): {msg}", retry_after_s=1.0
        )
    else:
        err = UpstreamError(f"{side} worker {worker_id} failed with HTTP {status}: {msg}")
    failure = LegFailure(side, worker_id, err, retryable)
    failure.kv_handle, failure.status = kv_handle, status
    return failure


class Attempt:
    """One (prefill, decode) try: what it holds and must give back."""

    __slots__ = (
        "candidate",
        "reservation",
        "prefixes",
        "stranded",
        "handoff_by",
        "partner",
        "decode_verdict",
    )

    def __init__(
        self, candidate: Candidate, reservation: Reservation, prefixes: tuple[int, ...]
    ) -> None:
        self.candidate = candidate
        self.reservation = reservation
        # The prompt's prefix hashes as placement read them (under a LoRA adapter, in its own
        # space: policies/loras.py): what the prefill worker is noted to have seen.
        self.prefixes = prefixes
        # The pulled prefill's KV between the legs (None for a local pair, concurrent legs, or
        # an answer the decode prefills itself).
        self.stranded: StrandedEntry | None = None
        # Event-loop time by which the decode worker must show it took the KV (first event).
        self.handoff_by: float | None = None
        self.partner: asyncio.Task[bytes] | None = None  # a concurrent prefill leg
        # What the decode worker's breaker is owed once its answer is read (router/request/
        # legs.py); abandoned on release if nothing judged it (the client left, the deadline).
        self.decode_verdict: Verdict | None = None

    @property
    def decode_id(self) -> str | None:
        """The decode worker whose room this try holds; None once released."""
        return self.reservation.decode_id

    def __repr__(self) -> str:
        return (
            f"Attempt({self.candidate.prefill_id}->{self.candidate.decode_id}, "
            f"{self.reservation!r}, {self.stranded!r})"
        )
