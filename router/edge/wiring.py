"""One replica's long-lived services, built, started and closed in order by the app's cleanup
context (router/edge/app.py). The records here carry them from one step to the next; no route
sees them: each surface is handed only what it uses."""

from __future__ import annotations

import asyncio
import logging
import sys
from dataclasses import dataclass, replace
from urllib.parse import urlsplit

import aiohttp

from policies.base import FairnessPolicy
from router.adapters import prefill_target, query_engine_ids
from router.adapters.mooncake import DEFAULT_BOOTSTRAP_PORT
from router.admission import Admission
from router.background import BackgroundTasks
from router.config import Settings
from router.leases import LeaseKeeper
from router.loop_timing import LoopTiming, beat
from router.metrics import RouterMetrics
from router.relay.upstream_pool import SplicePool
from router.retry_budget import RetryBudget
from router.tenants import Keyring
from router.worker_spec import WorkerSpec
from router.workers.accounting import LocalAccounting
from router.workers.health_probe import HealthProber
from router.workers.kube import KubeDiscovery
from router.workers.kv_events import KvEventHub
from router.workers.load_poller import LoadPoller
from router.workers.membership import Membership
from router.workers.placement_view import PlacementView
from router.workers.pools import Pools
from router.workers.refresher import StateRefresher
from router.workers.registry import RegistrySync
from router.workers.store_loss import StoreLoss
from router.workers.stranded_reaper import StrandedReaper
from state import StoreError, open_store
from state.base import StateStore

__all__ = [
    "Core",
    "UpstreamConnector",
    "WorkerLoops",
    "open_core",
    "build_worker_loops",
    "warm_up",
    "start_loops",
    "close",
]

log = logging.getLogger(__name__)

# How often the retry budget's request tally goes to the store (router/retry_budget.py).
_TALLY_S = 0.5

# CPython before 3.12.8 (and 3.13.0) can leave a closed TLS connection's socket open when its
# peer never answers the TLS shutdown (fixed by python/cpython#118960); aiohttp's
# `enable_cleanup_closed` aborts such transports, and ignores the flag where it is fixed.
TLS_CLOSE_LEAKS = sys.version_info < (3, 12, 8) or (3, 13, 0) <= sys.version_info < (3, 13, 1)


class UpstreamConnector(aiohttp.TCPConnector):
    """The workers' connection pool, aiohttp's `enable_cleanup_closed` on only once a worker
    reached over https joins (`reach`, told of every worker joining: router/workers/
    membership.py `on_join`), and on from then on. That clean-up is a timer every 2 s for as
    long as the pool lives, aborting the TLS transports closed since; with http:// workers only
    there are none, and it would wake an idle router every 2 s for nothing."""

    def __init__(self, limit: int) -> None:
        super().__init__(limit=limit, limit_per_host=0, enable_cleanup_closed=False)

    @property
    def cleans_closed_tls(self) -> bool:
        return getattr(self, "_cleanup_closed_disabled", True) is False

    def reach(self, spec: WorkerSpec) -> None:
        """Worker `spec` joins: over https (on a Python that needs it), the clean-up from now
        on; it is armed before any connection to it can be made or closed. The arming uses
        aiohttp's own private hook (3.9-3.14); an aiohttp without it is left as it is rather
        than failing a worker's join."""
        hooked = hasattr(self, "_cleanup_closed_disabled") and hasattr(self, "_cleanup_closed")
        if not TLS_CLOSE_LEAKS or not hooked or self.cleans_closed_tls:
            return
        if urlsplit(spec.url).scheme.lower() == "https":
            # As `TCPConnector(enable_cleanup_closed=True)` sets it up in its constructor.
            self._cleanup_closed_disabled = False
            self._cleanup_closed()


@dataclass(frozen=True, slots=True)
class Core:
    """The services every other piece is built on: the shared store, the upstream clients, the
    background tasks, the admission queue, the reservation leases and the retry budget."""

    settings: Settings
    metrics: RouterMetrics
    store: StateStore
    session: aiohttp.ClientSession
    connector: UpstreamConnector  # the session's
    splice: SplicePool | None  # the PD legs' raw client (http:// workers) when relay == "splice"
    tasks: BackgroundTasks
    admission: Admission
    leases: LeaseKeeper
    retry_budget: RetryBudget


async def open_core(settings: Settings, metrics: RouterMetrics, fairness: FairnessPolicy) -> Core:
    """`fairness`: the queue's order among tenants (policies/fairness.py)."""
    store = await open_store(
        settings.store.url,
        settings.store.key_prefix,
        max_connections=settings.store.max_connections,
        pool_timeout_s=settings.store.pool_timeout_s,
    )
    tasks = BackgroundTasks(
        on_failure=lambda name: metrics.background_task_failures.labels(task=name).inc()
    )
    connector = UpstreamConnector(settings.upstream.connections)
    session = aiohttp.ClientSession(
        connector=connector, auto_decompress=False, timeout=aiohttp.ClientTimeout(total=None)
    )
    return Core(
        settings=settings,
        metrics=metrics,
        store=store,
        session=session,
        connector=connector,
        splice=SplicePool(settings.upstream.connections)
        if settings.upstream.relay == "splice"
        else None,
        tasks=tasks,
        admission=Admission(settings.admission, fairness),
        leases=LeaseKeeper(
            store, settings.leases.reservation_s, stranded_lease_s=settings.leases.kv_s
        ),
        retry_budget=RetryBudget(store, settings.retry),
    )


@dataclass(frozen=True, slots=True)
class WorkerLoops:
    """The worker pools, each piece given what it uses (router/workers/), and the loops that
    keep them current."""

    members: Membership
    timing: LoopTiming
    accounting: LocalAccounting
    kv_hub: KvEventHub  # each worker's KV events into its index, read by placement
    pools: Pools
    loss: StoreLoss
    prober: HealthProber
    registry: RegistrySync
    refresher: StateRefresher
    reaper: StrandedReaper
    discovery: KubeDiscovery | None  # the pods of Kubernetes, when discovery.kind says so


def build_worker_loops(core: Core, keyring: Keyring) -> WorkerLoops:
    """`keyring`: the tenants' keys, whose shared part follows the store (router/tenants.py)."""
    settings, store, metrics, admission = core.settings, core.store, core.metrics, core.admission
    members = Membership(settings)
    members.on_join(core.connector.reach)  # TLS clean-up once an https worker joins
    # Quiet (nothing in flight or waiting here, no leg on a worker): the loops slow down.
    timing = LoopTiming(
        members.carrying_work, lambda: admission.inflight > 0 or admission.waiting > 0
    )
    # The next request wakes what waits while quiet (the registry sync on the change feed, the
    # riding refresher), before it is placed.
    admission.on_arrival = timing.arrived
    accounting = LocalAccounting(members, timing)
    kv_hub = KvEventHub(members, metrics)
    pools = Pools(members, accounting, PlacementView(members, settings, kv_hub))

    async def on_store_reset() -> None:
        metrics.store_resets.inc()
        await core.leases.reassert()

    loss = StoreLoss(settings, store, members, on_store_reset, keyring)
    prober = HealthProber(members, timing, settings)
    registry = RegistrySync(settings, store, members, loss, prober, timing, keyring)
    # Each refresh may show room freed by other replicas: wake the admission queue.
    refresher = StateRefresher(
        settings,
        store,
        members,
        accounting,
        loss,
        timing,
        on_refresh=admission.notify,
        own_reservations=core.leases.reservations_by_worker,
        queue_waits=lambda: admission.waiting > 0,
    )
    admission.on_room_wait = refresher.room_wait
    reaper = StrandedReaper(
        settings,
        store,
        members,
        accounting,
        timing,
        on_expired=lambda wid: metrics.stranded_expired.labels(worker=wid).inc(),
    )
    # Kubernetes discovery registers pods through the admin API's path (the prober's checks).
    discovery = (
        KubeDiscovery(settings, store, members, prober) if settings.discovery.enabled else None
    )
    return WorkerLoops(
        members,
        timing,
        accounting,
        kv_hub,
        pools,
        loss,
        prober,
        registry,
        refresher,
        reaper,
        discovery,
    )


async def _learn_mooncake_engines(members: Membership, session: aiohttp.ClientSession) -> None:
    """Mooncake prefill workers name their engine in `GET <bootstrap>/query`: read it once."""
    for w in list(members.prefill_workers):
        spec = w.spec
        if spec.adapter != "mooncake" or spec.engine_id:
            continue
        target = prefill_target(spec.url, spec.bootstrap_port or DEFAULT_BOOTSTRAP_PORT)
        try:
            ids = await query_engine_ids(session, target)
        except Exception as exc:
            log.error(
                "Mooncake prefill %s: no engine id from %s:%s/query (%s); its requests "
                "will fail until it is configured",
                spec.id,
                target.host,
                target.bootstrap_port,
                exc,
            )
            continue
        if spec.dp_rank is not None and spec.dp_rank not in ids:  # each rank its own engine
            log.error("Mooncake prefill %s: its /query names no rank %s", spec.id, spec.dp_rank)
            continue
        w.spec = replace(spec, engine_id=ids[min(ids) if spec.dp_rank is None else spec.dp_rank])


async def warm_up(core: Core, loops: WorkerLoops) -> None:
    """Before serving: capacities in the store, the workers registered through the API, their
    KV layouts, one refresh of the shared state."""
    session, members = core.session, loops.members
    await loops.loss.register_capacities()
    await _learn_mooncake_engines(members, session)
    await loops.registry.sync(session)
    # Whatever does not answer yet is retried by the health prober.
    await asyncio.gather(
        *(
            loops.prober.discover_layout(session, w)
            for w in members.workers.values()
            if not w.layout_known
        )
    )
    for wid in members.unpaired():
        log.warning(
            "worker %s has no partner with the same KV layout: it will not be "
            "used for a prefill/decode handoff",
            wid,
        )
    await loops.refresher.refresh()
    specs = [w.spec for w in members.workers.values()]
    await loops.pools.placement.loras.refresh(session, specs)  # adapters before serving


async def _tally_requests(retry_budget: RetryBudget) -> None:
    """Add this replica's count of first attempts to the shared retry budget, twice a second
    (router/retry_budget.py), on the loops' shared beat: its store call goes out in the same
    loop turn as theirs (one write, one wake-up for the answers) instead of waking the
    replica on its own. A tally on its own 0.25 s timer was a third of a busy replica's
    timer wake-ups at one stream (docs/benchmarks-overhead.md)."""
    while True:
        await retry_budget.counted()  # idle: no wake-up until a request is counted
        await beat(_TALLY_S)
        try:
            await retry_budget.flush()
        except StoreError:
            pass  # kept for the next flush; the refresher reports the outage


def start_loops(core: Core, loops: WorkerLoops) -> None:
    """The background loops of the pools, the leases and the retry budget, in this order."""
    tasks, session = core.tasks, core.session
    tasks.loop(loops.refresher.run(), "pools-refresh")
    tasks.loop(loops.reaper.run(), "stranded-reaper")
    tasks.loop(loops.prober.run(session), "health-probe")
    tasks.loop(loops.registry.run(session), "registry-sync")
    if loops.discovery is not None:  # after the registry sync: it registers what it finds
        tasks.loop(loops.discovery.run(session), "kube-discovery")
    tasks.loop(LoadPoller(core.settings, loops.members, loops.timing).run(session), "load-poller")
    loras = loops.pools.placement.loras  # each LoRA engine's adapters (router/workers/loras.py)
    tasks.loop(loras.run(session, loops.members), "lora-poll")
    tasks.loop(core.leases.run(), "lease-keeper")
    tasks.loop(loops.kv_hub.run(), "kv-events")
    tasks.loop(_tally_requests(core.retry_budget), "retry-tally")


async def close(core: Core, loops: WorkerLoops) -> None:
    """Everything stopped and closed, the store last."""
    await core.tasks.close()
    await loops.kv_hub.close()
    # What the lease keeper still owes gets one last try before the store closes.
    try:
        await core.leases.settle_owed()
        await core.retry_budget.flush()
    except StoreError:
        pass  # leases expire by themselves
    await core.session.close()
    if core.splice is not None:
        await core.splice.close()
    await core.store.close()
