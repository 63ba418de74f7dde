"""Per-worker circuit breakers, charged only to the side that failed.

    closed ──(N consecutive failures)──> open ──(cooldown)──> half-open
      ^                                   ^                      │ at most `half_open_probes`
      └──────────(a probe succeeds)───────┼──────────────────────┘ requests in flight
                                          └──(a probe fails: cooldown doubles, up to a cap)

SGLang's router charges both workers of a pair for one side's failure and lets all traffic in
when half-open (docs/design.md §4); here a prefill failure opens only the prefill worker's breaker,
and half-open admits a bounded number of probe requests.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["BreakerSettings", "CircuitBreaker"]


@dataclass(frozen=True, slots=True)
class BreakerSettings:
    failures_to_open: int = 3
    cooldown_s: float = 2.0
    max_cooldown_s: float = 60.0
    half_open_probes: int = 1


class CircuitBreaker:
    def __init__(
        self,
        settings: BreakerSettings = BreakerSettings(),
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings
        self.clock = clock
        self.failures = 0
        self.opened_at: float | None = None
        self.cooldown_s = settings.cooldown_s
        self.probes_in_flight = 0
        self.trips = 0

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

    def on_success(self, probe: bool = False) -> None:
        if probe:
            self.probes_in_flight = max(0, self.probes_in_flight - 1)
        self.failures = 0
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

    def on_health(self, ok: bool) -> None:
        """A health probe's verdict: a recovered worker comes back without waiting for traffic."""
        if ok and self.opened_at is not None and self.state == "half_open":
            self.on_success()
