"""Room kept for its tenant (router/fair_share.py `ClusterShare.held`, policies/fair_share.py
`keeps_room`): an answer of a tenant within its share ends, and its room waits
`admission.fair_keep_s` for that tenant's next request; requests of a tenant over its share are
held off meanwhile, a tenant within its own is not. Without it a client that sends its next
request as its answer ends found the room taken by a flood's waiter and waited for a take-back
(issue 33's back-to-back rows: victim TTFT p50 0.08 s, a preemption per victim request).

Real Redis (a key prefix of its own), one replica's admission queue and ClusterShare, a clock
the test moves."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from policies.base import AdmissionCost, Tenant
from policies.fairness import VTCFairness
from router.admission import Admission, AdmissionSettings
from router.background import BackgroundTasks
from router.fair_share import ClusterShare
from state import RedisStore
from tests.conftest import REDIS_URL

COST = AdmissionCost(decode_block_s=1.0, prefill_tokens=0)
VICTIM, AGGRESSOR, SMALL = Tenant("victim"), Tenant("aggressor"), Tenant("small")
KEEP_S = 0.05


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@contextlib.asynccontextmanager
async def replica(
    redis_prefix: str, keep_s: float = KEEP_S
) -> AsyncIterator[tuple[ClusterShare, Clock]]:
    store = RedisStore.from_url(REDIS_URL, redis_prefix)
    tasks = BackgroundTasks()
    settings = AdmissionSettings(fairness="vtc", fair_sync_s=5.0, fair_keep_s=keep_s)
    policy = VTCFairness()
    adm = Admission(settings, policy)
    clock = Clock()
    share = ClusterShare(settings, store, adm, policy, tasks, clock, "r0", capacity=lambda: 120)
    adm.ledger = share
    try:
        yield share, clock
    finally:
        await tasks.close()
        await store.close()


async def _holding(share: ClusterShare, held: dict[str, int]) -> None:
    """This replica's tenants hold `held` blocks, as the store has them after a sync."""
    for tenant, blocks in held.items():
        share.held(0, tenant, blocks)
    await share.sync()


async def test_the_room_waits_for_its_tenants_next_request(redis_prefix: str) -> None:
    async with replica(redis_prefix) as (share, clock):
        await _holding(share, {"victim": 15, "aggressor": 105})  # shares of 60 each
        share.held(0, "victim", -15)  # the victim's answer ended
        held_off = share.hold_s(AGGRESSOR, 0, COST, 15)
        assert held_off is not None and 0 < held_off <= KEEP_S
        assert share.hold_s(VICTIM, 0, COST, 15) is None  # its own next request takes it
        assert share.hold_s(SMALL, 0, COST, 15) is None  # a tenant within its share may too
        share.held(0, "victim", 15)  # the victim's next request got it
        assert share.hold_s(AGGRESSOR, 0, COST, 15) is None


async def test_the_keep_lapses(redis_prefix: str) -> None:
    async with replica(redis_prefix) as (share, clock):
        await _holding(share, {"victim": 15, "aggressor": 105})
        share.held(0, "victim", -15)
        assert share.hold_s(AGGRESSOR, 0, COST, 15) is not None
        clock.now += KEEP_S
        assert share.hold_s(AGGRESSOR, 0, COST, 15) is None


async def test_nothing_is_kept_without_a_flood_or_for_a_tenant_over_its_share(
    redis_prefix: str,
) -> None:
    async with replica(redis_prefix) as (share, _):
        await _holding(share, {"victim": 15, "aggressor": 45})  # nobody over a share
        share.held(0, "victim", -15)
        assert share.hold_s(AGGRESSOR, 0, COST, 15) is None
    async with replica(redis_prefix) as (share, _):
        await _holding(share, {"victim": 15, "aggressor": 105})
        share.held(0, "aggressor", -15)  # the flood's answer ended: not kept for it
        assert share.hold_s(VICTIM, 0, COST, 15) is None


async def test_a_keep_of_zero_keeps_nothing(redis_prefix: str) -> None:
    async with replica(redis_prefix, keep_s=0.0) as (share, _):
        await _holding(share, {"victim": 15, "aggressor": 105})
        share.held(0, "victim", -15)
        assert share.hold_s(AGGRESSOR, 0, COST, 15) is None
