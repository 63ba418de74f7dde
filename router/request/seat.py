"""A request's seat under the router's concurrency cap: its place in the admission queue (its
ticket), its tenant, whether it holds a slot, what the fairness policy charged for the
reservation it holds and its share of the tenant's quota (settled at its release,
router/request/lifecycle.py), and the estimator's classes its answer counts in.

Made by the lifecycle for each request, filled in by the reserve stage (router/request/reserve.py,
which names it too).
"""

from __future__ import annotations

from policies.base import Charge, OutputLengthEstimator, RequestInfo
from policies.tenant_classes import own_classes
from router.request.quota import QuotaHold
from router.tenants import TenantSpec

__all__ = ["Seat"]


class Seat:
    """The request's place under the router's concurrency cap: its queue ticket, its tenant,
    whether it has entered (it leaves once, at the end: router/request/lifecycle.py `cleanup`),
    and what the fairness policy charged for the reservation it holds (`charge`, from when it
    was made, `reserved_at`: settled at its release)."""

    __slots__ = (
        "ticket",
        "tenant",
        "admitted",
        "charge",
        "reserved_at",
        "quota",
        "_keyed",
        "_keys",
        "_record",
    )

    def __init__(self, ticket: int, tenant: TenantSpec) -> None:
        self.ticket = ticket
        self.tenant = tenant
        self.admitted = False
        self.charge: Charge | None = None
        self.reserved_at = 0.0
        self.quota: QuotaHold | None = None  # its share of the tenant's quota, settled at the end
        # The estimator's classes of the request as estimated (`keyed`), and those of them its
        # answer counts in (`class_keys`), decided from the statistics read for the estimate.
        self._keyed: RequestInfo | None = None
        self._keys: tuple[str, ...] = ()
        self._record: tuple[str, ...] = ()

    def __repr__(self) -> str:
        return f"Seat(ticket={self.ticket}, tenant={self.tenant.name}, admitted={self.admitted})"

    def class_keys(self, estimator: OutputLengthEstimator, info: RequestInfo) -> tuple[str, ...]:
        """The classes `info`'s answer counts in: its reservation's live overruns and the
        release's record (router/request/lifecycle.py `settle`). Kept from its estimate
        (`keyed`), not computed again (~1.7 us each). Without a named tenant, every class of
        the request; a named tenant's own classes, and the shared ones it may still feed
        (policies/tenant_classes.py `record_keys_for`). For a request not estimated here (or a
        resumed try's other classes): the tenant's own classes only — never feed the shared
        classes without the counts that bound it."""
        if info is self._keyed:
            return self._record
        keys = tuple(estimator.class_keys(info))
        return self._record if keys == self._keys else own_classes(keys)

    def keyed(self, info: RequestInfo, keys: tuple[str, ...], record: tuple[str, ...]) -> None:
        """`info`'s classes are `keys` and its answer counts in `record`: those of the request
        it is the estimate of (a class names the request — model, prompt, cap, hint, tenant —
        never the estimate made for it). A resumed try asks for the rest of the answer under
        other classes: the first estimate's stand, the whole answer is recorded there."""
        if self._keys and keys != self._keys:
            return
        self._keyed, self._keys, self._record = info, keys, record
