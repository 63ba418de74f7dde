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
from router.histograms import HistogramCache
from router.leases import LeaseKeeper
from router.metrics import RouterMetrics
from router.relay.upstream_pool import SplicePool
from router.retry_budget import RetryBudget
from router.scaling import DemandMeter
from router.tracing import Tracing
from router.workers.pools import Pools
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
    leases: LeaseKeeper
    histograms: HistogramCache
    admission: Admission
    tasks: BackgroundTasks
    retry_budget: RetryBudget
    adapters: dict[str, WorkerAdapter | ConcurrentAdapter] = field(default_factory=dict)
    clock: Callable[[], float] = time.monotonic
    splice: SplicePool | None = None  # the decode legs' raw client when settings.relay == "splice"
    demand: DemandMeter = field(init=False)  # autoscaling signals (router/scaling.py)
    tracing: Tracing = field(default_factory=lambda: Tracing(False))  # router/tracing.py
    # What the estimate got wrong while answers stream (policies/overruns.py): live requests
    # past their reservation raise their class's estimate; forced growth keeps room back.
    overruns: LiveOverruns = field(init=False)
    margin: OverrunMargin = field(init=False)

    def __post_init__(self) -> None:
        self.demand = DemandMeter(self.settings.scaling.window_s, self.clock)
        self.overruns = LiveOverruns(self.estimator.bucket_of)
        self.margin = OverrunMargin(
            self.settings.overrun_margin_half_life_s, self.settings.overrun_margin_max_share
        )
        # Every adapter, not only those of configured workers: a worker registered at run time
        # may speak another protocol (stateless objects, so this costs nothing).
        for name in ADAPTERS:
            self.adapters.setdefault(name, adapter_for(name))

    def __repr__(self) -> str:
        return (
            f"Gateway(policy={self.policy.name}, estimator={self.estimator.name}, "
            f"workers={len(self.pools.workers)}, {self.leases!r})"
        )
