"""Take room back for the cluster's fair share and its priority classes (issue 33): after each
sync of the fair share (router/fair_share.py), a request that has waited longer than
`admission.fair_preempt_after_s` with no room gets streams this replica relays preempted —
issue 31's preempt-and-resume (router/request/preemption.py): the stream's decode stops, its
room is given back, its request resumes from the exact text the client has (a pause, never an
error). Two rules, one decision (policies/fair_share.py `plan_take_back`):

- a request of a more urgent class takes a stream of the least urgent class below its own
  (`take_back_for_class`), counted as preemptions_total{reason="priority"};
- a tenant under its share takes streams of the tenant most over its share, of its own class or
  a less urgent one (`take_back`), counted as preemptions_total{reason="fair_share"}.

Both: newest dispatch first, never a stream preempted `preemption.max_per_stream` times, at most
one per waiting request. The rate is a token bucket of `admission.fair_preempt_per_s` a second
per replica (a burst of one), shared by both rules, so the cluster is never thrashed: with R
replicas at most R × that rate, each stream at most max_per_stream times (so every answer, a
batch one too, completes).
"""

from __future__ import annotations

from collections.abc import Callable

from policies.fair_share import plan_take_back
from policies.preemption import StreamFacts
from router.admission import AdmissionSettings
from router.fair_share import ClusterShare
from router.request.preemption import Preemptor, Victims

__all__ = ["FAIR_SHARE", "PRIORITY", "FairTakeBack"]

# The preemptions' reasons (metrics, the request's trace).
FAIR_SHARE = "fair_share"
PRIORITY = "priority"


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
                s.reservation_id,
                s.tenant,
                s.decode_id,
                s.dispatched,
                s.blocks(),
                s.preempted,
                s.priority,
            )
            for s in live
        ]
        plan = plan_take_back(
            facts,
            share.waiters,
            share.occupancy,
            self.settings.fair_preempt_after_s,
            self.preemptor.settings.max_per_stream,
            int(self._tokens),
        )
        if plan:
            self._tokens -= len(plan)
            self.taken += len(plan)
            if plan.for_class:
                self.preemptor.preempt(Victims(plan.for_class, False), PRIORITY)
            if plan.for_share:
                self.preemptor.preempt(Victims(plan.for_share, False), FAIR_SHARE)
