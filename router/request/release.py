"""Give back what an attempt holds, and feed the answer's length back to the estimator.

Entry point: `Releaser.release(attempt, record)`: the decode reservation and the stranded-KV
entry, each taken from its owner (router/request/holdings.py), in one store call
(router/leases.py `finish`), with the output statistic (`outcome`) at the end of the request.
It cannot half-fail: a step the store did not take is owed and retried by the lease keeper,
never renewed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from policies.base import OutputLengthEstimator, RequestInfo
from policies.tenant_classes import own_classes
from router.metrics import RouterMetrics
from router.request.attempt import Attempt, Call
from router.request.holdings import Book, Record

__all__ = ["Record", "Releaser"]


@dataclass(frozen=True, slots=True)
class Releaser:
    """The release stage: what it needs of the replica, handed to it once."""

    book: Book
    estimator: OutputLengthEstimator
    metrics: RouterMetrics
    clock: Callable[[], float]

    async def release(self, attempt: Attempt | None, record: Record | None = None) -> None:
        freed = unstrand = None
        if attempt is not None:
            if attempt.partner is not None and not attempt.partner.done():
                attempt.partner.cancel()  # closes the prefill leg's connection
            if attempt.decode_verdict is not None:
                # A no-op once judged; else no verdict on the worker (the client left, the
                # deadline passed).
                attempt.decode_verdict.abandon()
            if attempt.stranded is not None:
                unstrand = attempt.stranded.release()
            freed = attempt.reservation.release()
        await self.book.finish(freed, unstrand, record)

    def outcome(
        self,
        call: Call,
        info: RequestInfo | None,
        output_tokens: int | None,
        first_token_at: float | None,
        classes: Sequence[str] | None = None,
        tenant: str = "",
    ) -> Record | None:
        """The answer's length, observed (metrics, also by `tenant` where given) and as the
        estimator's record; None when the request produced no answer. `classes`: the classes
        its answer counts in, decided at its estimate (router/request/reserve.py
        `Seat.class_keys`: a named tenant feeds the shared classes only up to its share,
        policies/tenant_classes.py). Without them, a named tenant's own classes only: the
        shared ones are never fed without the counts that bound a tenant's share."""
        metrics = self.metrics
        if output_tokens is None or info is None:
            return None
        metrics.output_tokens.observe(output_tokens)
        if first_token_at is not None and output_tokens > 1:
            per_token = (self.clock() - first_token_at) / (output_tokens - 1)
            metrics.time_per_output_token.observe(per_token)
            if tenant:
                metrics.tenant_tpot_by(tenant).observe(per_token)
        if output_tokens > 0:
            reserved = info.reserve_output_tokens
            metrics.estimate_relative_error.observe((reserved - output_tokens) / output_tokens)
        # The estimator learns the length of one choice (what it estimates): an n-choice
        # answer's tokens are shared by its n choices.
        per_choice = -(-output_tokens // max(1, call.parsed.n))
        keys = list(own_classes(self.estimator.class_keys(info)) if classes is None else classes)
        return keys, self.estimator.bucket_of(per_choice)
