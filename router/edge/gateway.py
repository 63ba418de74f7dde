"""The Gateway: every long-lived service one router replica uses, built once per app."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import aiohttp

from policies.base import OutputLengthEstimator, PlacementPolicy
from policies.overruns import LiveOverruns, OverrunMargin
from router.adapters import ADAPTERS, ConcurrentAdapter, WorkerAdapter, adapter_for
from router.admission import Admission
from router.background import BackgroundTasks
from router.config import Settings
from router.control.scaling import DemandMeter
from router.histograms import HistogramCache
from router.leases import LeaseKeeper
from router.metrics import RouterMetrics
from router.relay.upstream_pool import SplicePool
from router.request.holdings import Book
from router.request.legs import Legs
from router.request.lifecycle import RequestStages
from router.request.pairing import Pairing
from router.request.preemption import Preemptor
from router.request.quota import QuotaGate
from router.request.release import Releaser
from router.request.reserve import Reserver
from router.request.respond import Answering
from router.request.resume import Resumer
from router.retry_budget import RetryBudget
from router.tracing import Tracing
from router.workers.health_probe import HealthProber
from router.workers.pools import Pools
from router.workers.refresher import StateRefresher
from router.workers.registry import RegistrySync
from state.base import StateStore

__all__ = ["Gateway"]


@dataclass(slots=True)
class Gateway:
    settings: Settings
    store: StateStore
    session: aiohttp.ClientSession
    policy: PlacementPolicy
    estimator: OutputLengthEstimator
    metrics: RouterMetrics
    pools: Pools
    # The workers' loops the handlers call into: the admin API's fresh registry read and
    # probes, the store's health for /ready (built and started in router/edge/app.py).
    registry: RegistrySync
    prober: HealthProber
    refresher: StateRefresher
    leases: LeaseKeeper
    histograms: HistogramCache
    admission: Admission
    tasks: BackgroundTasks
    retry_budget: RetryBudget
    adapters: dict[str, WorkerAdapter | ConcurrentAdapter] = field(default_factory=dict)
    clock: Callable[[], float] = time.monotonic
    splice: SplicePool | None = None  # the decode legs' raw client when settings.relay == "splice"
    demand: DemandMeter = field(init=False)  # autoscaling signals (router/control/scaling.py)
    tracing: Tracing = field(default_factory=lambda: Tracing(False))  # router/tracing.py
    # What the estimate got wrong while answers stream (policies/overruns.py): live requests
    # past their reservation raise their class's estimate; forced growth keeps room back.
    overruns: LiveOverruns = field(init=False)
    margin: OverrunMargin = field(init=False)
    # The request path's stages, each handed what it uses (router/request/lifecycle.py).
    requests: RequestStages = field(init=False)

    def __post_init__(self) -> None:
        self.demand = DemandMeter(self.settings.scaling.window_s, self.clock)
        self.overruns = LiveOverruns(self.estimator.bucket_of)
        self.margin = OverrunMargin(
            self.settings.overruns.margin_half_life_s, self.settings.overruns.margin_max_share
        )
        # Every adapter, not only those of configured workers: a worker registered at run time
        # may speak another protocol (stateless objects, so this costs nothing).
        for name in ADAPTERS:
            self.adapters.setdefault(name, adapter_for(name))
        self.requests = self._request_stages()

    def _request_stages(self) -> RequestStages:
        """The request path's stages, each given the services it uses and nothing else."""
        members, placement = self.pools.members, self.pools.placement
        preemptor = Preemptor(self.settings.preemption, self.metrics)
        book = Book(
            self.store,
            self.leases,
            members,
            self.pools.accounting,
            self.tasks,
            self.metrics,
            self.overruns,
            self.margin,
            self.admission,
            self.clock,
            preemptor,
        )
        pairing = Pairing(members, self.adapters)
        reserver = Reserver(
            settings=self.settings,
            store=self.store,
            members=members,
            placement=placement,
            policy=self.policy,
            estimator=self.estimator,
            histograms=self.histograms,
            overruns=self.overruns,
            margin=self.margin,
            admission=self.admission,
            leases=self.leases,
            metrics=self.metrics,
            book=book,
            pairing=pairing,
            clock=self.clock,
        )
        legs = Legs(
            self.settings, self.session, self.splice, members, pairing, self.metrics, self.clock
        )
        quota = QuotaGate(
            self.store,
            self.settings.leases.reservation_s,
            self.settings.scaling,
            self.metrics,
            self.clock,
        )
        # Its holds live as long as the reservations they stand for: renewed on their tick.
        self.leases.also_renew.append(quota.renew_all)
        return RequestStages(
            settings=self.settings,
            metrics=self.metrics,
            tracing=self.tracing,
            admission=self.admission,
            retry_budget=self.retry_budget,
            clock=self.clock,
            reserve=reserver,
            legs=legs,
            answering=Answering(self.metrics, self.settings.timeouts, self.clock, preemptor),
            resume=Resumer(self.settings, self.session, members),
            release=Releaser(book, self.estimator, self.metrics, self.clock),
            quota=quota,
        )

    def __repr__(self) -> str:
        return (
            f"Gateway(policy={self.policy.name}, estimator={self.estimator.name}, "
            f"workers={len(self.pools.workers)}, {self.leases!r})"
        )
