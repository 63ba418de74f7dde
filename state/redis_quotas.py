"""The tenants' quotas of `RedisStore`: one script call each (state/quota_scripts.py), on the
tenant's own hash tag, through the hot-path connection (a request's take and settle are on its
path). The rules: state/quotas.py."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from redis.commands.core import AsyncScript

from state.keys import check_count, check_id, check_lease, check_quota_take
from state.quota_scripts import (
    RENEW_QUOTA_SCRIPT,
    RESIZE_HOLD_SCRIPT,
    SETTLE_QUOTA_SCRIPT,
    TAKE_QUOTA_SCRIPT,
)
from state.quotas import Quota, QuotaTaken
from state.redis_conn import RedisConnection, store_call, text

__all__ = ["RedisQuotas"]


def _limit(value: int | None) -> str | int:
    return "" if value is None else int(value)


def _level(raw: Any) -> int | None:
    s = text(raw)
    return None if s == "" else max(0, int(float(s) // 1))


class RedisQuotas(RedisConnection):
    """The quota methods of the `StateStore` on Redis (mixed into `RedisStore`)."""

    def _register_quota_scripts(self, register: Callable[[str], AsyncScript]) -> None:
        self._take_quota = register(TAKE_QUOTA_SCRIPT)
        self._settle_quota = register(SETTLE_QUOTA_SCRIPT)
        self._renew_quota = register(RENEW_QUOTA_SCRIPT)
        self._resize_hold = register(RESIZE_HOLD_SCRIPT)

    @store_call
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
        args: list[str | int] = [
            self._now(),
            hold_id,
            int(tokens),
            int(blocks),
            repr(float(lease_s)),
            repr(float(ends_in_s)),
            _limit(quota.requests_per_minute),
            _limit(quota.tokens_per_minute),
            _limit(quota.max_reserved_blocks),
        ]
        row = await self._hot_script(self._take_quota, self._keys.tenant_quota(tenant), args)
        granted, limit, wait, requests, tokens_left, held = row
        return QuotaTaken(
            bool(int(granted)),
            text(limit),
            float(text(wait) or 0.0),
            _level(requests),
            _level(tokens_left),
            int(held),
        )

    @store_call
    async def settle_quota(
        self,
        tenant: str,
        quota: Quota,
        hold_id: str,
        correction: int,
        refund_request: bool = False,
    ) -> int:
        args: list[str | int] = [
            self._now(),
            hold_id,
            int(correction),
            _limit(quota.requests_per_minute),
            _limit(quota.tokens_per_minute),
            "1" if refund_request else "0",
        ]
        keys = self._keys.tenant_quota(tenant)
        return int(await self._hot_script(self._settle_quota, keys, args))

    @store_call
    async def renew_quota_holds(
        self, tenant: str, holds: Mapping[str, int], lease_s: float
    ) -> list[str]:
        check_lease(lease_s)
        if not holds:
            return []
        args: list[str | int] = [self._now(), repr(float(lease_s))]
        for hold_id, blocks in holds.items():
            check_count("blocks", blocks)
            args += [check_id("hold_id", hold_id), int(blocks)]
        keys = self._keys.tenant_quota(tenant)
        return [text(h) for h in await self._hot_script(self._renew_quota, keys, args)]

    @store_call
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
        if quota.max_reserved_blocks is None:
            return QuotaTaken(True)
        args: list[str | int] = [
            self._now(),
            hold_id,
            int(blocks),
            repr(float(lease_s)),
            "1" if force else "0",
            int(quota.max_reserved_blocks),
        ]
        keys = self._keys.tenant_quota(tenant)
        granted, wait, held = await self._hot_script(self._resize_hold, keys, args)
        ok = bool(int(granted))
        return QuotaTaken(
            ok,
            "" if ok else "max_reserved_blocks",
            float(text(wait) or 0.0),
            held_blocks=int(held),
        )
