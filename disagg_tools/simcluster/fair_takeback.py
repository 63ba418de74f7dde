"""Taking decode room back for the cluster's fair share and its classes, in the simulator (issue
33), as the live router does it (router/request/fair_takeback.py) with the router's own rule
(policies/fair_share.py `plan_take_back`) and its preemption with exact resume
(disagg_tools/simcluster/preemption.py).

What runs, per router replica r (`Replicas.count`; a request's replica is where `Replicas.place`
lands it, as in replica_queues.py, and the replica relays its decode stream):

- r syncs every `sync_s` on its own grid (phase r × sync_s / count) while anything waits or
  holds room (the router's sync loop runs while it is busy), and once more when a request
  of a line (class, tenant) r had not registered has waited `after_s` (`waits`, the router's
  `ClusterShare.waits`): if it still waits then, the other replicas with a registration sync
  at once too (the router's nudge). At its sync it registers, as the
  store keeps them (state/fair_shares.py), its waiting requests per (class, tenant) — how many
  and since when the oldest waits (every request in the simulator's queue waits for decode
  room: it has no concurrency cap) — and the blocks its admitted requests reserved per tenant
  (the router's `Charge.blocks`); then it reads every replica's registrations: the waiters
  (`ClusterWaiter`, the counter from the cluster's one VTC policy, the wait aged to now) and the
  `Occupancy` (the decode pool's capacity, the blocks held per tenant, the tenants' weights,
  who holds or waits) — router/fair_share.py `_adopt`;
- its token bucket (`per_s` a second, a burst of `TAKE_BACK_BURST`, from full at the start) gives
  the budget;
  `plan_take_back` picks among the streams r relays (the sequences running on a decode worker:
  tenant, worker, reservation time, blocks held, times preempted, class);
- before it preempts, r claims the waiting requests the plan serves, each for
  `max(0.1, 4 × sync_s)` (state/memory_fair.py `fair_claim`: the first units of a line nobody
  claimed), and preempts only for those it got, as the router does;
- each chosen stream stops at once (`DecodeWorker.stop`), its room given back, and resumes as
  its continuation (`RouterPreemption.continuation`: prompt + its tokens re-prefilled, waiting
  for room like any request of its class), counted by reason ("priority", "fair_share").

Not modelled: the store's round trips (a registration is read the instant it is written, the
counters are the one policy's, current); a stream whose KV is still on its way to the decode
worker (the router may preempt it, the simulator only running ones); the room's hand-off
between replicas (`handoff_to`), since the simulator's shared fair share is one line already.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from disagg_tools.simcluster.fair_queue import FairQueue
from disagg_tools.simcluster.workers import DecodeWorker, Job
from policies.base import blocks_for
from policies.fair_share import (
    FAIR_SHARE,
    PRIORITY,
    TAKE_BACK_BURST,
    ClusterWaiter,
    Occupancy,
    plan_take_back,
    under_share,
)
from policies.fairness import VTCFairness
from policies.preemption import StreamFacts

__all__ = ["FAIR_SHARE", "PRIORITY", "FairTakeBack", "TakeBackSettings"]

Line = tuple[str, int, str]  # a waiter line: (replica, class, tenant), as `TakeBack.serves`
# router/fair_share.py's _CHECK_MARGIN_S: a timed sync comes this much after the bound.
CHECK_MARGIN_S = 0.002


@dataclass(frozen=True, slots=True)
class TakeBackSettings:
    """The router's settings of the take-back, with its defaults (router/admission.py
    `AdmissionSettings`: fair_sync_s, fair_preempt_after_s, fair_preempt_per_s; the bound per
    stream is `ClusterConfig.preemption_max_per_stream`, the router's preemption.max_per_stream).
    The simulator may not import the router: tests/simcluster checks the two agree."""

    sync_s: float = 0.05
    after_s: float = 0.05
    per_s: float = 4.0

    def __post_init__(self) -> None:
        if not (self.sync_s > 0 and self.after_s >= 0 and self.per_s >= 0):
            raise ValueError("take-back: sync_s > 0, after_s >= 0, per_s >= 0")

    @property
    def enabled(self) -> bool:
        # The router's `FairTakeBack.enabled`: 0 for either is "never".
        return self.after_s > 0 and self.per_s > 0

    @property
    def claim_ttl_s(self) -> float:
        """router/request/fair_takeback.py `claim_ttl_s`: 4 sync periods, at least 0.1 s."""
        return max(0.1, 4 * self.sync_s)


@dataclass(slots=True)
class _Registration:
    """What one replica last registered in the store: its waiter lines (class, tenant) ->
    (requests, when the oldest started waiting), and its reserved blocks per tenant."""

    waiting: dict[tuple[int, str], tuple[int, float]]
    held: Counter[str]


class _Bucket:
    """One replica's token bucket: `rate` a second, a burst of `TAKE_BACK_BURST` (the router's),
    full at the start."""

    __slots__ = ("rate", "tokens", "at")

    def __init__(self, rate: float) -> None:
        self.rate = rate
        self.tokens = float(TAKE_BACK_BURST)
        self.at = 0.0

    def refill(self, now: float) -> int:
        """Whole tokens to spend now (the router's `int(self._tokens)`)."""
        self.tokens = min(TAKE_BACK_BURST, self.tokens + (now - self.at) * self.rate)
        self.at = now
        return int(self.tokens)


class _Claims:
    """The store's claims on waiting requests (state/memory_fair.py `fair_claim`): unit k of a
    line is claimed by one replica for `ttl_s`; the others get only the units nobody holds."""

    __slots__ = ("ttl_s", "_units")

    def __init__(self, ttl_s: float) -> None:
        self.ttl_s = ttl_s
        self._units: dict[tuple[Line, int], float] = {}  # (line, k) -> expiry

    def claim(self, wanted: Counter[Line], counts: dict[Line, int], now: float) -> Counter[Line]:
        units = self._units
        for unit in [u for u, expires in units.items() if expires <= now]:
            del units[unit]
        got: Counter[Line] = Counter()
        for line, want in sorted(wanted.items()):
            for k in range(counts.get(line, want)):
                if got[line] >= want:
                    break
                if (line, k) not in units:
                    units[(line, k)] = now + self.ttl_s
                    got[line] += 1
        return got


class FairTakeBack:
    """The take-back of one simulated cluster (the module's docstring). `cut(job, reason)` is
    the engine's: stop the running stream now and resume it."""

    def __init__(
        self,
        settings: TakeBackSettings,
        replicas: int,
        place: Callable[[str, int], int],
        queue: FairQueue,
        decodes: Sequence[DecodeWorker],
        bound: int,
        schedule: Callable[[float, Callable[[], None]], None],
        cut: Callable[[Job, str], None],
    ) -> None:
        if not isinstance(queue.policy, VTCFairness):
            raise ValueError("the take-back runs with the vtc order only (as the router's)")
        self.settings = settings
        self.policy: VTCFairness = queue.policy
        self.queue = queue
        self.decodes = decodes
        self.bound = bound
        self._replicas = replicas
        self._place = place
        self._schedule = schedule
        self._cut = cut
        self._of: dict[int, int] = {}  # job index -> the replica that holds and relays it
        self._nth: dict[str, int] = {}  # tenant -> its requests so far
        self._ticking: set[int] = set()
        self._registered = [_Registration({}, Counter()) for _ in range(replicas)]
        # Replica r's waiter lines as last counted: line -> (the queue's stamp of the line
        # then, its requests on r, when the oldest started waiting); a sync recounts only the
        # lines whose stamp moved.
        self._counted: list[dict[tuple[int, str], tuple[int, int, float]]] = [
            {} for _ in range(replicas)
        ]
        # The occupancy the registrations show (`_occupancy`), until the next registration.
        self._occupancy_now: Occupancy | None = None
        self._buckets = [_Bucket(settings.per_s) for _ in range(replicas)]
        self._claims = _Claims(settings.claim_ttl_s)
        self._timed: set[tuple[int, tuple[int, str]]] = set()  # (replica, line): a timed sync due
        # Each preemption: (time, replica, reason) — the counts and the rate bound's record.
        self.taken: list[tuple[float, int, str]] = []

    def __repr__(self) -> str:
        return f"FairTakeBack(taken={len(self.taken)}, replicas={self._replicas})"

    def arrived(self, job: Job) -> None:
        """A request lands on its replica (its continuations stay there)."""
        n = self._nth.get(job.tenant, 0)
        self._nth[job.tenant] = n + 1
        self._of[job.idx] = self._place(job.tenant, n) % self._replicas

    def busy(self, now: float) -> None:
        """Something waits or was admitted: every replica syncs on its grid again."""
        if not self.settings.enabled:
            return
        for r in range(self._replicas):
            if r not in self._ticking:
                self._ticking.add(r)
                self._sync_later(r, now)

    def waits(self, job: Job, now: float) -> None:
        """A job starts waiting for room (the router's `ClusterShare.waits`): a line (class,
        tenant) its replica did not register at its last sync gets a sync of its own once it has
        waited `after_s`; if it still waits then, the other replicas with a registration sync
        at once too (the router's nudge)."""
        self.busy(now)
        r = self._of.get(job.idx)
        if not self.settings.enabled or job.waiting is None or r is None:
            return
        line = (job.waiting.priority, job.tenant)
        if line in self._registered[r].waiting or (r, line) in self._timed:
            return
        if not under_share(self._occupancy(), job.tenant):
            return
        self._timed.add((r, line))
        at = now + self.settings.after_s + CHECK_MARGIN_S
        self._schedule(at, lambda: self._timed_sync(r, line, at))

    def _timed_sync(self, r: int, line: tuple[int, str], now: float) -> None:
        self._timed.discard((r, line))
        self._sync_once(r, now)
        if line not in self._registered[r].waiting:
            return  # admitted meanwhile
        for other in range(self._replicas):
            if other != r and self._registered[other].waiting:
                self._sync_once(other, now)

    def _sync_later(self, r: int, now: float) -> None:
        period = self.settings.sync_s
        phase = r * period / self._replicas
        at = phase + math.floor((now - phase) / period + 1.0) * period
        if at <= now + 1e-9:  # `now` on the grid already (a sync's own): the next one
            at += period
        self._schedule(at, lambda: self._sync(r, at))

    def _sync(self, r: int, now: float) -> None:
        self._sync_once(r, now)
        if self.queue.waiting or any(d.reservations for d in self.decodes):
            self._sync_later(r, now)
        else:  # idle: the next wait or admission starts the loop again (the router's)
            self._ticking.discard(r)

    def _sync_once(self, r: int, now: float) -> None:
        """Replica r's sync: it registers, reads every registration and takes back."""
        self._registered[r] = self._register(r)
        self._occupancy_now = None
        self._take_back(r, now)

    def _register(self, r: int) -> _Registration:
        counted = self._counted[r]
        lines: dict[tuple[int, str], tuple[int, float]] = {}
        for line, jobs in self.queue.lines().items():
            stamp = self.queue.stamp(line)
            seen = counted.get(line)
            if seen is None or seen[0] != stamp:
                count, since = 0, math.inf
                for job in jobs.values():
                    if self._of.get(job.idx) == r:
                        count, since = count + 1, min(since, job.queued_at)
                seen = counted[line] = (stamp, count, since)
            if seen[1]:
                lines[line] = seen[1:]
        held: Counter[str] = Counter()
        for d in self.decodes:
            for job in d.reservations.values():
                if self._of.get(job.idx) == r:
                    held[job.tenant] += job.res
        return _Registration(lines, held)

    def _view(self, now: float) -> tuple[list[ClusterWaiter], Occupancy]:
        """Every replica's registrations as the store answers a sync (router/fair_share.py
        `_adopt`)."""
        waiters: list[ClusterWaiter] = []
        for r, reg in enumerate(self._registered):
            for (priority, tenant), (count, since) in sorted(reg.waiting.items()):
                counter = self.policy.counter(tenant, priority)
                waiters.append(
                    ClusterWaiter(str(r), priority, tenant, counter, count, max(0.0, now - since))
                )
        return waiters, self._occupancy()

    def _occupancy(self) -> Occupancy:
        """Who holds and waits, by the registrations: the same until the next one, so it is
        built once for the waits and the take-back between two (the decode pool's capacity
        is fixed: the simulator runs a fairness policy on a fixed cluster only)."""
        if self._occupancy_now is None:
            held: Counter[str] = Counter()
            waiting: set[str] = set()
            for reg in self._registered:
                waiting.update(tenant for _, tenant in reg.waiting)
                held.update(reg.held)
            held = +held  # (a tenant holding nothing is not a holder)
            active = frozenset(held) | waiting
            weights = {t: self.queue.tenant(t).weight for t in active}
            capacity = sum(d.capacity for d in self.decodes)
            self._occupancy_now = Occupancy(capacity, dict(held), weights, active)
        return self._occupancy_now

    def _streams(self, r: int) -> dict[str, Job]:
        return {
            str(job.idx): job
            for d in self.decodes
            for job in d.seqs.values()
            if self._of.get(job.idx) == r
        }

    def _take_back(self, r: int, now: float) -> None:
        """router/request/fair_takeback.py `FairTakeBack.__call__`, for replica r."""
        # The same steps, the view (O(waiter lines)) built last: most syncs have no budget
        # (4 a second against 20 syncs). The bucket refills exactly when it did: something waits.
        if not any(reg.waiting for reg in self._registered):
            return
        bucket = self._buckets[r]
        budget = bucket.refill(now)
        if budget < 1:
            return
        streams = self._streams(r)
        if not streams:
            return
        waiters, occupancy = self._view(now)
        plan = plan_take_back(
            [_facts(sid, job) for sid, job in streams.items()],
            waiters,
            occupancy,
            self.settings.after_s,
            self.bound,
            budget,
        )
        if not plan:
            return
        counts = {(w.replica, w.priority, w.tenant): w.count for w in waiters}
        granted = self._claims.claim(Counter(plan.serves.values()), counts, now)
        for_class = plan.claimed(plan.for_class, granted)
        for_share = plan.claimed(plan.for_share, granted)
        bucket.tokens -= len(for_class) + len(for_share)
        # The room is the waiters' it was taken for (the router's earmark; the simulator's
        # shared fair share is one line, so every replica's waiter is woken here).
        for sid in (*for_class, *for_share):
            _, priority, tenant = plan.serves[sid]
            self.queue.earmark(priority, tenant, now + self.settings.claim_ttl_s)
        for reason, chosen in ((PRIORITY, for_class), (FAIR_SHARE, for_share)):
            for sid in chosen:
                self.taken.append((now, r, reason))
                self._cut(streams[sid], reason)


def _facts(stream_id: str, job: Job) -> StreamFacts:
    """What the rule reads of a running stream (as disagg_tools/simcluster/preemption.py
    `_facts`: its reservation time stands for the router's dispatch, its blocks are its
    reservation or what it grew to)."""
    d = job.d
    assert d is not None and job.waiting is not None
    blocks = max(job.res, blocks_for(job.ctx0 + d.step - job.s0, d.bs))
    return StreamFacts(
        stream_id, job.tenant, d.wid, job.admitted_at, blocks, job.cuts, job.waiting.priority
    )
