"""The request path's stages, assembled once per app: each stage is handed the services it uses
and nothing else (router/request/lifecycle.py `RequestStages` runs them)."""

from __future__ import annotations

from collections.abc import Callable

from policies.base import OutputLengthEstimator, PlacementPolicy
from policies.fairness import VTCFairness
from policies.overruns import LiveOverruns, OverrunMargin
from router.adapters import ADAPTERS, ConcurrentAdapter, WorkerAdapter, adapter_for
from router.edge.wiring import Core
from router.fair_share import ClusterShare
from router.histograms import HistogramCache
from router.request.fair_takeback import FairTakeBack
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
from router.tenant_metrics import watch_tenants
from router.tracing import Tracing
from router.workers.pools import Pools

__all__ = ["build_stages"]


def _every_adapter() -> dict[str, WorkerAdapter | ConcurrentAdapter]:
    """Every adapter, not only those of configured workers: a worker registered at run time may
    speak another protocol (stateless objects, so this costs nothing)."""
    return {name: adapter_for(name) for name in ADAPTERS}


def _cluster_share(
    core: Core, pools: Pools, preemptor: Preemptor, clock: Callable[[], float]
) -> ClusterShare | None:
    """With `vtc` (and `admission.fair_cluster`): one fair share for the cluster, its charges
    and waiters shared through the store, its room taken back by preemption (issue 33)."""
    admission, settings = core.admission, core.settings.admission
    policy = admission.policy
    if not settings.fair_cluster or not isinstance(policy, VTCFairness):
        return None
    members = pools.members
    share = ClusterShare(
        settings,
        core.store,
        admission,
        policy,
        core.tasks,
        clock,
        weights={t.name: t.weight for t in core.settings.tenants},
        capacity=lambda: sum(w.capacity_blocks for w in members.decode_workers),
    )
    admission.ledger = share
    share.listeners.append(FairTakeBack(settings, preemptor, clock))
    return share


def build_stages(
    core: Core,
    pools: Pools,
    *,
    policy: PlacementPolicy,
    estimator: OutputLengthEstimator,
    histograms: HistogramCache,
    tracing: Tracing,
    clock: Callable[[], float],
) -> RequestStages:
    """The stages of `core`'s replica placing on `pools` with `policy` and `estimator`."""
    settings, metrics = core.settings, core.metrics
    members = pools.members
    # What the estimate got wrong while answers stream (policies/overruns.py): live requests
    # past their reservation raise their class's estimate; forced growth keeps room back.
    overruns = LiveOverruns(estimator.bucket_of)
    margin = OverrunMargin(settings.overruns.margin_half_life_s, settings.overruns.margin_max_share)
    preemptor = Preemptor(settings.preemption, metrics)
    book = Book(
        core.store,
        core.leases,
        members,
        pools.accounting,
        core.tasks,
        metrics,
        overruns,
        margin,
        core.admission,
        clock,
        preemptor,
    )
    pairing = Pairing(members, _every_adapter())
    reserver = Reserver(
        settings=settings,
        store=core.store,
        members=members,
        placement=pools.placement,
        policy=policy,
        estimator=estimator,
        histograms=histograms,
        overruns=overruns,
        margin=margin,
        admission=core.admission,
        leases=core.leases,
        metrics=metrics,
        book=book,
        pairing=pairing,
        clock=clock,
    )
    reserver.share = _cluster_share(core, pools, preemptor, clock)
    watch_tenants(metrics, core.admission, reserver.share, (t.name for t in settings.tenants))
    legs = Legs(settings, core.session, core.splice, members, pairing, metrics, clock)
    legs.loras = pools.placement.loras  # LoRA adapters loaded before the prefill leg
    quota = QuotaGate(core.store, settings.leases.reservation_s, settings.scaling, metrics, clock)
    # Its holds live as long as the reservations they stand for: renewed on their tick.
    core.leases.also_renew.append(quota.renew_all)
    core.leases.also_holding.append(lambda: bool(quota.holds))
    quota.on_hold = core.leases.wake
    return RequestStages(
        settings=settings,
        metrics=metrics,
        tracing=tracing,
        admission=core.admission,
        retry_budget=core.retry_budget,
        clock=clock,
        reserve=reserver,
        legs=legs,
        answering=Answering(metrics, settings.timeouts, clock, preemptor),
        resume=Resumer(settings, core.session, members),
        release=Releaser(book, estimator, metrics, clock),
        quota=quota,
    )
