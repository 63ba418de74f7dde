"""One fair share for the cluster, not per replica (issue 33): the `vtc` order's counters and who
waits where, shared by every router replica through the store.

**What is shared, and when.** Each replica adds up the charges its admissions and settlements
make (router/admission.py `Ledger`) and, once every `admission.fair_sync_s` while it has
anything in flight, waiting or to send, sends them with its waiting tenants (per class and
tenant: how many, how long the oldest has waited) and the decode blocks its admitted requests
hold per tenant, in one store call (`StateStore.fair_sync`,
state/fair_shares.py: one script on one Redis Cluster slot). The answer — the floors, the
counters of every tenant waiting anywhere and of those it named, every replica's waiters — is
adopted by its policy (`VTCFairness.adopt`, plus what it charged while the call was out), so
every replica orders its queue by the cluster's counters, at most one sync period old. A
request's own path makes no store call for it: round trips per request are unchanged (two: the
reservation and the end's `finish`), and a busy replica makes one call a period — while a tenant
waits anywhere. While nobody does, the counters and holdings only need to be fresh for when one
starts, and the call is `_QUIET_PERIODS` periods apart (0.4 s by default); the first request to
wait on such a cluster is registered at once, and its replica nudges every replica registered
(waiting or holding blocks), which then syncs at once and every period. A tenant that starts to
wait anywhere is lifted to the floor in the store (VTC: no credit banked while idle).

**Hand-off: the rule and its bound** (policies/fair_share.py `handoff_to`). Room that frees on a
decode worker goes to the cluster's most under-served waiting tenant, whichever replica holds
its request: a replica about to place a request of tenant t first asks whether a tenant waits on
another replica that is more urgent, or whose counter is below t's by more than one of t's
requests (its units / weight), or — while t holds more than its share of the pool — that would
still be within its own share with the room. If so it leaves the room — the request waits as if
none were free — and nudges the other replica through the store's pub/sub (`fair_nudge`): it
reads the store at once, sees the room and its waiter takes it, instead of at its next state
refresh (`loops.state_refresh_s`, 0.1 s; a lost nudge costs that much, nothing more). One nudge
per hold, not per request held. Bounded: a replica leaves room at most
`admission.fair_handoff_grace_s` from the first request it held back (a wake-up is set for
then), then anyone takes it, and it does not hold back again for another grace. So room is
never left idle longer than the grace (plus a sync period for a stale registration), and at
least half of any stretch in which the other replica never claims it is work-conserving.

**Taking room back** (router/request/fair_takeback.py listens to each sync): a tenant starved
past `admission.fair_preempt_after_s` gets streams of the tenant most over its share preempted
on the replica that relays them (each replica acts for its own streams, reading every replica's
waiters; before it preempts it claims the waiting requests it makes room for in the store, so
that two replicas do not both preempt for one request), at most `admission.fair_preempt_per_s`
a second each. The bound is kept to the sync, not to the grid: a line (class, tenant) that
starts to wait where this replica had not registered it gets a sync of its own once it has
waited the bound (`waits`), and if it still waits the replicas with a registration are nudged
to sync at once — the streams to take back may be theirs. A backlogged tenant's line is
registered already: a flood asks for no extra sync.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import time
from collections.abc import Awaitable, Callable, Mapping

from policies.base import AdmissionCost, Tenant
from policies.fair_share import (
    ClusterWaiter,
    Occupancy,
    handoff_to,
    keeps_room,
    under_share,
    yields_kept_room,
)
from policies.fairness import VTCFairness
from router.admission import Admission, AdmissionSettings
from router.background import BackgroundTasks
from state.base import StateStore, StoreError
from state.fair_shares import FairSlot, FairView

__all__ = ["ClusterShare", "claim_ttl_s"]

log = logging.getLogger(__name__)

# Syncs with nothing to send, nothing waiting and nothing in flight before the loop stops (a
# charge or a wait starts it again).
_IDLE_SYNCS = 3
# A registration outlives this many sync periods (and at least a second: a loaded replica's
# loop may be late) before the store drops it: a replica that dies stops renewing.
_LEASE_PERIODS = 10
# While no tenant waits anywhere (as of the last sync) a sync only keeps the store's counters
# and holdings fresh for when one starts: it runs this many periods apart. A busy cluster with
# room for everyone then costs an eighth of the calls (issue 33's per-request cost).
_QUIET_PERIODS = 8
# A timed sync fires this much after the wait it is for reached `fair_preempt_after_s`: the
# loop's timers may fire a hair early, and the waiter's age must be past the bound.
_CHECK_MARGIN_S = 0.002


def claim_ttl_s(settings: AdmissionSettings) -> float:
    """How long a claimed waiting request is not claimed again (router/request/fair_takeback.py),
    and how long room taken back for it is its: the room's way to it (a nudge, a placement)
    and its replica's and the taker's next syncs, 4 sync periods, at least 0.1 s."""
    return max(0.1, 4 * settings.fair_sync_s)


class ClusterShare:
    """This replica's part of the cluster's fair share (the module's docstring)."""

    def __init__(
        self,
        settings: AdmissionSettings,
        store: StateStore,
        admission: Admission,
        policy: VTCFairness,
        tasks: BackgroundTasks,
        clock: Callable[[], float] = time.monotonic,
        replica: str | None = None,
        weights: Mapping[str, float] | None = None,
        capacity: Callable[[], int] = lambda: 0,
    ) -> None:
        self.settings = settings
        self.store = store
        self.admission = admission
        self.policy = policy
        self.tasks = tasks
        self.clock = clock
        self.replica = replica or os.urandom(6).hex()
        self.weights = dict(weights or {})  # the configured tenants' (absent: 1)
        self.capacity = capacity  # the decode pool's blocks, as the replica sees it
        # A registration with waiters is renewed every period; one that only holds blocks,
        # every quiet period at the slowest.
        self.lease_s = max(1.0, _LEASE_PERIODS * settings.fair_sync_s)
        self.quiet_lease_s = max(1.0, _LEASE_PERIODS * _QUIET_PERIODS * settings.fair_sync_s)
        self.waiters: tuple[ClusterWaiter, ...] = ()  # every replica's, as of the last sync
        self.view = FairView()
        # Each tenant's latest admission charge (units / weight): one of its requests.
        self.request_units: dict[str, float] = {}
        # Told after each sync (router/request/fair_takeback.py, router/tenant_metrics.py), in
        # turn; one that answers an awaitable is awaited before the next.
        self.listeners: list[Callable[[ClusterShare], Awaitable[None] | None]] = []
        self.syncs = 0
        self.failures = 0
        self._pending: dict[FairSlot, float] = {}
        self._holding: dict[FairSlot, int] = {}  # blocks this replica's admitted requests hold
        self.occupancy = Occupancy(0, {}, self.weights, frozenset())
        self._task: asyncio.Task[None] | None = None
        self._holding_since: float | None = None
        self._open_until = -math.inf
        # Room this replica took back for a waiter on another replica is left for it until
        # then, whatever the hand-off's grace has left (`leave_for`).
        self._leaving_until = -math.inf
        # Lines (class, tenant) whose given-back room is kept for their next request, until
        # then (`held`).
        self._kept: dict[tuple[int, str], float] = {}
        self.nudges_sent = 0
        self.nudges_heard = 0
        # The waiter lines (class, tenant) this replica registered at its last sync, and the
        # timed syncs new lines' waits ask for (`waits`).
        self._lines: frozenset[tuple[int, str]] = frozenset()
        self._sync_now = asyncio.Event()
        self._checks: dict[tuple[int, str], asyncio.TimerHandle] = {}
        # Lines whose timed sync is due: the next sync nudges the other replicas while one
        # still waits (a sync a nudge asked for does not: no echo).
        self._due: set[tuple[int, str]] = set()
        self.checks = 0

    def __repr__(self) -> str:
        return (
            f"ClusterShare({self.replica}, waiters={len(self.waiters)}, syncs={self.syncs}, "
            f"failures={self.failures}, nudges sent/heard={self.nudges_sent}/"
            f"{self.nudges_heard})"
        )

    # -- the ledger (router/admission.py calls it) ------------------------------------------
    def charged(self, priority: int, tenant: str, amount: float, admission: bool) -> None:
        slot = (priority, tenant)
        self._pending[slot] = self._pending.get(slot, 0.0) + amount
        if admission:
            self.request_units[tenant] = amount
        self.start()

    def waits(self, priority: int, tenant: str) -> None:
        """A request starts waiting for room here. A line (class, tenant) the cluster has not
        heard of from this replica gets a sync of its own once it has waited
        `fair_preempt_after_s`, so the take-back decides on it then, not up to a sync period
        later (a flooded victim's wait is that bound plus the room's way to it), and the other
        replicas are nudged to sync at once (`_run`): the streams to take back may be theirs.
        A line already registered (a backlogged tenant's) costs nothing more."""
        self.start()
        line = (priority, tenant)
        if not self.view.waiters and line not in self._lines:
            # The first wait on a quiet cluster: registered now, and every replica is told
            # (`sync`), so none takes room a period of the quiet cadence late.
            self._sync_now.set()
        if line in self._kept:  # its room is kept: woken at once, once it is parked
            asyncio.get_running_loop().call_soon(self.admission.notify)
        settings = self.settings
        if line in self._lines or line in self._checks or settings.fair_preempt_per_s <= 0:
            return
        occupancy = self.occupancy
        if occupancy.capacity > 0 and not under_share(occupancy, tenant):
            return  # at or over its share, as last synced: served by the order
        if settings.fair_preempt_after_s <= 0:
            return
        loop = asyncio.get_running_loop()
        delay = settings.fair_preempt_after_s + _CHECK_MARGIN_S
        self._checks[line] = loop.call_later(delay, self._timed_sync, line)

    def _timed_sync(self, line: tuple[int, str]) -> None:
        del self._checks[line]
        self.checks += 1
        self._due.add(line)
        self._sync_now.set()
        self.start()

    def held(self, priority: int, tenant: str, blocks: int) -> None:
        slot = (priority, tenant)
        left = self._holding.get(slot, 0) + blocks
        if left > 0:
            self._holding[slot] = left
        else:
            self._holding.pop(slot, None)
        if blocks < 0:
            self._keep(slot)
        elif self._kept:
            self._kept.pop(slot, None)  # its next request took it
        self.start()

    def _keep(self, line: tuple[int, str]) -> None:
        """A request of `line` gave its room back: kept for the line's next request for
        `fair_keep_s` while its tenant is within its share (policies/fair_share.py
        `keeps_room`); the line's waiter is woken first meanwhile (the admission's earmark),
        and the requests held off for it try again when it lapses."""
        keep_s = self.settings.fair_keep_s
        occupancy = self.occupancy
        if keep_s <= 0 or not keeps_room(occupancy, line[1]):
            return
        if not any(yields_kept_room(occupancy, t) for t in occupancy.held if t != line[1]):
            return  # no tenant over its share to keep it from: no cost on a fair cluster
        self._kept[line] = self.clock() + keep_s
        self.admission.earmark(line[0], line[1], keep_s)
        asyncio.get_running_loop().call_later(keep_s, self.admission.notify)

    def _kept_left(self, tenant: str, priority: int) -> float | None:
        """Seconds a request of `tenant` (class `priority`) leaves room kept for another line
        alone; None: it may take it."""
        now = self.clock()
        left = 0.0
        for (p, t), until in list(self._kept.items()):
            if until <= now:
                del self._kept[(p, t)]
            elif t != tenant and p <= priority:
                left = max(left, until - now)
        if left <= 0 or not yields_kept_room(self.occupancy, tenant):
            return None
        return left

    @property
    def task(self) -> asyncio.Task[None] | None:
        """The sync loop's task, while or since it ran (None: never started)."""
        return self._task

    def start(self) -> None:
        """Run the sync loop (again) if it is not running: a charge or a wait needs it."""
        if self._task is None or self._task.done():
            self._task = self.tasks.loop(self._run(), "fair-share-sync")

    # -- the sync ---------------------------------------------------------------------------
    async def _run(self) -> None:
        idle = 0
        while idle < _IDLE_SYNCS:
            due, self._due = self._due, set()
            self._sync_now.clear()
            busy = await self.sync()
            idle = 0 if busy else idle + 1
            if due & self._lines:  # a line waited past the bound and still waits
                self._nudge_others()
            period = self.settings.fair_sync_s
            if not self.contended:
                period *= _QUIET_PERIODS
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(period):
                    await self._sync_now.wait()

    @property
    def contended(self) -> bool:
        """A tenant waits for room anywhere in the cluster (as of the last sync) or here: the
        sync runs every period, else every `_QUIET_PERIODS`."""
        return bool(self.view.waiters) or self.admission.waiting > 0

    def _nudge_others(self) -> None:
        """A line of this replica has waited past `fair_preempt_after_s`, or the cluster's
        first waiter waits here: every other replica with a registration (it waits or holds
        blocks, so it syncs) syncs now, and its take-back reads the waiter at once (the
        streams to take back may be its own) and its hand-off leaves room for it."""
        for replica in sorted(set(self.view.replicas) - {self.replica}):
            self.nudges_sent += 1
            self.tasks.job(self._nudge(replica), "fair-share-nudge")

    async def sync(self) -> bool:
        """One exchange with the store; True while this replica has something to share. A
        failed one is False too: the loop stops after a few (a store down, or closed at
        shutdown) and the next charge or wait starts it again, its charges still to send."""
        charges, self._pending = self._pending, {}
        waiting = self.admission.waiting_tenants()
        was_quiet = not self.view.waiters
        lease_s = self.lease_s if waiting else self.quiet_lease_s
        try:
            view = await self.store.fair_sync(
                self.replica, charges, waiting, lease_s, dict(self._holding)
            )
        except StoreError as exc:
            for slot, amount in charges.items():  # sent again with the next
                self._pending[slot] = self._pending.get(slot, 0.0) + amount
            self.failures += 1
            log.debug("fair share sync failed: %s", exc)
            return False
        self.syncs += 1
        self._lines = frozenset(waiting)
        self._adopt(view)
        if was_quiet and waiting:  # the others may sync a quiet period apart: tell them now
            self._nudge_others()
        for listener in self.listeners:
            told = listener(self)
            if told is not None:
                await told
        return bool(charges or waiting or self.admission.inflight or self._pending or self._holding)

    def _adopt(self, view: FairView) -> None:
        pending = self._pending  # charged while the call was out: not in the store's yet
        counters = {slot: c + pending.get(slot, 0.0) for slot, c in view.counters.items()}
        self.policy.adopt(counters, view.floors)
        self.view = view
        self.waiters = tuple(
            ClusterWaiter(
                w.replica,
                w.priority,
                w.tenant,
                counters.get((w.priority, w.tenant), view.floors.get(w.priority, 0.0)),
                w.count,
                w.waited_s,
            )
            for w in view.waiters
        )
        held: dict[str, int] = {}
        for (_, tenant), blocks in view.held.items():
            held[tenant] = held.get(tenant, 0) + blocks
        active = frozenset(held) | {w.tenant for w in view.waiters}
        self.occupancy = Occupancy(self.capacity(), held, self.weights, active)

    # -- the nudge: room left for another replica's waiters --------------------------------
    def listen(self, on_nudge: Callable[[], Awaitable[None]]) -> None:
        """Hear the other replicas' nudges for the replica's life: each runs `on_nudge` (read
        the store now and wake the queue). The store down: listen again after a pause."""
        self.tasks.loop(self._listen(on_nudge), "fair-share-nudges")

    async def _listen(self, on_nudge: Callable[[], Awaitable[None]]) -> None:
        pause = self.settings.fair_sync_s
        while True:
            try:
                async for line in self.store.fair_nudges(self.replica):
                    pause = self.settings.fair_sync_s
                    self.nudges_heard += 1
                    if line is not None:
                        # Another replica took room back for this line's waiters here: the
                        # room is theirs, not this queue's order's next (which may be an
                        # older request of the very tenant whose stream was preempted).
                        self.admission.earmark(*line, claim_ttl_s(self.settings))
                    # Another replica's waiter may be owed streams this one relays: sync now.
                    self._sync_now.set()
                    self.start()
                    if self.admission.waiting:  # else nothing here wants the room
                        await on_nudge()
            except StoreError as exc:
                log.debug("fair share nudges: %s", exc)
            await asyncio.sleep(pause)
            pause = min(2 * pause, 5.0)

    async def _nudge(self, replica: str, line: FairSlot | None = None) -> None:
        try:
            await self.store.fair_nudge(replica, line)
        except StoreError as exc:  # the refresh still finds the room, a period later
            log.debug("fair share nudge to %s failed: %s", replica, exc)

    # -- the hand-off -----------------------------------------------------------------------
    def leave_for(self, replica: str, line: FairSlot, for_s: float) -> None:
        """This replica preempted streams for the waiters of `line` (class, tenant) on
        `replica` (router/request/fair_takeback.py): the room they free is left for `for_s` to
        the waiters the hand-off rule names, and `replica` is nudged with the line, which it
        wakes first for as long (`_listen`). Without the first, the room could go to this
        replica's own flood once the hand-off's grace had run out (issue 33's split rows lost a
        take-back's room so); without the second, to the waiting replica's own queue order,
        whose next may be the flooder's oldest request (the spread rows' tail: a victim's wait
        of 0.3-0.6 s, its first take-back's room taken by the flood, the next one blocked by
        the claim for its time)."""
        self._leaving_until = max(self._leaving_until, self.clock() + for_s)
        asyncio.get_running_loop().call_later(for_s, self.admission.notify)
        self.nudges_sent += 1
        self.tasks.job(self._nudge(replica, line), "fair-share-nudge")

    def hold_s(self, tenant: Tenant, priority: int, cost: AdmissionCost, need: int) -> float | None:
        """Seconds to leave the room this replica found for a request of `tenant` (class
        `priority`, expected to cost `cost`, asking `need` blocks), for a more under-served
        tenant waiting on another replica, or for the next request of a tenant within its
        share whose room this is (`held`); None: take it (the module's rule and bound)."""
        if self._kept and (kept := self._kept_left(tenant.name, priority)) is not None:
            return kept
        if not self.waiters:
            self._holding_since = None
            return None
        name = tenant.name
        counter = self.policy.counter(name, priority)
        units = self.policy.units(cost) / tenant.weight
        other = handoff_to(
            self.waiters, self.replica, name, priority, counter, units, self.occupancy, need
        )
        now = self.clock()
        if other is None:
            self._holding_since = None
            return None
        if now < self._leaving_until:
            return self._leaving_until - now
        if now < self._open_until:
            return None
        if self._holding_since is None:
            self._holding_since = now
            grace = self.settings.fair_handoff_grace_s
            # Then the held requests try again, and take the room if it is still there.
            asyncio.get_running_loop().call_later(grace, self.admission.notify)
            self.nudges_sent += 1
            self.tasks.job(self._nudge(other.replica), "fair-share-nudge")
        left = self._holding_since + self.settings.fair_handoff_grace_s - now
        if left <= 0:
            self._holding_since = None
            self._open_until = now + self.settings.fair_handoff_grace_s
            return None
        return left
