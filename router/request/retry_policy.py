"""When a request tries again after a failure before the client got a byte, and how long it
waits first: one policy for both request paths (router/request/lifecycle.py, where a try is a
prefill/decode pair, and router/edge/passthrough.py, where it is one worker).

A request makes at most `retry.max_attempts` tries (the SRE book's 3). Each try after the
first spends one retry of the cluster-wide budget (router/retry_budget.py: `budget_ratio` x
recent requests + a floor, shared by every replica through the store), so that a cluster-wide
outage does not multiply its own load by the attempts cap. Out of either, the request ends with
a 503 that says which and quotes the last failure. Before a retry the request waits with full
jitter (AWS's "Exponential Backoff And Jitter"): uniform in [0, min(cap, base x 2^(tries-1))],
so that the clients a failure hit together do not come back together. The jitter is seeded by
the request id: the same request backs off the same way in a test.

Metrics: `retries` by the side that failed, `retry_budget_exhausted` for the retries refused.
"""

from __future__ import annotations

import asyncio
import random

from router.config import RetrySettings
from router.errors import Unavailable
from router.metrics import RouterMetrics
from router.request.attempt import LegFailure
from router.retry_budget import RetryBudget

__all__ = ["RetryPolicy"]


class RetryPolicy:
    """One request's tries: `begin()` once, `attempt()` at the start of each try, then
    `before_retry(failure)` when one fails in a way another worker may not (it raises the 503
    when the request may not try again). `tried` are the workers that failed it, for the next
    pick to avoid."""

    __slots__ = (
        "_settings",
        "_budget",
        "_metrics",
        "_request_id",
        "_rng",
        "attempts",
        "counted",
        "_room_waits",
        "tried",
    )

    def __init__(
        self,
        settings: RetrySettings,
        budget: RetryBudget,
        metrics: RouterMetrics,
        request_id: str,
    ) -> None:
        self._settings, self._budget, self._metrics = settings, budget, metrics
        self._request_id = request_id
        # Seeded on the first retry: most requests never retry, and seeding costs ~5 us (a
        # SHA-512 of the id), a request's worth of relay work. Nothing draws from it before,
        # so the same request backs off the same way.
        self._rng: random.Random | None = None
        self.attempts = 0
        # The tries the cap counts: a preempted stream's continuation is not a retry (the
        # router stopped it for room; no worker failed it), so it spends none.
        self.counted = 0
        self._room_waits = 0
        self.tried: set[str] = set()

    def __repr__(self) -> str:
        return f"RetryPolicy(attempts={self.attempts}, tried={sorted(self.tried)})"

    def begin(self) -> None:
        """Count the request toward the budget's window (its first try is no retry)."""
        self._budget.note_request()

    def attempt(self, counted: bool = True) -> int:
        """A try starts: its number, from 1. `counted=False` for a preempted stream's
        continuation, which the attempts cap does not count."""
        self.attempts += 1
        self.counted += counted
        return self.attempts

    async def wait_for_room(self) -> None:
        """Pause before a preempted stream's continuation asks again for room that a worker
        refused (429/503 while the ledger thought it free): jittered back-off like a retry's,
        with no retry spent (the caller bounds the waiting by its own deadline)."""
        self._room_waits += 1
        await self._back_off(self._room_waits)

    async def _back_off(self, tries: int) -> None:
        """Full jitter: uniform in [0, min(cap, base x 2^(tries-1))], seeded by the request id
        (seeded only here: most requests never back off, and seeding costs ~5 us)."""
        r = self._settings
        if self._rng is None:
            self._rng = random.Random(self._request_id)
        backoff = min(r.backoff_max_s, r.backoff_base_s * 2 ** (tries - 1))
        await asyncio.sleep(self._rng.uniform(0, backoff))

    async def before_retry(self, failure: LegFailure) -> None:
        """After `failure` (retryable), spend a retry and back off; or raise the 503 when the
        attempts cap or the cluster-wide budget says no. StoreError when the store, which
        holds the budget, does not answer."""
        r = self._settings
        self.tried.add(failure.worker_id)
        if self.counted >= r.max_attempts:
            raise Unavailable(
                f"gave up after {self.counted} attempts; last: {failure.error.message}",
                retry_after_s=1.0,
            ) from failure
        if not await self._budget.try_retry():
            self._metrics.retry_budget_exhausted.inc()
            raise Unavailable(
                f"the cluster-wide retry budget is spent; not retrying: {failure.error.message}",
                retry_after_s=1.0,
            ) from failure
        self._metrics.retries.labels(side=failure.side).inc()
        await self._back_off(self.counted)
