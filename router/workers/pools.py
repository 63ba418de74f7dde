"""The worker pools as this router replica sees them, and the snapshot policies place against.

The router's own accounting is the primary load signal (docs/design.md §4: the peers' counters miss
requests still in prefill): queued prompt tokens per prefill worker are counted from dispatch to
the prefill answer, reserved blocks per decode worker come from the shared store (every
replica's reservations), refreshed in the background and adjusted locally at once after each
reserve/release so back-to-back requests on one replica see each other.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson

from policies.base import ClusterView, DecodeView, PrefillView
from router.config import ConfigError, Settings
from router.workers.breaker import CircuitBreaker
from router.workers.discovery import (
    LoadSnapshot,
    fetch_sglang_load,
    fetch_vllm_load,
)
from router.workers.drain import apply_drained, drain_view
from router.workers.health_probe import HealthProber
from router.workers.prefixes import RecentPrefixes
from router.workers.worker_spec import WorkerSpec, parse_worker
from state.base import DrainMark, StateStore, StoreError, WorkerRole

__all__ = ["WorkerState", "Pools"]

# Removed workers kept for the requests still on them: a removal is an operator's act, so a
# few dozen is plenty, and bounded whatever an API client does.
_DEPARTED_KEPT = 64

log = logging.getLogger(__name__)


def _serves(w: WorkerState, model: str) -> bool:
    return not model or not w.spec.layout.model or w.spec.layout.model == model


_NO_LOAD = LoadSnapshot(running=0, waiting=0, kv_usage=None, num_gpu_blocks=None, at=0.0)


@dataclass(slots=True)
class WorkerState:
    spec: WorkerSpec
    healthy: bool = True
    consecutive_failures: int = 0
    inflight: int = 0
    queued_prompt_tokens: int = 0  # prompts dispatched for prefill, answer not yet back
    resident_seqs: int = 0  # decode streams open on this worker (this replica)
    capacity_blocks: int = 0
    reserved_blocks: int = 0  # all replicas, from the store, adjusted locally
    reservations: int = 0  # live reservations of all replicas, at the last refresh
    # Reservations this replica has placed here and is still writing to the store: counted in
    # placement so that a burst's concurrent placements see one another instead of all taking
    # the same momentarily emptiest worker.
    pending_blocks: int = 0
    stranded_bytes: int = 0
    recent_prefixes: RecentPrefixes = field(default_factory=RecentPrefixes)
    breaker: CircuitBreaker = field(default_factory=CircuitBreaker)
    load: LoadSnapshot | None = None  # the worker's own report, when polled
    dynamic: bool = False  # registered through the admin API (not from the config file)
    registration: str | None = None  # a dynamic worker's registry entry, to put back if lost
    # False until a `discover_layout` worker has told its layout: never paired on a guess.
    layout_known: bool = True
    drained: bool = False  # an operator's drain (router/workers/drain.py): no new placements
    # The store's record of its last drain or undrain (None: none known): what this replica
    # puts back if the store loses it, compared by time with the other replicas' views.
    drain_mark: DrainMark | None = None
    # A `both` worker's current role from the store (router/role_manager.py); None: never given one,
    # it serves as it always has (decode, prefilling its own requests when the policy says).
    role_state: WorkerRole | None = None
    # Its decode streams open on this replica, so that a drain past its deadline can cut them
    # (they resume elsewhere with the tokens sent so far).
    open_streams: set[Any] = field(default_factory=set)

    @property
    def worker_id(self) -> str:
        return self.spec.id

    @property
    def current_role(self) -> str:
        """prefill | decode | both (a `both` worker with no role yet) | draining-to-<role>."""
        if self.spec.role != "both" or self.role_state is None:
            return self.spec.role
        return self.role_state.role

    @property
    def in_prefill_pool(self) -> bool:
        return self.current_role == "prefill"

    @property
    def in_decode_pool(self) -> bool:
        return self.current_role in ("decode", "both")

    @property
    def available(self) -> bool:
        """In rotation: passing health probes, its circuit breaker lets a request through, and
        not drained."""
        return self.healthy and self.layout_known and not self.drained and self.breaker.allows()

    def __repr__(self) -> str:
        return (
            f"WorkerState({self.spec.id} {self.spec.role} healthy={self.healthy} "
            f"queued={self.queued_prompt_tokens} seqs={self.resident_seqs} "
            f"reserved={self.reserved_blocks}/{self.capacity_blocks} "
            f"stranded={self.stranded_bytes})"
        )


class Pools:
    def __init__(self, settings: Settings, store: StateStore) -> None:
        self.settings = settings
        self.store = store
        self.workers: dict[str, WorkerState] = {}
        # Workers removed while requests may still be on them (`worker`): the last few, by id.
        self._departed: dict[str, WorkerState] = {}
        for spec in settings.workers:
            self.add(spec)
        self.stranded_byte_seconds = 0.0
        self._last_refresh: float | None = None
        # The store's health as the refresher last saw it (for /ready and the metrics), and
        # what to do when it turns out to have lost its data (the lease keeper's reassert).
        self.store_ok = False
        self.on_store_reset: Callable[[], Awaitable[None]] | None = None
        self._marker_seen = False
        self._put_back_owed = False
        self._store_lock = asyncio.Lock()
        # Set by each placement (note_pending): wakes the loops that slow down while this
        # replica is quiet, so the first request after a quiet spell brings them back at once.
        self._placed = asyncio.Event()
        # Set whenever a prefill worker is seen holding stranded KV (wakes the reaper).
        self._stranded = asyncio.Event()
        # Where this replica's beat falls within each second (see `beat`): replicas sharing a
        # host do not all call the store at the same instant.
        self._phase = random.random()
        self.health = HealthProber(self)

    def __repr__(self) -> str:
        return f"Pools({list(self.workers.values())!r})"

    # A `both` worker is in one pool at a time, the one its current role names; draining
    # between the two, in neither (no new work) while what it holds finishes.
    @property
    def prefill_workers(self) -> Iterable[WorkerState]:
        return (w for w in self.workers.values() if w.in_prefill_pool)

    @property
    def decode_workers(self) -> Iterable[WorkerState]:
        return (w for w in self.workers.values() if w.in_decode_pool)

    @property
    def both_workers(self) -> Iterable[WorkerState]:
        return (w for w in self.workers.values() if w.spec.role == "both")

    # Whatever a worker's role now, the store's ledgers for each side it can serve are read:
    # a worker leaving decode still holds reservations, one leaving prefill stranded KV.
    @property
    def _reservable(self) -> Iterable[WorkerState]:
        return (w for w in self.workers.values() if w.spec.is_decode)

    @property
    def _strandable(self) -> Iterable[WorkerState]:
        return (w for w in self.workers.values() if w.spec.is_prefill)

    def can_prefill_locally(self, w: WorkerState) -> bool:
        """A decode-side `both` worker that may prefill its own requests (no role yet, or
        `roles.local_prefill`)."""
        if w.spec.role != "both":
            return False
        return w.role_state is None or self.settings.roles.local_prefill

    def apply_roles(self, roles: dict[str, WorkerRole]) -> dict[str, WorkerRole]:
        """Take the store's roles of the `both` workers (logged on a change). A worker whose
        role the store no longer has keeps the one known here: a role is never removed while
        the worker is in the pools (deleting it removes both), so its absence means the store
        lost it (a Redis restarted empty), and falling back to no role would flip a worker
        forced to prefill back into decode. Returns those kept, for `sync_registry` to put
        back (not the role manager: a worker deleted meanwhile must not get its role back)."""
        kept: dict[str, WorkerRole] = {}
        for w in self.both_workers:
            record = roles.get(w.spec.id)
            if record is None and w.role_state is not None:
                kept[w.spec.id] = w.role_state
                continue
            if record != w.role_state:
                old = w.role_state.role if w.role_state is not None else None
                if record is not None and old != record.role:
                    log.info("worker %s is now %s", w.spec.id, record.role)
                w.role_state = record
        return kept

    def role_view(self) -> dict[str, WorkerRole]:
        """The roles this replica knows, as of its last read or change."""
        return {w.spec.id: w.role_state for w in self.both_workers if w.role_state is not None}

    # -- membership ---------------------------------------------------------------------------
    def add(
        self, spec: WorkerSpec, dynamic: bool = False, registration: str | None = None
    ) -> WorkerState:
        cap = spec.capacity_blocks if spec.is_decode else 0
        state = WorkerState(
            spec=spec,
            capacity_blocks=cap,
            dynamic=dynamic,
            registration=registration,
            breaker=CircuitBreaker(self.settings.breaker),
            layout_known=not spec.discover_layout,
            # A worker that joins at run time enters rotation once a health probe passes
            # (the admin API probes it at once; other replicas' probers within an interval).
            healthy=not dynamic,
        )
        self.workers[spec.id] = state
        return state

    def remove(self, worker_id: str) -> bool:
        """Out of the pools at once; requests already on it finish (releases go by id, their
        legs find it through `worker`)."""
        state = self.workers.pop(worker_id, None)
        if state is None:
            return False
        self._departed.pop(worker_id, None)
        self._departed[worker_id] = state
        while len(self._departed) > _DEPARTED_KEPT:
            del self._departed[next(iter(self._departed))]
        return True

    def worker(self, worker_id: str) -> WorkerState:
        """The worker an attempt was placed on, also when it has been removed since: its
        request still runs its legs there (KeyError only for an id never known)."""
        state = self.workers.get(worker_id)
        return state if state is not None else self._departed[worker_id]

    def unpaired(self) -> list[str]:
        """Workers whose KV layout matches no worker on the other side: never used for a
        handoff (a 'both' worker can still serve alone), reported so operators see it."""
        prefill_layouts = {w.spec.layout.key for w in self.prefill_workers}
        decode_layouts = {w.spec.layout.key for w in self.decode_workers}
        out = [w.spec.id for w in self.prefill_workers if w.spec.layout.key not in decode_layouts]
        out += [
            w.spec.id
            for w in self.decode_workers
            if w.spec.role == "decode" and w.spec.layout.key not in prefill_layouts
        ]
        return out

    def parse_registration(self, raw: object) -> WorkerSpec:
        s = self.settings
        return parse_worker(raw, s.default_perf, s.default_layout, "registration")

    async def sync_registry(self, session: aiohttp.ClientSession | None = None) -> None:
        """Adopt workers registered (or removed) through any replica's admin API; with a
        `session`, a newly adopted worker is probed at once (it enters rotation when it
        answers). One store call (`registry_view`: marker, registrations, drained set, roles)."""
        async with self._store_lock:
            lost, registered, drained, roles = await self.store.registry_view(self._marker_ttl_s)
            # A store that lost its data has lost the registry too: put ours back first, and
            # read again, or every dynamic worker would look removed.
            if await self._put_back(lost):
                _, registered, drained, roles = await self.store.registry_view(self._marker_ttl_s)
        joined: list[WorkerState] = []
        for wid, blob in registered.items():
            try:
                spec = self.parse_registration(orjson.loads(blob))
            except (ConfigError, orjson.JSONDecodeError, TypeError, ValueError) as exc:
                log.warning("ignoring bad registration of %s: %s", wid, exc)
                continue
            current = self.workers.get(wid)
            if current is None or (current.dynamic and current.spec != spec):
                joined.append(self.add(spec, dynamic=True, registration=blob))
                if spec.is_decode:
                    await self.store.set_capacity(spec.id, spec.capacity_blocks)
                log.info("worker %s (%s) joined the pools", wid, spec.role)
        gone = [
            w.spec.id for w in self.workers.values() if w.dynamic and w.spec.id not in registered
        ]
        for wid in gone:
            self.remove(wid)
            log.info("worker %s left the pools", wid)
        apply_drained(self.workers.values(), drained)
        if any(True for _ in self.both_workers) and (kept := self.apply_roles(roles)):
            log.warning("the store lost the roles of %s: putting them back", ", ".join(kept))
            await self.store.restore_registry({}, kept)
        if session is not None and joined:
            await asyncio.gather(*(self.health.probe(session, w) for w in joined))

    async def run_registry_sync(self, session: aiohttp.ClientSession | None = None) -> None:
        while True:
            await self.beat(self.settings.registry_refresh_s)
            try:
                await self.sync_registry(session)
            except asyncio.CancelledError:
                raise
            except StoreError as exc:  # the refresher reports the outage once
                log.debug("registry sync failed: %s", exc)
            except Exception as exc:
                log.warning("registry sync failed: %r", exc)

    # -- workers' own load reports -------------------------------------------------------------
    def _fresh_load(self, w: WorkerState) -> LoadSnapshot | None:
        if w.load is None or w.load.stale(time.monotonic(), self.settings.load_max_age_s):
            return None  # stale data is not trusted, least of all as "idle"
        return w.load

    def _used_blocks(self, w: WorkerState) -> int:
        load = self._fresh_load(w)
        if load is None or load.kv_usage is None:
            return 0
        return int(load.kv_usage * w.capacity_blocks)

    async def poll_load(self, session: aiohttp.ClientSession, w: WorkerState) -> None:
        fetch = fetch_sglang_load if w.spec.adapter == "sglang" else fetch_vllm_load
        try:
            w.load = await fetch(session, w.spec.url)
        except Exception as exc:  # no load endpoint: the router's own accounting stands
            log.debug("load poll of %s failed: %s", w.spec.id, exc)

    async def run_load_poller(
        self, session: aiohttp.ClientSession, busy: Callable[[], bool] | None = None
    ) -> None:
        """Every `load_poll_s` while this replica serves. While it is quiet, not at all: a
        reading older than `load_max_age_s` is not trusted anyway, and a vLLM worker's
        /metrics costs ~1 ms of router CPU a poll (docs/benchmarks-overhead.md). The first
        placement after a quiet spell polls at once (placement meanwhile goes by the router's
        own accounting, as with any stale reading)."""
        s = self.settings
        if s.load_poll_s <= 0:
            return
        while True:
            await asyncio.gather(*(self.poll_load(session, w) for w in list(self.workers.values())))
            await self.beat(s.load_poll_s)
            while not self.is_busy(busy):
                await self.quiet_sleep(3600.0)  # the next placement, however long it takes

    # -- the snapshot ------------------------------------------------------------------------
    def snapshot(
        self,
        avoid: frozenset[str] = frozenset(),
        model: str = "",
        freeing: dict[str, int] | None = None,
    ) -> ClusterView:
        """The pools as policies see them: the workers serving `model` (all when empty);
        `avoid` = workers that already failed this request; `freeing` = blocks per decode
        worker forecast to be free by the time the prefill ends (prediction-based admission)."""
        freeing = freeing or {}
        prefill = tuple(
            PrefillView(
                worker_id=w.spec.id,
                layout=w.spec.layout,
                healthy=w.available and w.spec.id not in avoid,
                group=w.spec.group,
                queued_prompt_tokens=w.queued_prompt_tokens,
                inflight=w.inflight,
                prefill_tokens_per_s=(
                    w.spec.perf.prefill_tokens_per_s() if w.spec.perf else 10_000.0
                ),
                stranded_bytes=w.stranded_bytes,
                stranded_cap_bytes=w.spec.stranded_cap_bytes,
                recent_prefixes=w.recent_prefixes.frozen,
            )
            for w in self.prefill_workers
            if _serves(w, model)
        )
        decode = tuple(
            DecodeView(
                worker_id=w.spec.id,
                layout=w.spec.layout,
                capacity_blocks=w.capacity_blocks,
                reserved_blocks=max(
                    0, w.reserved_blocks + w.pending_blocks - freeing.get(w.spec.id, 0)
                ),
                used_blocks=self._used_blocks(w),
                resident_seqs=max(w.resident_seqs, (self._fresh_load(w) or _NO_LOAD).running),
                healthy=w.available and w.spec.id not in avoid,
                group=w.spec.group,
                step_base_s=w.spec.perf.step_base_s if w.spec.perf else 0.005,
                step_s_per_block=w.spec.perf.step_s_per_block if w.spec.perf else 0.0,
                can_prefill=self.can_prefill_locally(w),
                prefill_tokens_per_s=(
                    w.spec.perf.prefill_tokens_per_s() if w.spec.perf else 10_000.0
                ),
                queued_prompt_tokens=w.queued_prompt_tokens,
            )
            for w in self.decode_workers
            if _serves(w, model)
        )
        return ClusterView(
            prefill=prefill, decode=decode, kv_bytes_per_token=self.settings.kv_bytes_per_token
        )

    # -- local accounting ----------------------------------------------------------------------
    # A worker removed while requests were on it: their releases still go to the store by id.
    def note_reserved(self, worker_id: str, blocks: int) -> None:
        if (w := self.workers.get(worker_id)) is not None:
            w.reserved_blocks += blocks

    def note_pending(self, worker_id: str, blocks: int) -> None:
        if (w := self.workers.get(worker_id)) is not None:
            w.pending_blocks = max(0, w.pending_blocks + blocks)
        if blocks > 0:
            self._placed.set()

    def note_released(self, worker_id: str, blocks: int) -> None:
        if (w := self.workers.get(worker_id)) is not None:
            w.reserved_blocks = max(0, w.reserved_blocks - blocks)

    def note_stranded(self, worker_id: str, nbytes: int) -> None:
        if (w := self.workers.get(worker_id)) is not None:
            w.stranded_bytes = max(0, w.stranded_bytes + nbytes)
        if nbytes > 0:
            self._stranded.set()

    async def stranded_somewhere(self) -> None:
        """Returns once some worker holds stranded KV (at once if one does now)."""
        if any(w.stranded_bytes for w in self.workers.values()):
            return
        self._stranded.clear()
        await self._stranded.wait()

    # -- background tasks ---------------------------------------------------------------------
    async def register_capacities(self) -> None:
        await asyncio.gather(
            *(self.store.set_capacity(w.spec.id, w.capacity_blocks) for w in self._reservable)
        )

    @property
    def _marker_ttl_s(self) -> float:
        return max(60.0, 10 * self.settings.reservation_lease_s)

    async def check_store(self) -> None:
        """Notice a store that lost its data (Redis restarted empty, a failover to an empty
        replica) by its marker key, and put back what this replica knows (`_put_back`)."""
        async with self._store_lock:
            await self._put_back(await self.store.check_marker(self._marker_ttl_s))

    async def _put_back(self, marker_missing: bool) -> bool:
        """After a marker check: if the store lost its data, put back capacities, the dynamic
        workers' registrations, then (`on_store_reset`) reservations and stranded entries; True
        if it did. Every replica does the same for its own, within one refresh. Called with
        `_store_lock` held."""
        first, self._marker_seen = not self._marker_seen, True
        if first:  # first use: start-up registers everything anyway
            return False
        if not marker_missing and not self._put_back_owed:
            return False
        log.warning(
            "the state store has lost its data (restarted empty?): putting back "
            "capacities, registrations, drains, roles, reservations and stranded entries"
        )
        # Owed until done: the marker now reads as present, so a put-back cut short by a
        # store error would otherwise never be finished.
        self._put_back_owed = True
        await self.register_capacities()
        dynamic = [w for w in self.workers.values() if w.dynamic and w.registration]
        await asyncio.gather(
            *(self.store.register_worker(w.spec.id, w.registration or "") for w in dynamic),
        )
        # Drains and roles as this replica last saw them. Every replica puts back its own view
        # (each learns of the loss from the marker), and the store keeps the freshest of them:
        # a drain mark by its time, a role by its version. So a drain another replica undid
        # just before the loss, which this replica still shows, is not brought back by it:
        # the undoing replica's later undrain mark wins, whichever writes first. (Were that
        # replica gone too, nobody would know of the undrain: the drain comes back, the safe
        # side — a drained worker takes no new work until the operator undrains it again.)
        await self.store.restore_registry(drain_view(self.workers.values()), self.role_view())
        if self.on_store_reset is not None:
            await self.on_store_reset()
        self._put_back_owed = False
        return True

    async def refresh_from_store(self, check_marker: bool = True) -> None:
        try:
            await self._refresh_from_store(check_marker)
        except StoreError as exc:
            if self.store_ok:
                log.warning("the state store stopped answering: %s", exc)
            self.store_ok = False
            raise
        if not self.store_ok:
            log.info("the state store answers")
        self.store_ok = True

    async def _refresh_from_store(self, check_marker: bool) -> None:
        if check_marker:
            await self.check_store()
        decode_ids = [w.spec.id for w in self._reservable]
        prefill_ids = [w.spec.id for w in self._strandable]
        # One store call (one round trip on one Redis): this runs 10 times a second while busy.
        usage, stranded = await self.store.usage_view(decode_ids, prefill_ids)
        lost_capacity: list[WorkerState] = []
        for wid, u in usage.items():
            if (w := self.workers.get(wid)) is not None:
                w.reserved_blocks, w.reservations = u.reserved_blocks, u.reservations
                if u.capacity_blocks == 0 and w.capacity_blocks > 0:
                    lost_capacity.append(w)
        if lost_capacity:
            await self._reassert_capacities(lost_capacity)
        now = time.monotonic()
        if self._last_refresh is not None:
            total = sum(w.stranded_bytes for w in self._strandable)
            self.stranded_byte_seconds += total * (now - self._last_refresh)
        self._last_refresh = now
        for wid, nbytes in stranded.items():
            if (st := self.workers.get(wid)) is not None:
                st.stranded_bytes = nbytes
                if nbytes:
                    self._stranded.set()

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
                    registered = await self.store.registered_workers()
                if w.spec.id not in registered:
                    continue
            await self.store.set_capacity(w.spec.id, w.capacity_blocks)

    def is_busy(self, busy: Callable[[], bool] | None) -> bool:
        """This replica has requests in flight or waiting (`busy`), or legs on a worker."""
        if busy is not None and busy():
            return True
        return any(w.inflight or w.pending_blocks for w in self.workers.values())

    def _store_view(self) -> tuple[tuple[str, int, int], ...]:
        return tuple(
            (w.spec.id, w.reserved_blocks, w.stranded_bytes) for w in self.workers.values()
        )

    async def run_refresher(self, on_refresh=None, busy=None) -> None:  # type: ignore[no-untyped-def]
        """Every `state_refresh_s` while anything moves; while this replica is quiet and the
        store shows no change, the interval doubles up to 10 x (at most 1 s): an idle router
        reads the store about once a second, and the first change it sees (another replica's
        reservation, a reset store) or the first placement here brings it back to
        `state_refresh_s`. While quiet it leaves the marker check to the registry sync (same
        cadence, same check): this replica holds nothing in the store then that a reset would
        make it put back in a hurry."""
        base = self.settings.state_refresh_s
        idle_cap = max(base, min(1.0, 10 * base))
        interval = base
        while True:
            before = self._store_view()
            changed = True
            try:
                await self.refresh_from_store(check_marker=interval == base)
                changed = self._store_view() != before
                if on_refresh is not None:
                    on_refresh()
            except asyncio.CancelledError:
                raise
            except StoreError:
                pass  # logged once when it starts failing (refresh_from_store)
            except Exception as exc:  # a bug must not kill the loop
                log.warning("state refresh failed: %r", exc)
            if changed or self.is_busy(busy):
                interval = base
                await self.beat(interval)
            else:
                interval = min(2 * interval, idle_cap)
                await self.quiet_sleep(interval)

    @staticmethod
    def _beat_delay(period: float, phase: float) -> float:
        now = asyncio.get_running_loop().time()
        delay = period - (now - phase) % period
        # A timer may fire a hair early (the loop's clock resolution): not a second beat.
        return delay + period if delay < 0.005 else delay

    async def beat(self, period: float) -> None:
        """Sleep to this replica's next beat of `period`: the next multiple of it on the loop's
        clock (shifted by the replica's phase). The background loops of an idle router (state
        refresh, registry sync, health probes, the reaper) then wake together once a second,
        not each at its own instant: a wake-up costs ~40 µs of CPU on its own, more than most
        of their work (docs/benchmarks-overhead.md, idle)."""
        await asyncio.sleep(self._beat_delay(period, self._phase))

    async def quiet_sleep(self, period: float) -> None:
        """`beat(period)`, cut short by the next placement (a request after a quiet spell)."""
        self._placed.clear()
        try:
            async with asyncio.timeout(self._beat_delay(period, self._phase)):
                await self._placed.wait()
        except TimeoutError:
            pass
