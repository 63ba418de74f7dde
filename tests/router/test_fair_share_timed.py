"""The take-back's timing across replicas (router/fair_share.py `ClusterShare.waits`): a line
(class, tenant) that starts to wait where the cluster has not heard of it gets a sync of its own
once it has waited `fair_preempt_after_s`, and the other replicas are nudged to sync at once, so
the take-back (a listener of every sync) reads the waiter past its bound then, not a sync period
later. A backlogged tenant's line, registered already, costs nothing more, and a sync a nudge
asked for nudges no one back.

Real Redis (a key prefix of its own), the replicas' own admission queues and ClusterShares, no
HTTP. The regular sync period is long (5 s) so that a sync seen sooner is the timed one; the
waits here are bounded well under it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import replace

from policies.base import AdmissionCost, Tenant, WaitingRequest
from policies.fair_share import ClusterWaiter
from policies.fairness import VTCFairness
from router.admission import Admission, AdmissionSettings
from router.background import BackgroundTasks
from router.fair_share import _QUIET_PERIODS, ClusterShare
from state import RedisStore
from tests.conftest import REDIS_URL

AFTER_S = 0.05
PERIOD_S = 5.0
COST = AdmissionCost(decode_block_s=1.0, prefill_tokens=0)
VICTIM, AGGRESSOR = Tenant("victim"), Tenant("aggressor")


class Seen:
    """What each sync of one replica read: every replica's waiters."""

    def __init__(self) -> None:
        self.syncs: list[tuple[ClusterWaiter, ...]] = []
        self.changed = asyncio.Event()

    def __call__(self, share: ClusterShare) -> None:
        self.syncs.append(share.waiters)
        self.changed.set()

    async def synced(self, bound_s: float = 3.0) -> None:
        """Until a sync has been seen."""
        async with asyncio.timeout(bound_s):
            while not self.syncs:
                self.changed.clear()
                await self.changed.wait()

    async def until(
        self, want: str, replica: str, waited_s: float = AFTER_S, bound_s: float = 3.0
    ) -> ClusterWaiter:
        """The first waiter line of tenant `want` on `replica` seen waiting `waited_s` (by
        default past the take-back's bound)."""
        async with asyncio.timeout(bound_s):
            while True:
                for waiters in self.syncs:
                    for w in waiters:
                        if w.tenant == want and w.replica == replica and w.waited_s >= waited_s:
                            return w
                self.changed.clear()
                await self.changed.wait()


SETTINGS = AdmissionSettings(
    fairness="vtc", fair_sync_s=PERIOD_S, fair_preempt_after_s=AFTER_S, fair_preempt_per_s=4.0
)


@contextlib.asynccontextmanager
async def replicas(
    redis_prefix: str, n: int, settings: AdmissionSettings = SETTINGS
) -> AsyncIterator[list[tuple[Admission, ClusterShare, Seen]]]:
    store = RedisStore.from_url(REDIS_URL, redis_prefix)
    tasks = BackgroundTasks()
    out = []
    for i in range(n):
        policy = VTCFairness()
        adm = Admission(settings, policy)
        share = ClusterShare(settings, store, adm, policy, tasks, replica=f"r{i}")
        adm.ledger = share
        seen = Seen()
        share.listeners.append(seen)

        async def read_room_now() -> None:
            return None

        share.listen(read_room_now)
        out.append((adm, share, seen))
    try:
        yield out
    finally:
        await tasks.close()
        await store.close()


def _wait(adm: Admission, tenant: Tenant) -> asyncio.Task[int]:
    """A request of `tenant` waiting for room (nothing will free any: it waits until cancelled)."""
    loop = asyncio.get_running_loop()
    request = WaitingRequest(adm.ticket(), tenant, 0, COST)
    return loop.create_task(adm.wait(0, request.ticket, loop.time() + 60, request))


async def _parked(adm: Admission, n: int) -> None:
    """Until `n` requests are parked in `adm`'s queue (a task parks on its first turn)."""
    for _ in range(10):
        if adm.waiting >= n:
            return
        await asyncio.sleep(0)
    raise AssertionError(f"{adm.waiting} parked, not {n}")


async def _heard(share: ClusterShare, nudges: int, bound_s: float = 5.0) -> None:
    """Until `share` has heard `nudges` nudges in all."""
    for _ in range(int(bound_s / 0.01)):
        if share.nudges_heard >= nudges:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"{share.nudges_heard} nudges heard, not {nudges}")


async def _listening(share: ClusterShare, other: ClusterShare) -> None:
    """Until `share`'s nudge subscription is live (subscribing takes a round trip on Redis):
    `other` nudges it, each nudge sent in full before the next, until one is heard."""
    for _ in range(100):
        heard = share.nudges_heard
        await other._nudge(share.replica)
        for _ in range(5):
            if share.nudges_heard > heard:
                return
            await asyncio.sleep(0.01)
    raise AssertionError("the nudges were never heard")


async def _cancel(*tasks: asyncio.Task[int]) -> None:
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def test_a_new_line_is_synced_once_it_has_waited_the_bound(redis_prefix: str) -> None:
    async with replicas(redis_prefix, 1) as [(adm, share, seen)]:
        waiter = _wait(adm, VICTIM)
        try:
            line = await seen.until("victim", "r0")  # long before the 5 s period
            assert line.count == 1
            assert share.checks == 1
            assert share.syncs == 2  # the one its wait started, and the timed one
        finally:
            await _cancel(waiter)


async def test_a_registered_line_asks_for_no_timed_sync(redis_prefix: str) -> None:
    async with replicas(redis_prefix, 1) as [(adm, share, seen)]:
        first = _wait(adm, AGGRESSOR)
        more: list[asyncio.Task[int]] = []
        try:
            await seen.until("aggressor", "r0")
            checks = share.checks
            more = [_wait(adm, AGGRESSOR) for _ in range(20)]  # a backlog: the line is known
            await asyncio.sleep(0)
            assert share.checks == checks and not share._checks
        finally:
            await _cancel(first, *more)


async def test_the_other_replicas_are_nudged_and_do_not_nudge_back(redis_prefix: str) -> None:
    async with replicas(redis_prefix, 2) as [(a0, s0, _), (a1, s1, seen1)]:
        # r1 has a backlog of its own, registered: it is a replica r0 knows to nudge.
        backlog = _wait(a1, AGGRESSOR)
        victim: asyncio.Task[int] | None = None
        try:
            await seen1.until("aggressor", "r1")  # its own timed sync is behind it
            syncs = s1.syncs
            victim = _wait(a0, VICTIM)
            # r1's own regular sync is 5 s away: it reads r0's waiter past the bound because r0
            # nudged it when its timed sync found the line still waiting (and, r0 having seen
            # no waiter before its own, once when it registered the line).
            line = await seen1.until("victim", "r0")
            assert line.count == 1 and syncs + 1 <= s1.syncs <= syncs + 2
            assert s0.nudges_sent >= 1 and s1.nudges_heard >= 1
            assert s1.nudges_sent == 0  # a nudged sync nudges no one back
        finally:
            await _cancel(backlog, *([victim] if victim else []))


async def test_room_taken_back_for_a_waiter_elsewhere_is_left_for_it(redis_prefix: str) -> None:
    """r1 preempted its flood's streams for r0's victim (FairTakeBack calls `leave_for`): the
    room is left to the victim for the claim's time even when the hand-off's own grace has run
    out — here a grace of 0, under which the hand-off leaves nothing at all."""
    store = RedisStore.from_url(REDIS_URL, redis_prefix)
    tasks = BackgroundTasks()
    settings = AdmissionSettings(
        fairness="vtc",
        fair_sync_s=PERIOD_S,
        fair_preempt_after_s=AFTER_S,
        fair_preempt_per_s=4.0,
        fair_handoff_grace_s=0.0,
    )
    pairs = []
    for name in ("r0", "r1"):
        policy = VTCFairness()
        adm = Admission(settings, policy)
        share = ClusterShare(
            settings, store, adm, policy, tasks, replica=name, capacity=lambda: 120
        )
        adm.ledger = share
        pairs.append((adm, share))
    (a0, _), (_, s1) = pairs
    s1.held(0, "aggressor", 105)  # the flood's streams, relayed by r1: over its share of 60
    victim = _wait(a0, VICTIM)
    try:
        async with asyncio.timeout(3.0):
            while not any(w.tenant == "victim" for w in s1.waiters):
                await s1.sync()
        assert s1.hold_s(AGGRESSOR, 0, COST, 15) is None  # the hand-off's grace: none
        s1.leave_for("r0", (0, "victim"), 0.2)
        left = s1.hold_s(AGGRESSOR, 0, COST, 15)
        assert left is not None and 0 < left <= 0.2
        assert s1.hold_s(VICTIM, 0, COST, 15) is None  # the victim's own request may take it
    finally:
        await _cancel(victim)
        await tasks.close()
        await store.close()


async def test_room_taken_back_elsewhere_goes_to_its_line_not_to_the_queues_next(
    redis_prefix: str,
) -> None:
    """The spread row's tail (issue 33): r1 preempts a stream for the victim waiting on r0, but
    r0's own queue also holds an older request of the flooder, next by its order (the victim,
    back from idle, is lifted to the floor: a tie, the older request first). The nudge names
    the line it was for, and r0 wakes that line's waiter first for the claim's time; without
    the line, the flooder's request took the room and the claim kept anyone from taking more
    back for the victim for its time (waits of 0.3-0.6 s)."""
    async with replicas(redis_prefix, 2) as [(a0, s0, _), (_, s1, _)]:
        flood = _wait(a0, AGGRESSOR)  # older: the order's next at a tie
        await asyncio.sleep(0.01)
        victim = _wait(a0, VICTIM)
        try:
            await _parked(a0, 2)
            await _listening(s0, s1)
            heard = s0.nudges_heard
            s1.leave_for("r0", (0, "victim"), 0.5)
            await _heard(s0, heard + 1)
            a0.notify(budget=1)  # the room the preemption frees: one wake-up
            await asyncio.wait({victim, flood}, timeout=3.0, return_when=asyncio.FIRST_COMPLETED)
            assert victim.done() and not flood.done()
        finally:
            await _cancel(flood, victim)


async def test_a_bare_nudge_wakes_the_queue_in_its_order(redis_prefix: str) -> None:
    """The same without a line (a hand-off's nudge, or a replica of an older version): the
    queue's order decides, the older request first."""
    async with replicas(redis_prefix, 2) as [(a0, s0, _), (_, s1, _)]:
        flood = _wait(a0, AGGRESSOR)
        await asyncio.sleep(0.01)
        victim = _wait(a0, VICTIM)
        try:
            await _parked(a0, 2)
            await _listening(s0, s1)
            a0.notify(budget=1)
            await asyncio.wait({victim, flood}, timeout=3.0, return_when=asyncio.FIRST_COMPLETED)
            assert flood.done() and not victim.done()
        finally:
            await _cancel(flood, victim)


async def test_a_quiet_cluster_syncs_a_quiet_period_apart(redis_prefix: str) -> None:
    """Streams in flight and nobody waiting anywhere: the sync only keeps the counters and
    holdings fresh, every `_QUIET_PERIODS` periods (the per-request cost of tenants, issue
    33), and its registration of holdings outlives that period."""
    settings = replace(SETTINGS, fair_sync_s=0.05)
    async with replicas(redis_prefix, 1, settings) as [(_, share, _)]:
        share.held(0, "aggressor", 10)  # a stream in flight: the loop runs
        await asyncio.sleep(1.2)  # 24 periods; 3 quiet ones
        assert not share.contended
        assert 1 <= share.syncs <= 5  # every period: ~24
        assert share.quiet_lease_s >= 2 * _QUIET_PERIODS * 0.05
        assert share.view.held == {(0, "aggressor"): 10}
        share.held(0, "aggressor", -10)


async def test_the_first_waiter_on_a_quiet_cluster_tells_every_replica_at_once(
    redis_prefix: str,
) -> None:
    """r1 relays a stream and nobody waits: it syncs a quiet period apart (here 40 s). r0's
    first waiter is registered at once and r0 nudges every replica registered, holders too, so
    r1 reads it now: its hand-off leaves room for it and its take-back can act, not 40 s on.
    The take-back is off here, so no timed sync's nudge stands in for that one."""
    settings = replace(SETTINGS, fair_preempt_per_s=0.0)
    async with replicas(redis_prefix, 2, settings) as [(a0, s0, _), (_, s1, seen1)]:
        s1.held(0, "aggressor", 100)  # the loop's first sync registers it
        await seen1.synced()
        assert not s1.contended
        await _listening(s1, s0)
        heard = s1.nudges_heard
        victim = _wait(a0, VICTIM)
        try:
            line = await seen1.until("victim", "r0", waited_s=0.0)
            assert line.count == 1 and s1.contended
            assert s1.nudges_heard == heard + 1 and s0.syncs == 1
        finally:
            await _cancel(victim)
