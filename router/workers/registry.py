"""The registry sync: workers registered or removed through any replica's admin API, adopted.

Every `registry_refresh_s` (and before an admin guard decides) this replica reads the shared
registry in one store call (`registry_view`: the loss marker, the registrations, the drain
marks, the `both` workers' roles and the tenant keys' version) and makes its membership match:
a new registration joins (probed at once when a session is given: it enters rotation when it
answers), a changed one replaces the old, a missing one leaves; drains and roles are applied.
When the tenant keys' version is not the one this replica holds, it reads the key table too (a
second call, only then) and its keyring adopts it (router/tenants.py): a key revoked on any
replica is refused here within one refresh. A store that lost its data is put back first
(router/workers/store_loss.py), and read again.

While this replica is busy it reads on the beat, every `registry_refresh_s`. While it is quiet
it reads only when the store's change feed moves (state/registry_feed.py): every store call
that changes the registry feeds it, so a quiet replica sees each change as soon as it lands
(well within `registry_refresh_s`), and makes no store call and has no timer while nothing
changes. The wait also ends when its connection breaks (a Redis that died or restarted empty:
the read then finds the marker gone and puts back, router/workers/store_loss.py), at the next
request (`LoopTiming.arrived`), and after `registry_quiet_wait_s` at the latest, which keeps
the marker alive (it is kept well inside its TTL) and bounds what no event shows (a FLUSHALL
on a running Redis). A failed read or a feed that cannot listen puts the loop back on the beat.

While the state refresher is quiet it rides on this loop (router/loop_timing.py): each read is
then `registry_and_usage_view`, the refresher's read taken along, one store call for both.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Literal

import aiohttp
import orjson

from router.config import ConfigError, Settings
from router.loop_timing import LoopTiming, UsageRider
from router.tenants import Keyring
from router.workers.dp_ranks import expand_ranks, parent_id
from router.workers.drain import apply_drained
from router.workers.health_probe import HealthProber
from router.workers.membership import Membership
from router.workers.store_loss import StoreLoss
from router.workers.worker_state import WorkerState
from state.base import RegistryFeed, RegistryView, StateStore, StoreError, TenantKeys, UsageView

__all__ = ["RegistrySync"]

log = logging.getLogger(__name__)


class RegistrySync:
    def __init__(
        self,
        settings: Settings,
        store: StateStore,
        members: Membership,
        loss: StoreLoss,
        prober: HealthProber,
        timing: LoopTiming,
        keyring: Keyring | None = None,
    ) -> None:
        """`keyring`: the tenants' keys, kept in step with the store's shared table."""
        self._settings = settings
        self._store = store
        self._members = members
        self._loss = loss
        self._prober = prober
        self._timing = timing
        self._keyring = keyring
        # A quiet replica's wait on the change feed, kept across busy spells (a blocking read
        # cut short would cost its connection); None: none under way.
        self._watch: asyncio.Task[bool] | None = None

    def __repr__(self) -> str:
        return f"RegistrySync(every {self._settings.loops.registry_refresh_s} s)"

    async def sync(self, session: aiohttp.ClientSession | None = None) -> None:
        """Adopt the registry as the store has it now; with a `session`, a newly adopted
        worker is probed at once. One store call, two after a loss."""
        view, _ = await self._read(None)
        joined = await self._adopt(view)
        await self._follow_keys(view)
        await self._probe(joined, session)

    async def _carry(self, rider: UsageRider, session: aiohttp.ClientSession | None) -> None:
        """`sync`, the quiet refresher's read taken along in the same store call. The rider
        hears of this beat whatever happens: its read, or that there is none (it then reads
        for itself), so it never waits for a read that is not coming."""
        try:
            view, usage = await self._read(rider.usage_ids())
        except BaseException:
            rider.drop_ride()
            raise
        assert usage is not None  # asked for
        try:
            joined = await self._adopt(view)
        finally:
            await rider.take_usage(usage)
        await self._follow_keys(view)
        await self._probe(joined, session)

    async def _read(
        self, usage_ids: tuple[list[str], list[str]] | None
    ) -> tuple[RegistryView, UsageView | None]:
        loss = self._loss
        async with loss.lock:
            view, usage = await self._read_once(usage_ids)
            # A store that lost its data has lost the registry too: put ours back first, and
            # read again, or every dynamic worker would look removed.
            if await loss.put_back_if_lost(view[0]):
                view, usage = await self._read_once(usage_ids)
        return view, usage

    async def _read_once(
        self, usage_ids: tuple[list[str], list[str]] | None
    ) -> tuple[RegistryView, UsageView | None]:
        ttl = self._loss.marker_ttl_s
        if usage_ids is None:
            return await self._store.registry_view(ttl), None
        return await self._store.registry_and_usage_view(ttl, *usage_ids)

    async def _adopt(self, view: RegistryView) -> list[WorkerState]:
        """Make the membership match `view`; returns the workers that joined."""
        store, members = self._store, self._members
        _, registered, drained, roles = view
        joined: list[WorkerState] = []
        for wid, blob in registered.items():
            # A data-parallel entry is one registration, its ranks' targets (members.entry: rank 0).
            known = members.entry(wid)
            if known is not None and known.dynamic and known.registration == blob:
                continue  # unchanged: not parsed again (a thousand workers, every second)
            try:
                spec = members.parse_registration(orjson.loads(blob))
            except (ConfigError, orjson.JSONDecodeError, TypeError, ValueError) as exc:
                log.warning("ignoring bad registration of %s: %s", wid, exc)
                continue
            current = members.entry(wid)
            if current is None or (current.dynamic and current.spec != expand_ranks(spec)[0]):
                joined.append(members.add(spec, dynamic=True, registration=blob))
                if spec.is_decode:
                    for w in members.ranks_of(wid):
                        await store.set_capacity(w.spec.id, w.capacity_blocks)
                log.info("worker %s (%s) joined the pools", wid, spec.role)
        dynamic = {parent_id(w.spec) for w in members.workers.values() if w.dynamic}
        gone = sorted(dynamic - set(registered))
        for wid in gone:
            members.remove(wid)
            log.info("worker %s left the pools", wid)
        apply_drained(members.workers.values(), drained)
        if any(True for _ in members.both_workers) and (kept := members.apply_roles(roles)):
            log.warning("the store lost the roles of %s: putting them back", ", ".join(kept))
            await store.restore_registry({}, kept)
        return joined

    async def _follow_keys(self, view: RegistryView) -> None:
        """The shared key table, read only when its version (read with the registry) is not the
        one this replica holds: an idle replica's beat stays one store call."""
        keyring = self._keyring
        if keyring is None or view.keys_version == keyring.version:
            return
        if view.keys_version == 0 and keyring.version is None:
            keyring.adopt(TenantKeys(0, {}, frozenset()))  # never changed: nothing to read
            return
        keyring.adopt(await self._store.tenant_keys())
        log.info("tenant keys: table v%s adopted (%r)", keyring.version, keyring)

    async def _probe(
        self, joined: list[WorkerState], session: aiohttp.ClientSession | None
    ) -> None:
        if session is not None and joined:
            await asyncio.gather(*(self._prober.probe(session, w) for w in joined))

    @property
    def quiet_wait_s(self) -> float:
        """The longest a quiet wait on the feed lasts: the setting, kept within half the
        marker's TTL so that quiet replicas' reads keep the marker alive."""
        return min(self._settings.loops.registry_quiet_wait_s, self._loss.marker_ttl_s / 2)

    async def run(self, session: aiohttp.ClientSession | None = None) -> None:
        """Every `registry_refresh_s` on the beat while busy; while quiet, when the change feed
        moves (a quiet refresher's read rides along either way)."""
        timing, period = self._timing, self._settings.loops.registry_refresh_s
        timing.carrier_period = period
        feed = self._store.registry_feed(self.quiet_wait_s)
        may_wait = False  # the last read answered, and the feed listens
        try:
            while True:
                if may_wait and not timing.busy():
                    woke = await self._until_change(feed)
                    if woke == "request":
                        continue  # busy now: on the beat; the registry is as fresh as the feed
                    may_wait = woke == "change"
                else:
                    await timing.beat(period)
                    may_wait = True
                # After a failed wait too: a lost connection is what the store-loss path reads.
                may_wait = await self._beat_sync(session) and may_wait
        finally:
            timing.carrier_period = None
            if timing.rider is not None:  # it waits for this loop: let it read for itself
                timing.rider.drop_ride()
            if self._watch is not None:
                self._watch.cancel()
                self._watch = None
            await feed.close()

    async def _until_change(self, feed: RegistryFeed) -> Literal["change", "request", "failed"]:
        """Until the feed moves or its bound passes ("change": read, then wait again), a request
        arrives ("request"), or the feed fails or loses its connection ("failed": read, and
        wait for the next on the beat: a feed that fails at once must not make this loop spin)."""
        watch = self._watch
        if watch is None:
            watch = self._watch = asyncio.create_task(feed.wait(self.quiet_wait_s))
        woken = asyncio.Event()

        def wake(_: object) -> None:
            woken.set()

        watch.add_done_callback(wake)
        try:
            await self._timing.quiet_wait(woken)
        finally:
            watch.remove_done_callback(wake)
        if not watch.done():
            return "request"  # the watch stays, for the next quiet spell
        self._watch = None
        try:
            watch.result()
        except StoreError as exc:
            log.debug("registry feed failed: %s", exc)
            return "failed"
        except Exception as exc:
            log.warning("registry feed failed: %r", exc)
            return "failed"
        return "change" if feed.listening else "failed"

    async def _beat_sync(self, session: aiohttp.ClientSession | None) -> bool:
        """One read of the loop; False when it failed."""
        rider = self._timing.rider
        try:
            if rider is None:
                await self.sync(session)
            else:
                await self._carry(rider, session)
        except asyncio.CancelledError:
            raise
        except StoreError as exc:  # the refresher reports the outage once
            log.debug("registry sync failed: %s", exc)
            return False
        except Exception as exc:
            log.warning("registry sync failed: %r", exc)
            return False
        return True
