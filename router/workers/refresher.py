"""The state refresher: every replica's reservations and stranded KV, read from the store.

Each refresh is one store call (`usage_view`: reserved blocks and live reservations per decode
worker, stranded bytes per prefill worker), run every `state_refresh_s` while another replica
may be moving things: it replaces this replica's adjusted figures with the store's
(router/workers/accounting.py), puts back a capacity key the store lost, and tells the
admission queue (`on_refresh`) that room freed by other replicas may show. It also keeps the
store's health as it last saw it, for /ready and the metrics.

While quiet it does not read at all once its interval has backed off to the registry sync's
period: it rides on the registry sync's reads (router/loop_timing.py), which take its read along
in their own store call (`registry_and_usage_view`). A quiet registry sync reads only when the
registry's change feed moves (router/workers/registry.py), so an idle replica makes no store
call, and its view of other replicas' reservations is as old as that last read until the next
request: placement goes by it meanwhile, and is right either way (a reservation is checked
against capacity in the store). A carried read that shows a change, a request or a placement, a
failed store or a stopped registry sync ends the ride.

While busy but alone — the last read showed no reservation on these workers but this
replica's own (`own_reservations`), and no request waits in the admission queue — it backs
off as while quiet (up to 1 s, on its beat, not woken by placements): its own reserves and
releases already adjust its figures at once (router/workers/accounting.py), so a read would
only tell it what it knows. This was the largest cost of one stream with Redis (issue 24: 10
usage reads and 11 marker checks a second, ~60 round trips per 2.6 s answer). The first read
that shows another replica's reservation, or a request waiting for room, brings
`state_refresh_s` back; the store-loss marker is checked with each of those reads.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping

from router.config import Settings
from router.loop_timing import LoopTiming
from router.workers.accounting import LocalAccounting
from router.workers.membership import Membership
from router.workers.store_loss import StoreLoss
from router.workers.worker_state import WorkerState
from state.base import StateStore, StoreError, UsageView

__all__ = ["StateRefresher"]

log = logging.getLogger(__name__)


class StateRefresher:
    def __init__(
        self,
        settings: Settings,
        store: StateStore,
        members: Membership,
        accounting: LocalAccounting,
        loss: StoreLoss,
        timing: LoopTiming,
        on_refresh: Callable[[], None] | None = None,
        own_reservations: Callable[[], Mapping[str, int]] | None = None,
        queue_waits: Callable[[], bool] = lambda: False,
    ) -> None:
        """`own_reservations`: this replica's live reservations per decode worker (the lease
        keeper's); without it the refresher never counts itself alone. `queue_waits`: requests
        wait in the admission queue, whose re-checks (`on_refresh`) keep the busy cadence."""
        self._settings = settings
        self._store = store
        self._members = members
        self._accounting = accounting
        self._loss = loss
        self._timing = timing
        self._on_refresh = on_refresh
        self._own_reservations = own_reservations
        self._queue_waits = queue_waits
        # The last read showed no other replica's reservation on the decode workers.
        self.alone = False
        self.store_ok = False  # the store answered the last refresh
        self.stranded_byte_seconds = 0.0  # stranded KV held over time, as the refreshes saw it
        self._last_refresh: float | None = None
        self._ride_over = asyncio.Event()  # ends a ride on the registry sync's beat
        self._ride_saw_change = False
        self._reading: asyncio.Future[None] | None = None  # `read_if_stale`'s shared read
        self._room_wait = asyncio.Event()  # a request started waiting for room (`room_wait`)

    def __repr__(self) -> str:
        return f"StateRefresher(store_ok={self.store_ok})"

    async def refresh(self, check_marker: bool = True) -> None:
        self.alone = False  # until a read says so
        try:
            await self._refresh(check_marker)
        except StoreError as exc:
            self._store_failed(exc)
            raise
        self._store_answered()

    def _store_failed(self, exc: StoreError) -> None:
        if self.store_ok:
            log.warning("the state store stopped answering: %s", exc)
        self.store_ok = False

    def _store_answered(self) -> None:
        if not self.store_ok:
            log.info("the state store answers")
        self.store_ok = True

    async def _refresh(self, check_marker: bool) -> None:
        if check_marker:
            await self._loss.check()
        # One store call (one round trip on one Redis): every `state_refresh_s` while busy and
        # not alone, at most once a second otherwise.
        await self._apply(await self._store.usage_view(*self.usage_ids()))

    def usage_ids(self) -> tuple[list[str], list[str]]:
        members = self._members
        return [w.spec.id for w in members.reservable], [w.spec.id for w in members.strandable]

    async def _apply(self, view: UsageView) -> None:
        members = self._members
        usage, stranded = view
        self.alone = self._only_own(view)
        lost_capacity: list[WorkerState] = []
        for wid, u in usage.items():
            if (w := members.workers.get(wid)) is not None:
                w.reserved_blocks, w.reservations = u.reserved_blocks, u.reservations
                if u.capacity_blocks == 0 and w.capacity_blocks > 0:
                    lost_capacity.append(w)
        if lost_capacity:
            await self._reassert_capacities(lost_capacity)
        now = time.monotonic()
        if self._last_refresh is not None:
            total = sum(w.stranded_bytes for w in members.strandable)
            self.stranded_byte_seconds += total * (now - self._last_refresh)
        self._last_refresh = now
        for wid, nbytes in stranded.items():
            self._accounting.stranded_from_store(wid, nbytes)

    def _only_own(self, view: UsageView) -> bool:
        """Every live reservation the store holds on these workers is this replica's. A
        reservation on its way (in the store, not yet held here) or a release on its way (the
        other way round) makes the counts differ: not alone, the safe side."""
        if self._own_reservations is None:
            return False
        own = self._own_reservations()
        return all(u.reservations == own.get(wid, 0) for wid, u in view[0].items())

    async def _reassert_capacities(self, workers: list[WorkerState]) -> None:
        """These workers' capacity keys are gone (one shard of a cluster lost them, or the
        marker check has not run since): their room would read as none at all, so write it
        back. Not for a dynamic worker no longer registered: another replica's admin API
        deleted it (with every key it had) and this replica's registry sync has not dropped it
        yet; writing its capacity back would leave that key behind for good."""
        registered: dict[str, str] | None = None
        for w in workers:
            if w.dynamic:
                if registered is None:
                    registered = await self._store.registered_workers()
                if w.spec.id not in registered:
                    continue
            await self._store.set_capacity(w.spec.id, w.capacity_blocks)

    def _store_view(self) -> tuple[tuple[str, int, int], ...]:
        return tuple(
            (w.spec.id, w.reserved_blocks, w.stranded_bytes) for w in self._members.workers.values()
        )

    async def run(self) -> None:
        """Every `state_refresh_s` while anything moves; while this replica is quiet and the
        store shows no change, the interval doubles up to 10 x (at most 1 s): an idle router
        reads the store about once a second, and the first change it sees (another replica's
        reservation, a reset store) or the first placement here brings it back to
        `state_refresh_s`. While quiet it leaves the marker check to the registry sync (same
        cadence, same check): this replica holds nothing in the store then that a reset would
        make it put back in a hurry. Backed off as far as the registry sync's beat, it rides
        on it (`_ride`) instead of reading on its own."""
        base = self._settings.loops.state_refresh_s
        idle_cap = max(base, min(1.0, 10 * base))
        interval = base
        while True:
            # The marker is checked with every read while this replica is busy (it holds what
            # a reset would make it put back in a hurry), alone or not; while quiet, the
            # registry sync's read checks it on the same beat.
            check_marker = interval == base or self._timing.busy()
            changed = await self._refresh_in_loop(check_marker=check_marker)
            busy = self._timing.busy()
            # Waiters are re-checked at every refresh (`on_refresh`): room forecast to free
            # (predictive admission) is seen only by a re-check inside its window, so they
            # keep the busy cadence even when this replica is alone.
            calm = self.alone and not self._queue_waits()
            if (changed or busy) and not calm:
                interval = base
                await self._timing.beat(interval)
                continue
            interval = min(2 * interval, idle_cap)
            if busy:  # alone: its own accounting keeps its figures true between reads
                await self._sit_out(interval, base)
                continue
            if interval < idle_cap or not self._can_ride(idle_cap):
                await self._timing.quiet_sleep(interval)
            elif await self._ride():  # a carried read saw a change: the busy cadence again
                interval = base
                await self._timing.beat(interval)
            # else a placement, a failed store or a stopped registry sync: read now

    def room_wait(self) -> None:
        """A request started waiting for decode room (router/admission.py `on_room_wait`): a
        sit-out ends now, and the reads go back to the busy cadence."""
        self._room_wait.set()

    async def _sit_out(self, interval: float, base: float) -> None:
        """Up to `interval` without a read while busy and alone, ending on a `base` beat (a
        second's, once backed off that far). No wake-up before then (at one stream the former
        look on every beat was ~20 wake-ups a second, 5 % of the router's CPU): only a
        request that starts waiting for room ends it early (`room_wait`). A replica that goes
        quiet meanwhile reads at its end, as a quiet one would within the same interval."""
        if self._queue_waits():
            return
        self._room_wait.clear()
        # Backed off to a whole second, it ends on the second's beat, where the registry sync,
        # the load polls and the lease keeper wake: its read goes out with theirs instead of
        # waking the replica once more a second. The beat nearest `interval` from now (half a
        # period either way): the first read on the beat comes within half a second of when
        # it was due, the next ones a second apart.
        period = interval if interval >= 1.0 else base
        wait_s = self._timing.delay_past(interval - period / 2, period)
        try:
            async with asyncio.timeout(wait_s):
                await self._room_wait.wait()
        except TimeoutError:
            pass

    async def _refresh_in_loop(self, check_marker: bool) -> bool:
        """One refresh of the loop; True unless it read the store and saw no change."""
        before = self._store_view()
        try:
            await self.refresh(check_marker)
        except asyncio.CancelledError:
            raise
        except StoreError:
            return True  # logged once when it starts failing (refresh)
        except Exception as exc:  # a bug must not kill the loop
            log.warning("state refresh failed: %r", exc)
            return True
        if self._on_refresh is not None:
            self._on_refresh()
        return self._store_view() != before

    # -- a request on a view left from a quiet spell ------------------------------------------
    @property
    def stale_after_s(self) -> float:
        """The oldest a view gets while this loop runs (its quiet cadence, 1 s); a quiet
        replica's, which reads only when the registry changes, may be much older."""
        base = self._settings.loops.state_refresh_s
        return max(base, min(1.0, 10 * base))

    async def read_if_stale(self) -> bool:
        """Read the store now if the last read is older than `stale_after_s`: what a request
        about to be refused or queued for room (router/request/reserve.py) does first, so
        that no request is turned away on other replicas' reservations as they stood before
        a quiet spell. Callers at once share one read. True if it read."""
        last = self._last_refresh
        if last is not None and time.monotonic() - last < self.stale_after_s:
            return False
        if self._reading is None:
            self._reading = asyncio.ensure_future(self._read_for_a_request())
            self._reading.add_done_callback(self._read_done)
        try:
            await asyncio.shield(self._reading)
        except StoreError:
            return False  # the request goes by what it has; the outage is reported once
        return True

    async def _read_for_a_request(self) -> None:
        await self.refresh()
        if self._on_refresh is not None:
            self._on_refresh()

    def _read_done(self, reading: asyncio.Future[None]) -> None:
        self._reading = None
        if not reading.cancelled():
            reading.exception()  # retrieved: each caller has seen it

    # -- riding on the registry sync's beat (loop_timing.UsageRider) --------------------------
    @property
    def riding(self) -> bool:
        """Quiet, its reads carried by the registry sync's."""
        return self._timing.rider is self

    def _can_ride(self, idle_cap: float) -> bool:
        """A registry sync runs, at a beat no slower than this refresher's quiet cadence, and
        the last read showed no reservation but this replica's own. Another replica's (a
        killed one's, until its lease runs out) keeps this one reading at its quiet cadence:
        the read is what purges it once expired (the usage script), and a quiet replica riding
        the change feed reads nothing (the state machine: a killed replica's reservations on a
        worker never purged while both survivors were quiet)."""
        period = self._timing.carrier_period
        return self.alone and period is not None and period <= idle_cap

    async def _ride(self) -> bool:
        """Hand this refresher's reads to the registry sync's beat until one shows a change or
        finds this replica busy (True), or a placement, a failed store or a stopped registry
        sync ends the ride (False: read now). No timer of its own meanwhile."""
        timing = self._timing
        self._ride_over.clear()
        self._ride_saw_change = False
        timing.rider = self
        try:
            await timing.quiet_wait(self._ride_over)
        finally:
            if timing.rider is self:
                timing.rider = None
        return self._ride_saw_change

    async def take_usage(self, view: UsageView) -> None:
        """The read the registry sync took along: applied as a refresh of this loop's own."""
        before = self._store_view()
        try:
            await self._apply(view)
        except StoreError as exc:  # putting a lost capacity back failed
            self._store_failed(exc)
            self.drop_ride()
            raise
        self._store_answered()
        if self._on_refresh is not None:
            self._on_refresh()
        if self._store_view() != before or self._timing.busy():
            self._ride_saw_change = True
            self._ride_over.set()

    def drop_ride(self) -> None:
        self._ride_over.set()
