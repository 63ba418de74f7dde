"""Take room back for the cluster's fair share (issue 33): after each sync of the fair share
(router/fair_share.py), a tenant under its share that has waited longer than
`admission.fair_preempt_after_s` with no room gets streams this replica relays of the tenant most
over its share preempted — issue 31's preempt-and-resume (router/request/preemption.py): the
stream's decode stops, its room is given back, its request resumes from the exact text the
client has (a pause, never an error). The rule is policies/fair_share.py `take_back` (newest
dispatch first, never a stream preempted `preemption.max_per_stream` times, a victim over its
share of the pool and never taken below it, for a tenant under its share); the rate is a token
bucket of `admission.fair_preempt_per_s` a second per replica (a burst of one), so the cluster
is never thrashed: with R replicas at most R × that rate, each stream at most max_per_stream
times.
Counted as preemptions_total{reason="fair_share"}.
"""

from __future__ import annotations

from collections.abc import Callable

from policies.fair_share import take_back
from policies.preemption import StreamFacts
from router.admission import AdmissionSettings
from router.fair_share import ClusterShare
from router.request.preemption import Preemptor, Victims

__all__ = ["FAIR_SHARE", "FairTakeBack"]

FAIR_SHARE = "fair_share"  # the preemption's reason (metrics, the request's trace)


class FairTakeBack:
    """Listens to the cluster's fair share and preempts for it (the module's docstring)."""

    def __init__(
        self, settings: AdmissionSettings, preemptor: Preemptor, clock: Callable[[], float]
    ) -> None:
        self.settings = settings
        self.preemptor = preemptor
        self.clock = clock
        self._tokens = 1.0
        self._at = clock()
        self.taken = 0

    def __repr__(self) -> str:
        return f"FairTakeBack(taken={self.taken}, tokens={self._tokens:.2f})"

    @property
    def enabled(self) -> bool:
        s = self.settings
        return s.fair_preempt_after_s > 0 and s.fair_preempt_per_s > 0 and self.preemptor.enabled

    def __call__(self, share: ClusterShare) -> None:
        if not self.enabled or not share.waiters:
            return
        now = self.clock()
        rate = self.settings.fair_preempt_per_s
        self._tokens = min(1.0, self._tokens + (now - self._at) * rate)
        self._at = now
        if self._tokens < 1.0:
            return
        live = [s for s in self.preemptor.live.values() if s.reason is None]
        if not live:
            return
        facts = [
            StreamFacts(
                s.reservation_id, s.tenant, s.decode_id, s.dispatched, s.blocks(), s.preempted
            )
            for s in live
        ]
        chosen = take_back(
            facts,
            share.waiters,
            share.occupancy,
            self.settings.fair_preempt_after_s,
            self.preemptor.settings.max_per_stream,
            int(self._tokens),
        )
        if chosen:
            self._tokens -= len(chosen)
            self.taken += len(chosen)
            self.preemptor.preempt(Victims(chosen, False), FAIR_SHARE)
