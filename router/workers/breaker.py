"""Per-worker circuit breakers, charged only to the side that failed.

    closed ──(N consecutive failures)──> open ──(cooldown)──> half-open
      ^                                   ^                      │ at most `half_open_probes`
      └──────────(a probe succeeds)───────┼──────────────────────┘ requests in flight
                                          └──(a probe fails: cooldown doubles, up to a cap)

SGLang's router charges both workers of a pair for one side's failure and lets all traffic in
when half-open (docs/design.md §4); here a prefill failure opens only the prefill worker's breaker,
and half-open admits a bounded number of probe requests.

A request is judged by its whole answer, not by its headers: a worker that answers 200 and then
garbage, or goes silent mid-stream, has failed (`Verdict`, owed from dispatch until the answer is
whole, given exactly once). A passing `/health` never closes the breaker: a worker whose API server
lives while its engine is broken answers `/health` fine, so only a real request that works does.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from router.config import BreakerSettings

__all__ = ["BreakerSettings", "CircuitBreaker", "Verdict"]  # the settings: router.config


class CircuitBreaker:
    def __init__(
        self,
        settings: BreakerSettings | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings = settings or BreakerSettings()
        self.clock = clock
        self.failures = 0
        self.opened_at: float | None = None
        self.cooldown_s = settings.cooldown_s
        self.probes_in_flight = 0
        self.trips = 0
        # When a real request last worked (`on_success`): the health prober skips a worker that
        # answered one within its probe interval (router/workers/health_probe.py).
        self.succeeded_at: float | None = None

    @property
    def state(self) -> str:
        if self.opened_at is None:
            return "closed"
        if self.clock() - self.opened_at < self.cooldown_s:
            return "open"
        return "half_open"

    def __repr__(self) -> str:
        return f"CircuitBreaker({self.state}, failures={self.failures}, trips={self.trips})"

    def allows(self) -> bool:
        """May a new request be sent to this worker now?"""
        state = self.state
        if state == "closed":
            return True
        if state == "open":
            return False
        return self.probes_in_flight < self.settings.half_open_probes

    def on_dispatch(self) -> bool:
        """A request is being sent; True if it is a half-open probe (report its outcome!)."""
        if self.state == "half_open":
            self.probes_in_flight += 1
            return True
        return False

    def dispatch(self) -> Verdict | None:
        """A request is being sent: its verdict, to be given once its answer is judged; None
        if the breaker no longer lets it through. Placement asked `allows()` before the
        reservation's round trip, and several requests placed at once on a half-open worker
        would all be sent as its probes (or after it opened again)."""
        if not self.allows():
            return None
        return Verdict(self, self.on_dispatch())

    def on_abandon(self, probe: bool = False) -> None:
        """A request ended with no verdict on the worker (the client left, its deadline passed):
        a probe's place is given back, nothing else changes."""
        if probe:
            self.probes_in_flight = max(0, self.probes_in_flight - 1)

    def on_success(self, probe: bool = False) -> None:
        if probe:
            self.probes_in_flight = max(0, self.probes_in_flight - 1)
        self.failures = 0
        self.succeeded_at = self.clock()
        if self.opened_at is not None and self.state != "open":
            self.opened_at = None
            self.cooldown_s = self.settings.cooldown_s

    def on_failure(self, probe: bool = False) -> None:
        if probe:
            self.probes_in_flight = max(0, self.probes_in_flight - 1)
        self.failures += 1
        if self.opened_at is not None:
            if self.state == "half_open":
                # A failed probe: back off harder before the next one.
                self.cooldown_s = min(self.cooldown_s * 2, self.settings.max_cooldown_s)
                self.opened_at = self.clock()
                self.trips += 1
            return
        if self.failures >= self.settings.failures_to_open:
            self.opened_at = self.clock()
            self.trips += 1


class Verdict:
    """What one dispatched request owes its worker's breaker: `ok()`, `failed()` or
    `abandon()`, whichever comes first; later calls do nothing, so every path out of a request
    may settle it without counting twice (and a half-open probe's place is always given back)."""

    __slots__ = ("breaker", "probe", "settled")

    def __init__(self, breaker: CircuitBreaker, probe: bool) -> None:
        self.breaker, self.probe, self.settled = breaker, probe, False

    def __repr__(self) -> str:
        return f"Verdict(probe={self.probe}, settled={self.settled})"

    def _settle(self) -> bool:
        if self.settled:
            return False
        self.settled = True
        return True

    def ok(self) -> None:
        if self._settle():
            self.breaker.on_success(self.probe)

    def failed(self) -> None:
        if self._settle():
            self.breaker.on_failure(self.probe)

    def abandon(self) -> None:
        if self._settle():
            self.breaker.on_abandon(self.probe)
