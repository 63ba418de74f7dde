"""What a test looks at inside a running router app. The app hands each surface only what it uses
(router/edge/app.py: `Serving`, the admin routes' `AdminView`, the request stages); this reads
each service from the surface that holds it, so a test names the service, not its path."""

from __future__ import annotations

from collections.abc import Callable

from aiohttp import web

from policies.base import OutputLengthEstimator
from policies.overruns import LiveOverruns, OverrunMargin
from router.admission import Admission
from router.background import BackgroundTasks
from router.config import Settings
from router.edge.admin import ADMIN
from router.edge.app import METRICS, SERVING, SETTINGS
from router.histograms import HistogramCache
from router.leases import LeaseKeeper
from router.metrics import RouterMetrics
from router.relay.upstream_pool import SplicePool
from router.request.lifecycle import RequestStages
from router.workers.pools import Pools
from router.workers.refresher import StateRefresher
from state.base import StateStore

__all__ = ["AppParts", "parts"]


class AppParts:
    __slots__ = ("app",)

    def __init__(self, app: web.Application) -> None:
        self.app = app

    def __repr__(self) -> str:
        return f"AppParts({self.app[SERVING]!r})"

    @property
    def settings(self) -> Settings:
        return self.app[SETTINGS]

    @property
    def metrics(self) -> RouterMetrics:
        return self.app[METRICS]

    @property
    def requests(self) -> RequestStages:
        return self.app[SERVING].stages

    @property
    def pools(self) -> Pools:
        return self.app[SERVING].pools

    @property
    def leases(self) -> LeaseKeeper:
        return self.app[SERVING].leases

    @property
    def refresher(self) -> StateRefresher:
        return self.app[SERVING].refresher

    @property
    def store(self) -> StateStore:
        return self.app[ADMIN].store

    @property
    def estimator(self) -> OutputLengthEstimator:
        return self.app[ADMIN].estimator

    @property
    def admission(self) -> Admission:
        return self.requests.admission

    @property
    def clock(self) -> Callable[[], float]:
        return self.requests.clock

    @property
    def splice(self) -> SplicePool | None:
        return self.requests.legs.splice

    @property
    def overruns(self) -> LiveOverruns:
        return self.requests.release.book.overruns

    @property
    def margin(self) -> OverrunMargin:
        return self.requests.release.book.margin

    @property
    def tasks(self) -> BackgroundTasks:
        return self.requests.release.book.tasks

    @property
    def histograms(self) -> HistogramCache:
        return self.requests.reserve.histograms


def parts(app: web.Application) -> AppParts:
    return AppParts(app)
