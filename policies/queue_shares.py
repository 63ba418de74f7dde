"""Queue shares: who gives up a place when the admission queue is full (issue 31).

The admission queue's cap (`admission.max_waiters`, per router replica) is shared by the
tenants' weights. Without a share, one tenant keeping more requests open than the cap holds
every place, and every request of every other tenant is refused at the door: the fairness
policy (policies/fairness.py) never sees them, whatever their weights.

**The rule.** The queue is full and a request of tenant b arrives. The tenants holding places
are compared by their *load*, places held / weight — the same order as places held over their
share by weight (cap × weight / the weights of the tenants holding places), as the share is
the cap over the weights times the weight. The victim is the most loaded tenant other than b
(ties: the one holding more places, then the first name); its newest waiter gives its place
to b's request when b, with that request in, is still strictly less loaded than the victim
was:

    (b's places + 1) / b's weight  <  victim's places / victim's weight

Otherwise b's request is the one refused. So:

- a tenant below its share by at least one request always gets in (the places of the others
  then add up to more than their shares: one of them is over its share, and more loaded than
  b will be);
- a tenant at or over its share is refused, as the queue refused everyone before;
- the strict inequality makes a swap never undo itself: after it, the victim's next request
  finds b at most as loaded as it is itself, and is refused (with `<=`, two tenants one place
  apart would trade a place back and forth on every arrival);
- with one tenant (no tenants configured: everyone is `default`) there is no victim, and a
  full queue refuses as it always did.

Places held are the queue's waiters, not the requests being served: the share is of the
queue, which the fairness policy then orders. Pure and deterministic; the bookkeeping (which
tickets hold places, the eviction itself) is router/admission.py's.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["queue_share", "queue_share_victim"]


def queue_share_victim(
    arriving: str, weight: float, holders: Iterable[tuple[str, int, float]]
) -> str | None:
    """The tenant whose newest waiter gives its place to a request of `arriving` (of `weight`)
    in a full queue, or None: the arriving request is refused. `holders`: (tenant, places
    held, weight) of the tenants holding places (those with none are ignored); `arriving`'s
    own places are read from it."""
    own = 0
    victim: str | None = None
    best = (0.0, 0)  # (load, places) of the victim so far
    for name, places, holder_weight in holders:
        if name == arriving:
            own = places
            continue
        if places <= 0:
            continue
        key = (places / holder_weight, places)
        if victim is None or key > best or (key == best and name < victim):
            victim, best = name, key
    if victim is None or not (own + 1) / weight < best[0]:
        return None
    return victim


def queue_share(
    tenant: str, weight: float, holders: Iterable[tuple[str, int, float]], capacity: int
) -> float:
    """`tenant`'s share of a queue of `capacity` places: the capacity by weight among the
    tenants holding places and `tenant` itself (for the messages and the metrics)."""
    total = weight
    for name, places, holder_weight in holders:
        if name != tenant and places > 0:
            total += holder_weight
    return capacity * weight / total
