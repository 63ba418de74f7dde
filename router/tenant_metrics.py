"""Per-tenant metrics of the fair share (issue 33): who holds the decode pool against its share,
who waits, how long a tenant's requests waited to be admitted, and whose streams were preempted.

**Bounded labels.** Tenants are configured, so a `tenant` label takes one value per configured
tenant plus `default` (the anonymous tenant of the open mode). The fair-share gauges read the
store's view, which names the tenants of *every* replica: a name this replica does not know (a
replica with another configuration) is counted under `other`, so a foreign or stale entry in
the store cannot grow the label set.

What is set where:

- `tenant_decode_blocks_held`, `tenant_decode_share_blocks`, `tenant_waiting` (gauges): after
  a sync of the cluster's fair share (router/fair_share.py `ClusterShare`, vtc with
  `admission.fair_cluster`), at most once a second and always when the sync shows nothing
  held or waiting, from its occupancy and waiters (`ShareGauges`, a listener of the sync:
  nothing on a request's path). Every replica sees the same cluster, so the dashboard
  takes the max over replicas. A tenant that stops holding or waiting is set back to 0.
- `tenant_admission_wait_seconds` (histogram): at each admission, from the admission queue
  (router/admission.py `wait_observer`); 0 when the request found room at once.
- `tenant_preemptions_total{tenant, reason}`: counted where a preempted stream resumes
  (router/request/lifecycle.py); its `fair_share` series are made at start, at 0, so the rate
  of preemptions taken back for the fair share is a number (0), not an absent series.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable

from policies.fair_share import ClusterWaiter, Occupancy
from router.admission import Admission
from router.fair_share import ClusterShare
from router.metrics import Labelled, RouterMetrics

__all__ = ["DEFAULT", "OTHER", "ShareGauges", "TenantWaits", "watch_tenants"]

DEFAULT = "default"  # router/tenants.py DEFAULT_TENANT: the open mode's anonymous tenant
OTHER = "other"  # a tenant named in the store that this replica does not know


class ShareGauges:
    """A `ClusterShare` listener: after each sync, each known tenant's blocks held, share of
    the pool and waiting requests (the module's docstring)."""

    __slots__ = (
        "known",
        "period_s",
        "clock",
        "_held",
        "_share",
        "_waiting",
        "_other_seen",
        "_next",
    )

    def __init__(
        self,
        metrics: RouterMetrics,
        tenants: Iterable[str],
        period_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.known = frozenset(tenants) | {DEFAULT}
        # Syncs come every admission.fair_sync_s (0.05 s) while busy; a scrape every few
        # seconds needs no more than one update a second (1,000 tenants: 3,000 gauges).
        self.period_s = period_s
        self.clock = clock
        self._next = -math.inf
        self._held = Labelled(metrics.tenant_decode_blocks_held)
        self._share = Labelled(metrics.tenant_decode_share_blocks)
        self._waiting = Labelled(metrics.tenant_waiting)
        self._other_seen = False

    def __repr__(self) -> str:
        return f"ShareGauges({len(self.known)} tenants)"

    def __call__(self, share: ClusterShare) -> None:
        self.update(share.occupancy, share.waiters)

    def label(self, tenant: str) -> str:
        return tenant if tenant in self.known else OTHER

    def update(self, occupancy: Occupancy, waiters: Iterable[ClusterWaiter]) -> None:
        waiters = tuple(waiters)
        quiet = not any(occupancy.held.values()) and not waiters
        now = self.clock()
        if now < self._next and not quiet:
            return  # at most one update a period; the quiet state is always shown
        self._next = now + self.period_s
        held = _by_label(self.label, occupancy.held.items())
        waiting = _by_label(self.label, ((w.tenant, w.count) for w in waiters))
        # A tenant's share without Occupancy.share's sum over the active tenants per tenant:
        # one sum, so an update is O(tenants), not O(tenants x active).
        active_weight = sum(occupancy.weight(t) for t in occupancy.active)
        for tenant in self.known:
            self._held(tenant).set(held.get(tenant, 0))
            self._waiting(tenant).set(waiting.get(tenant, 0))
            if occupancy.capacity > 0:
                w = occupancy.weight(tenant)
                total = active_weight + (0.0 if tenant in occupancy.active else w)
                self._share(tenant).set(occupancy.capacity * w / total)
        if held.get(OTHER) or waiting.get(OTHER) or self._other_seen:
            self._other_seen = True  # then kept, so that it goes back to 0
            self._held(OTHER).set(held.get(OTHER, 0))
            self._waiting(OTHER).set(waiting.get(OTHER, 0))


def _by_label(label: Callable[[str], str], pairs: Iterable[tuple[str, int]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for tenant, n in pairs:
        key = label(tenant)
        out[key] = out.get(key, 0) + n
    return out


class TenantWaits:
    """The admission queue's `wait_observer`: each admission's wait, by tenant."""

    __slots__ = ("_by",)

    def __init__(self, metrics: RouterMetrics) -> None:
        self._by = metrics.tenant_admission_wait_by

    def __call__(self, tenant: str, waited_s: float) -> None:
        self._by(tenant).observe(max(0.0, waited_s))


def watch_tenants(
    metrics: RouterMetrics,
    admission: Admission,
    share: ClusterShare | None,
    tenants: Iterable[str],
) -> None:
    """Wire the per-tenant metrics: the queue's waits, the fair share's gauges (when the
    cluster's fair share runs) and the `fair_share` preemption series at 0 for every known
    tenant."""
    names = [*tenants]
    admission.wait_observer = TenantWaits(metrics)
    if share is not None:
        share.listeners.append(ShareGauges(metrics, names))
    for tenant in {*names, DEFAULT}:
        metrics.tenant_preemptions_by(tenant, "fair_share")
