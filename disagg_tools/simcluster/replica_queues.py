"""The admission queues of router replicas on one store, as today's router keeps them (issue 33).

The router's queue and its fairness counters live in each replica's memory
(router/admission.py): replica r orders only its own waiters, with counters that saw only its
own admissions; the decode room is the store's, shared. Room freed by a release on replica r
wakes r's waiters at once (its `notify`); another replica sees it only when it next re-reads
the store (`loops.state_refresh_s`, 0.1 s), by which time r's waiters have taken it. This module
models exactly that in the simulator, with the policy objects the router loads:

    Replicas        how many, which replica a tenant's n-th request lands on (`place`), the
                    store refresh period, and `shared`: one fair share and one line for the
                    whole cluster (what issue 33 asks for; the engine then uses one FairQueue),
                    with room taken back by preemption under vtc (`take_back`, the router's
                    settings; None: off — disagg_tools/simcluster/fair_takeback.py)
    ReplicaQueues   one `FairQueue` per replica, each with its own copy of the policy (its
                    own counters); a release settles on its replica and marks it due, so the
                    next drain wakes that replica's waiters first; every replica with waiters
                    re-reads the store on its own grid of `refresh_s` (phases spread), and
                    drains then

Under an order but `fifo` an arrival queues while its own replica's queue is not empty (the
replica's `queue_first`), not the cluster's.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from disagg_tools.simcluster.fair_queue import FairQueue
from disagg_tools.simcluster.fair_takeback import TakeBackSettings
from disagg_tools.simcluster.workers import Job
from policies.base import AdmissionCost, FairnessPolicy, Tenant

__all__ = ["PLACEMENTS", "ReplicaQueues", "Replicas", "placement"]

PLACEMENTS = ("one", "spread", "split")


def placement(name: str) -> Callable[[str, int], int]:
    """(tenant, its n-th request) -> replica, for the flood bench's placements: `one` all on
    replica 0; `spread` each tenant's requests in turn over replicas 0 and 1; `split` the victim
    on 0, everyone else on 1."""
    if name == "one":
        return lambda tenant, n: 0
    if name == "spread":
        return lambda tenant, n: n % 2
    if name == "split":
        return lambda tenant, n: 0 if tenant == "victim" else 1
    raise ValueError(f"placement must be one of {PLACEMENTS}, not {name!r}")


@dataclass(frozen=True, slots=True)
class Replicas:
    count: int
    place: Callable[[str, int], int]
    refresh_s: float = 0.1  # the router's loops.state_refresh_s
    shared: bool = False  # one fair share and one line for the cluster (issue 33's design)
    # With `shared` and vtc: the router's take-back (fair_takeback.py); None: room is never
    # taken back (the comparison's "off").
    take_back: TakeBackSettings | None = TakeBackSettings()

    def __post_init__(self) -> None:
        if self.count < 1 or self.refresh_s <= 0:
            raise ValueError("replicas: count >= 1 and refresh_s > 0")


class ReplicaQueues:
    """The admission queues of `replicas.count` replicas (the engine's `fair` when not shared)."""

    __slots__ = (
        "queues",
        "queue_first",
        "_replicas",
        "_of",
        "_nth",
        "_due",
        "_ticking",
        "_schedule",
        "_drain",
    )

    def __init__(
        self,
        policy: FairnessPolicy,
        tenants: Mapping[str, Tenant],
        itl_s: float,
        ttft_s: float,
        replicas: Replicas,
        schedule: Callable[[float, Callable[[], None]], None],
        drain: Callable[[], None],
    ) -> None:
        # Each replica its own copy of the policy: its own counters, as each router process.
        self.queues = [
            FairQueue(copy.deepcopy(policy), tenants, itl_s, ttft_s) for _ in range(replicas.count)
        ]
        self.queue_first = self.queues[0].queue_first
        self._replicas = replicas
        self._of: dict[int, int] = {}  # job index -> its replica
        self._nth: dict[str, int] = {}  # tenant -> its requests so far
        self._due: list[int] = []  # replicas whose waiters the next drain wakes, in order
        self._ticking: set[int] = set()  # replicas with a store refresh scheduled
        self._schedule = schedule
        self._drain = drain

    def __repr__(self) -> str:
        return f"ReplicaQueues({self.queues!r})"

    def _queue(self, job: Job) -> tuple[int, FairQueue]:
        r = self._of[job.idx]
        return r, self.queues[r]

    def arrived(self, job: Job) -> None:
        n = self._nth.get(job.tenant, 0)
        self._nth[job.tenant] = n + 1
        r = self._replicas.place(job.tenant, n) % len(self.queues)
        self._of[job.idx] = r
        self.queues[r].arrived(job)

    def holds_back(self, job: Job, waiting: int) -> bool:
        """Whether an arrival must queue behind its own replica's waiters."""
        _, q = self._queue(job)
        return q.holds_back(job, q.waiting)

    def wait(self, job: Job, now: float) -> None:
        r, q = self._queue(job)
        q.wait(job, now)
        self._refresh_later(r, now)

    def admitted(self, job: Job) -> None:
        self._queue(job)[1].admitted(job)

    def withdraw(self, job: Job) -> None:
        self._queue(job)[1].withdraw(job)

    def settle(self, job: Job, actual: AdmissionCost) -> None:
        """A release on the job's replica: settled there, and that replica's waiters are the
        first the next drain wakes (its own `notify`)."""
        r, q = self._queue(job)
        q.settle(job, actual)
        if r not in self._due:
            self._due.append(r)

    def drain(self, now: float, try_admit: Callable[[Job], bool]) -> int:
        """Wake the due replicas' waiters (local releases, then refreshes), in that order."""
        admitted = 0
        due, self._due = self._due, []
        for r in due:
            admitted += self.queues[r].drain(now, try_admit)
        return admitted

    def _refresh_later(self, r: int, now: float) -> None:
        """Replica r's next store refresh on its grid (phase r × refresh / count), while it has
        waiters: then its waiters try the room the store shows."""
        if r in self._ticking:
            return
        self._ticking.add(r)
        period = self._replicas.refresh_s
        phase = r * period / len(self.queues)
        at = phase + math.floor((now - phase) / period + 1.0) * period
        if at <= now + 1e-9:  # `now` on the grid already (a refresh's own): the next one
            at += period
        self._schedule(at, lambda: self._refresh(r, at))

    def _refresh(self, r: int, now: float) -> None:
        self._ticking.discard(r)
        if not self.queues[r].waiting:
            return
        if r not in self._due:
            self._due.append(r)
        self._drain()
        if self.queues[r].waiting:
            self._refresh_later(r, now)
