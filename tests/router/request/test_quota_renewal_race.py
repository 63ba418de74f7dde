"""A quota hold's renewal or resize racing its request's settle (router/request/quota.py
`renew_all`, `follow`), against a real Redis.

The renewal sends a snapshot of the live holds; the settle drops a hold locally at once and in
the store by its own call. When the settle's call runs first, the renewal finds the hold gone
and puts it back, as it does for one the store lost: the tenant was then charged for blocks no
request held until the lease ended (seen once in the state machine, a 429 for a tenant with
nothing running). A resize is the same: the store's resize puts back a hold it lost, and a
resize sent again on a fresh connection after a lost one can run after the settle."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import pytest

from policies.base import RequestInfo
from policies.scaling import ScalingSLO
from router.metrics import RouterMetrics
from router.request.quota import QuotaGate, QuotaHold
from router.tenants import TenantSpec
from state import open_store
from state.base import StateStore
from state.quotas import Quota
from tests.conftest import REDIS_URL

LEASE = 30.0
LIMIT = 8  # blocks the tenant may hold at once


def _info(request_id: str) -> RequestInfo:
    # 64 prompt tokens and at most 64 more: 8 blocks of 16, the tenant's whole limit.
    return RequestInfo(request_id, "m", prompt_tokens=64, max_tokens=64, tenant="acme")


class _HeldCall:
    """One of the store's calls, let through only when the test says so (the store is real:
    what is held back is when the call reaches it)."""

    def __init__(self, real: Callable[..., Awaitable[Any]]) -> None:
        self.real = real
        self.sent = asyncio.Event()
        self.go = asyncio.Event()

    async def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.sent.set()
        await self.go.wait()
        return await self.real(*args, **kwargs)


async def _room_left(store: StateStore, tenant: TenantSpec, gate_blocks: int) -> bool:
    """Whether a hold of `gate_blocks` more fits the tenant's limit now (taken and dropped)."""
    taken = await store.take_quota(tenant.name, tenant.limits, "probe", 0, gate_blocks, LEASE, 1)
    if taken:
        await store.settle_quota(tenant.name, tenant.limits, "probe", 0)
    return bool(taken)


@dataclass
class Acme:
    """A real Redis store, tenant `acme` limited to LIMIT blocks, its gate, and request r1's
    hold (the whole limit)."""

    store: StateStore
    tenant: TenantSpec
    gate: QuotaGate
    hold: QuotaHold


@pytest.fixture
async def acme(redis_prefix: str) -> AsyncIterator[Acme]:
    store = await open_store(REDIS_URL, redis_prefix)
    try:
        tenant = TenantSpec("acme", limits=Quota(max_reserved_blocks=LIMIT))
        gate = QuotaGate(store, LEASE, ScalingSLO(), RouterMetrics(), clock=lambda: 0.0)
        hold = await gate.take(tenant, _info("r1"))
        assert hold is not None and hold.blocks == LIMIT
        yield Acme(store, tenant, gate, hold)
    finally:
        await store.close()


async def test_a_hold_settled_while_its_renewal_was_on_the_way_is_not_put_back(
    acme: Acme,
) -> None:
    store, tenant, gate, hold = acme.store, acme.tenant, acme.gate, acme.hold
    assert not await _room_left(store, tenant, 1)

    held = _HeldCall(store.renew_quota_holds)
    store.renew_quota_holds = held  # type: ignore[method-assign]
    renewal = asyncio.ensure_future(gate.renew_all())
    await held.sent.wait()  # the snapshot, with r1's hold, is on its way
    await gate.settle(hold, actual_tokens=100)
    assert await _room_left(store, tenant, LIMIT)  # the settle dropped it in the store
    held.go.set()
    await renewal

    # The renewal put it back (the store had lost it) and the gate dropped it again.
    assert await _room_left(store, tenant, LIMIT)
    assert gate.holds == {}


async def test_a_hold_the_store_lost_under_a_live_request_is_still_put_back(acme: Acme) -> None:
    """The other side of the same answer: a hold still held here that the store lost (it was
    down for a lease) is put back and kept, so the tenant cannot run past its limit."""
    store, tenant, gate, hold = acme.store, acme.tenant, acme.gate, acme.hold
    # Lost by the store behind the gate's back.
    await store.settle_quota(tenant.name, tenant.limits, hold.hold_id, 0)
    assert await _room_left(store, tenant, LIMIT)

    await gate.renew_all()
    assert not await _room_left(store, tenant, 1)  # back, at its size
    assert gate.holds == {"acme": {hold.hold_id: LIMIT}}

    await gate.settle(hold, actual_tokens=100)
    assert await _room_left(store, tenant, LIMIT)


async def test_a_hold_settled_while_its_resize_was_on_the_way_is_not_put_back(
    acme: Acme,
) -> None:
    store, tenant, gate, hold = acme.store, acme.tenant, acme.gate, acme.hold
    held = _HeldCall(store.resize_quota_hold)
    store.resize_quota_hold = held  # type: ignore[method-assign]
    growth = asyncio.ensure_future(gate.follow(hold, LIMIT - 2))
    await held.sent.wait()
    await gate.settle(hold, actual_tokens=100)
    assert await _room_left(store, tenant, LIMIT)
    held.go.set()
    assert await growth

    assert await _room_left(store, tenant, LIMIT)  # not put back at LIMIT - 2
    assert gate.holds == {}
