"""The tenants' quotas of `MemoryStore` (state/quotas.py has the rules and the arithmetic,
which this only applies: no method awaits, so each is atomic like the Redis script)."""

from __future__ import annotations

from collections.abc import Callable, Mapping

from state.keys import check_count, check_id, check_lease, check_quota_take
from state.quotas import (
    Buckets,
    Quota,
    QuotaTaken,
    renew_holds_now,
    resize_hold_now,
    settle_quota_now,
    take_quota_now,
)

__all__ = ["MemoryQuotas"]


class MemoryQuotas:
    """A mixin of `MemoryStore`: it provides `_clock` and `_quotas`."""

    _clock: Callable[[], float]
    _quotas: dict[str, Buckets]

    def _buckets(self, tenant: str) -> Buckets:
        state = self._quotas.get(check_id("tenant", tenant))
        if state is None:
            state = self._quotas[tenant] = Buckets(at_s=self._clock())
        return state

    async def take_quota(
        self,
        tenant: str,
        quota: Quota,
        hold_id: str,
        tokens: int,
        blocks: int,
        lease_s: float,
        ends_in_s: float,
    ) -> QuotaTaken:
        check_quota_take(hold_id, tokens, blocks, lease_s)
        state = self._buckets(tenant)
        return take_quota_now(
            state, quota, self._clock(), hold_id, tokens, blocks, lease_s, ends_in_s
        )

    async def settle_quota(
        self,
        tenant: str,
        quota: Quota,
        hold_id: str,
        correction: int,
        refund_request: bool = False,
    ) -> int:
        state = self._quotas.get(check_id("tenant", tenant))
        if state is None:
            return 0
        now = self._clock()
        return settle_quota_now(state, quota, now, hold_id, int(correction), refund_request)

    async def resize_quota_hold(
        self,
        tenant: str,
        quota: Quota,
        hold_id: str,
        blocks: int,
        lease_s: float,
        force: bool = False,
    ) -> QuotaTaken:
        check_id("hold_id", hold_id)
        check_count("blocks", blocks)
        check_lease(lease_s)
        state = self._buckets(tenant)
        return resize_hold_now(state, quota, self._clock(), hold_id, blocks, lease_s, force)

    async def renew_quota_holds(
        self, tenant: str, holds: Mapping[str, int], lease_s: float
    ) -> list[str]:
        check_lease(lease_s)
        if not holds:
            return []
        for blocks in holds.values():
            check_count("blocks", blocks)
        return renew_holds_now(self._buckets(tenant), self._clock(), holds, lease_s)
