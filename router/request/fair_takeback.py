"""Take room back for the cluster's fair share and its priority classes (issue 33): after each
sync of the fair share (router/fair_share.py), a request that has waited longer than
`admission.fair_preempt_after_s` with no room gets streams this replica relays preempted —
issue 31's preempt-and-resume (router/request/preemption.py): the stream's decode stops, its
room is given back, its request resumes from the exact text the client has (a pause, never an
error). Two rules, one decision (policies/fair_share.py `plan_take_back`):

- a request of a more urgent class takes a stream of the least urgent class below its own
  (`take_back_for_class`), counted as preemptions_total{reason="priority"};
- a tenant whose waiting requests fit within its share takes streams of the tenant most over its
  share, of its own class or a less urgent one (`take_back`), counted as
  preemptions_total{reason="fair_share"}.

Both: newest dispatch first, never a stream preempted `preemption.max_per_stream` times, at most
one per waiting request — in the cluster, not per replica: every replica reads every waiter, so
before it preempts a replica claims in the store the waiting requests its streams make room for
(`StateStore.fair_claim`, for `claim_ttl_s`: about the time the room takes to reach the waiter
and the waiter's registration to show it), and preempts only for those it got. Without it each
replica holding the flooder's streams preempted one for the same request (issue 33's bench: 2×
the preemptions with the tenants spread over two replicas).

The rate is a token bucket of `admission.fair_preempt_per_s` a second per replica (a burst of
`TAKE_BACK_BURST`, 2), shared by both rules, so the cluster is never thrashed: with R
replicas at most R × that rate, each stream at most max_per_stream times (so every answer, a
batch one too, completes).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable

from policies.fair_share import TAKE_BACK_BURST, TakeBack, plan_take_back
from policies.preemption import StreamFacts
from router.admission import AdmissionSettings
from router.fair_share import ClusterShare, claim_ttl_s
from router.request.preemption import FAIR_SHARE, PRIORITY, Preemptor, Victims
from state.base import StoreError

__all__ = ["FAIR_SHARE", "PRIORITY", "FairTakeBack", "claim_ttl_s"]

log = logging.getLogger(__name__)


class FairTakeBack:
    """Listens to the cluster's fair share and preempts for it (the module's docstring)."""

    def __init__(
        self, settings: AdmissionSettings, preemptor: Preemptor, clock: Callable[[], float]
    ) -> None:
        self.settings = settings
        self.preemptor = preemptor
        self.clock = clock
        self._tokens = float(TAKE_BACK_BURST)
        self._at = clock()
        self.taken = 0

    def __repr__(self) -> str:
        return f"FairTakeBack(taken={self.taken}, tokens={self._tokens:.2f})"

    @property
    def enabled(self) -> bool:
        s = self.settings
        return s.fair_preempt_after_s > 0 and s.fair_preempt_per_s > 0 and self.preemptor.enabled

    async def __call__(self, share: ClusterShare) -> None:
        if not self.enabled or not share.waiters:
            return
        now = self.clock()
        rate = self.settings.fair_preempt_per_s
        self._tokens = min(TAKE_BACK_BURST, self._tokens + (now - self._at) * rate)
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
        if not plan:
            return
        granted = await self._claim(share, plan)
        for_class = plan.claimed(plan.for_class, granted)
        for_share = plan.claimed(plan.for_share, granted)
        taken = len(for_class) + len(for_share)
        self._tokens -= taken
        self.taken += taken
        # The room is the waiters' it was taken for: one here is woken before the order's
        # next; for one on another replica the room is left (and that replica nudged) for as
        # long as the claim, whatever the hand-off's grace has left (router/fair_share.py).
        for stream in (*for_class, *for_share):
            replica, priority, tenant = plan.serves[stream]
            if replica == share.replica:
                share.admission.earmark(priority, tenant, claim_ttl_s(self.settings))
            else:
                share.leave_for(replica, (priority, tenant), claim_ttl_s(self.settings))
        if for_class:
            self.preemptor.preempt(Victims(for_class, False), PRIORITY)
        if for_share:
            self.preemptor.preempt(Victims(for_share, False), FAIR_SHARE)

    async def _claim(self, share: ClusterShare, plan: TakeBack) -> Counter[tuple[str, int, str]]:
        """The waiting requests the plan makes room for, claimed in the store: how many of each
        line this replica got (none when the store does not answer: preempting blind could
        take twice)."""
        wanted = Counter(plan.serves.values())
        counts = {(w.replica, w.priority, w.tenant): w.count for w in share.waiters}
        names = {line: "|".join(map(str, line)) for line in wanted}
        try:
            got = await share.store.fair_claim(
                {names[line]: (counts.get(line, n), n) for line, n in wanted.items()},
                share.replica,
                claim_ttl_s(self.settings),
            )
        except StoreError as exc:
            log.debug("fair take-back: no claim (%s)", exc)
            return Counter()
        return Counter({line: got.get(names[line], 0) for line in wanted})
