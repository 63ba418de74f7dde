"""A request's share of its tenant's quota: taken before it may wait for decode room, settled
at its end (issue 25; the limits and how the store enforces them across replicas:
state/quotas.py).

`QuotaGate.take` runs once per request, after its first estimate and before its first
reservation (a retry or a resumed stream is the same request: not charged again). It charges
one request, the tokens the request is expected to cost (its prompt and its expected answer:
the estimate's median where there is one, else what is reserved, for each of its `n` choices)
and, where the tenant's decode blocks are limited, a hold of the blocks its reservation is
expected to take. A tenant over a limit gets a 429 naming the limit, with the store's Retry-After
(when the same request would be let through) and OpenAI's `x-ratelimit-*` headers; other tenants
never see it. A tenant without limits costs nothing here: no store call.

The hold is honest: it follows what the request really reserves (`follow`), not the estimate it
was first sized on. Each try's reservation sets it (router/request/lifecycle.py), and a
reservation that grows grows its hold first (router/request/holdings.py): a growth that would
take the tenant past its limit is not granted silently — the tenant's own streams are preempted
for it (router/request/preemption.py), and only when none can be is it forced (counted).

`settle` (once, at the end) drops the hold and corrects the tokens to what the request really
cost: its prompt and its answer's tokens, or nothing for a request that produced no token (a
429 for lack of room, a 503, a client gone before the first token are not billed). A request the
cluster refused (no token, and a 429 for lack of room or a 5xx) also gets its request back: the
tenant's requests per minute pay for what it asked, not for the cluster's trouble. A settle the
store missed (it was down) is not retried: the hold expires with its lease, and only the token
correction is lost.

The holds of live requests are renewed with the reservations (`renew_all`, called from the
lease keeper's renewal tick, router/leases.py), so a request longer than the lease keeps its
blocks counted, and a replica that dies stops renewing: its holds expire.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, replace

from policies.base import OutputEstimate, RequestInfo, blocks_for, extra_choice_tokens
from policies.scaling import ScalingSLO
from router.errors import InvalidRequest, QuotaExceeded
from router.metrics import RouterMetrics
from router.tenants import TenantSpec
from state.base import StateStore, StoreError
from state.quotas import Quota, QuotaTaken

__all__ = [
    "QuotaGate",
    "QuotaHold",
    "over_limit_error",
    "reserved_blocks",
    "within_block_limit",
]

log = logging.getLogger(__name__)

_WORDS = {
    "requests_per_minute": "requests per minute",
    "tokens_per_minute": "tokens per minute",
    "max_reserved_blocks": "reserved decode blocks at once",
}


@dataclass(slots=True)
class QuotaHold:
    """What a request took of its tenant's quota: settled once, at its end."""

    tenant: TenantSpec
    hold_id: str
    tokens: int
    blocks: int  # what the hold counts now (0 when not limited: no hold)
    settled: bool = False  # its request ended (`QuotaGate.settle`)

    @property
    def limited(self) -> bool:
        """The tenant's blocks are limited: the request has a hold in the store."""
        return self.tenant.limits.max_reserved_blocks is not None


def within_block_limit(info: RequestInfo, tenant: TenantSpec) -> RequestInfo:
    """`info` reserving no more than its tenant's `max_reserved_blocks` allow (its estimate
    capped; the answer may still outgrow it, up to the limit: issue 31, "the hold never above
    its limit"). InvalidRequest when its prompt and one token per choice alone pass the limit:
    it could never be held within it."""
    limit = tenant.limits.max_reserved_blocks
    if limit is None:
        return info
    size, n = info.block_size, max(1, info.n)
    extra = extra_choice_tokens(info.prompt_tokens, n, size) if n > 1 else 0
    per_choice = (limit * size - info.prompt_tokens - extra) // n
    if per_choice < 1:
        raise InvalidRequest(
            f"the request needs more decode KV than tenant {tenant.name} may hold at once "
            f"({limit} blocks of {size} tokens): its prompt of {info.prompt_tokens} tokens and "
            f"{n} choice(s) do not fit; shorten the prompt or lower n",
            param="n" if n > 1 else None,
            code="max_reserved_blocks",
        )
    if info.reserve_choice_tokens <= per_choice:
        return info
    estimate = info.estimate or OutputEstimate(info.max_tokens)
    source = f"{estimate.source}; within tenant {tenant.name}'s {limit} blocks"
    return replace(info, estimate=replace(estimate, reserve_tokens=per_choice, source=source))


def over_limit_error(tenant: str, limit: int, blocks: int, sent: int) -> QuotaExceeded:
    """The end of an answer that outgrew its tenant's whole block limit by itself: it could
    never be held within it (no other stream of the tenant to give room back)."""
    return QuotaExceeded(
        f"the answer outgrew tenant {tenant}'s limit of {limit} reserved decode blocks at once "
        f"(it needs {blocks}) after {sent} tokens; ask for fewer tokens (max_tokens) or have "
        "the limit raised",
        limit="max_reserved_blocks",
        retry_after_s=1.0,
    )


def reserved_blocks(info: RequestInfo) -> int:
    """The blocks `info`'s reservation is expected to take (its prompt and reserved answer, in
    the largest decode block size): what its tenant's hold counts for it."""
    return blocks_for(info.prompt_tokens + info.reserve_output_tokens, info.block_size)


def expected_tokens(info: RequestInfo) -> int:
    """Prompt + expected answer, every choice counted (`RequestInfo.expected_choice_tokens`)."""
    return info.prompt_tokens + info.expected_choice_tokens * max(1, info.n)


class QuotaGate:
    def __init__(
        self,
        store: StateStore,
        lease_s: float,
        slo: ScalingSLO,
        metrics: RouterMetrics,
        clock: Callable[[], float],
    ) -> None:
        self.store = store
        self.lease_s = lease_s
        self.slo = slo
        self.metrics = metrics
        self.clock = clock
        # tenant -> its live holds (hold id -> blocks): what `renew_all` renews.
        self.holds: dict[str, dict[str, int]] = {}
        # tenant -> its limits as last taken: what a hold the renewal put back after its
        # settle is dropped with (`renew_all`).
        self.limits: dict[str, Quota] = {}
        # Told of each hold taken: whoever renews them wakes (router/leases.py `wake`).
        self.on_hold: Callable[[], None] | None = None

    def __repr__(self) -> str:
        live = sum(len(h) for h in self.holds.values())
        return f"QuotaGate({live} holds of {len(self.holds)} tenants)"

    async def take(self, tenant: TenantSpec, info: RequestInfo) -> QuotaHold | None:
        """The request's share of `tenant`'s quota, or QuotaExceeded (429); None: no limits.
        A StoreError propagates (503: the store cannot tell whether the tenant is within its
        limits, and no request goes on without that)."""
        quota = tenant.limits
        if not quota:
            return None
        tokens = expected_tokens(info)
        limited = quota.max_reserved_blocks is not None
        blocks = reserved_blocks(info) if limited else 0
        # Expected to hold them until its answer's end at the decode SLO's pace.
        ends_in = self.slo.ttft_slo_s + info.reserve_choice_tokens * self.slo.itl_slo_s
        hold_id = os.urandom(12).hex()
        taken = await self.store.take_quota(
            tenant.name, quota, hold_id, tokens, blocks, self.lease_s, ends_in
        )
        if not taken:
            self.metrics.tenant_rejections.labels(tenant=tenant.name, reason=taken.limit).inc()
            raise _refusal(tenant, quota, taken)
        if limited:
            self.holds.setdefault(tenant.name, {})[hold_id] = blocks
            self.limits[tenant.name] = quota
            if self.on_hold is not None:
                self.on_hold()
        return QuotaHold(tenant, hold_id, tokens, blocks)

    async def follow(self, hold: QuotaHold | None, blocks: int, force: bool = False) -> bool:
        """Make `hold` what its request reserves now (`blocks`); False when that would take the
        tenant past its block limit (nothing changed), unless `force`. A store failure counts
        as granted: the hold is then as stale as the reservation the same store could not grow,
        and the renewal puts it back at its last size."""
        if hold is None or not hold.limited or blocks == hold.blocks:
            return True
        tenant = hold.tenant.name
        try:
            taken = await self.store.resize_quota_hold(
                tenant, hold.tenant.limits, hold.hold_id, blocks, self.lease_s, force
            )
        except StoreError as exc:
            log.debug("quota hold of %s not resized: %s", tenant, exc)
            return True
        if hold.settled:
            # The request ended while the resize was on its way (a resend after a lost
            # connection can run after the settle's drop): the resize put a dropped hold back.
            await self._drop_settled(tenant, hold.tenant.limits, [hold.hold_id])
            return True
        if not taken:
            return False
        hold.blocks = blocks
        held = self.holds.get(tenant)
        if held is not None and hold.hold_id in held:
            held[hold.hold_id] = blocks
        return True

    async def wait_to_follow(self, hold: QuotaHold | None, blocks: int, within_s: float) -> None:
        """`follow` without force, waiting up to `within_s` for the tenant's other holds to
        make room (a preempted stream's continuation: it waits, its client sees a pause);
        QuotaExceeded when they did not."""
        if hold is None:
            return
        until = self.clock() + within_s
        while not await self.follow(hold, blocks):
            if self.clock() >= until:
                quota = hold.tenant.limits
                taken = QuotaTaken(False, "max_reserved_blocks", 1.0)
                raise _refusal(hold.tenant, quota, taken)
            await asyncio.sleep(0.05)

    async def settle(
        self, hold: QuotaHold, actual_tokens: int, refund_request: bool = False
    ) -> None:
        """`hold`'s request ended having cost `actual_tokens` (`refund_request`: the cluster
        refused it, its request is given back). Never raises a StoreError."""
        tenant = hold.tenant.name
        hold.settled = True
        if hold.limited:
            held = self.holds.get(tenant, {})
            held.pop(hold.hold_id, None)
            if not held:
                self.holds.pop(tenant, None)
        correction = actual_tokens - hold.tokens
        limits = hold.tenant.limits
        refund = refund_request and limits.requests_per_minute is not None
        if not hold.limited and not refund and (limits.tokens_per_minute is None or not correction):
            return  # nothing the store would change
        try:
            await self.store.settle_quota(
                tenant, limits, hold.hold_id if hold.limited else "", correction, refund
            )
        except StoreError as exc:
            log.debug("quota of %s not settled (its hold expires with its lease): %s", tenant, exc)

    async def renew_all(self) -> None:
        """Renew every live hold, one call per tenant; failures are logged, not raised.

        The renewal sends a snapshot of the holds. A request that ends while it is on its way
        drops its hold here at once and in the store by its own call, on another connection:
        when that call runs first, the renewal finds the hold gone and puts it back (as it
        does for one the store lost), and the tenant would be charged for blocks nobody holds
        until the lease ends. So a hold put back that is no longer held here is dropped again."""
        for name, held in list(self.holds.items()):
            try:
                back = await self.store.renew_quota_holds(name, dict(held), self.lease_s)
            except StoreError as exc:
                log.warning("quota holds of %s not renewed: %s", name, exc)
                continue
            if not back:
                continue
            live = self.holds.get(name, {})
            settled = [hold_id for hold_id in back if hold_id not in live]
            if len(back) > len(settled):
                log.warning(
                    "%d quota hold(s) of %s were lost: put back", len(back) - len(settled), name
                )
            quota = self.limits.get(name)
            if quota is not None:
                await self._drop_settled(name, quota, settled)

    async def _drop_settled(self, tenant: str, quota: Quota, hold_ids: list[str]) -> None:
        """Drop again the holds a renewal or a resize put back after their requests had
        settled."""
        for hold_id in hold_ids:
            try:
                await self.store.settle_quota(tenant, quota, hold_id, 0)
            except StoreError as exc:
                log.debug("settled hold %s of %s not dropped again: %s", hold_id, tenant, exc)


def _refusal(tenant: TenantSpec, quota: Quota, taken: QuotaTaken) -> QuotaExceeded:
    limit = taken.limit
    value = quota.limit(limit)
    headers: dict[str, str] = {}
    if quota.requests_per_minute is not None:
        headers["x-ratelimit-limit-requests"] = str(quota.requests_per_minute)
        headers["x-ratelimit-remaining-requests"] = str(taken.remaining_requests or 0)
    if quota.tokens_per_minute is not None:
        headers["x-ratelimit-limit-tokens"] = str(quota.tokens_per_minute)
        headers["x-ratelimit-remaining-tokens"] = str(taken.remaining_tokens or 0)
    message = (
        f"tenant {tenant.name} is over its limit of {value} {_WORDS.get(limit, limit)}; "
        f"the same request would be let through in {taken.retry_after_s:.1f} s"
    )
    return QuotaExceeded(
        message, limit=limit, retry_after_s=taken.retry_after_s, rate_headers=headers
    )
