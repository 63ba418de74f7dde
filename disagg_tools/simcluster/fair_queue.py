"""The simulator's admission queue in a fairness policy's order (issue 25), as the router runs it.

The same `policies.base.FairnessPolicy` object the router loads (`policies.registry.
load_fairness`), driven the way router/admission.py, router/request/reserve.py and
router/request/lifecycle.py drive it:

- a request waits weighed by its bound (`estimate_cost(info, itl_s, ttft_s)`: the router
  passes its ITL and TTFT SLOs, the simulator its TPOT and TTFT SLOs); when it gets its room it
  is charged what it is expected to hold once placed (`admission_charge` with the placed
  candidate's `reserve_blocks`, `predicted_ttft_s` and `predicted_itl_s`, else the ITL SLO:
  reserve.py `admit_and_reserve`), and settled with its actual cost when its reservation is
  released (`actual_cost`: the blocks it held, as grown, for the time from its reservation to
  its release, and its prompt tokens);
- under any order but `fifo` an arrival queues while anything waits (`queue_first`: the
  policy must see every admission or its shares do not hold); under `fifo` an arrival that
  finds room goes first, as today;
- when room may have appeared (a release, a handoff, an eviction) the queue is offered to the
  policy's `pick`: a waiter that does not fit is skipped and the next one tried, at most
  `BACKFILL` failed tries a round (the router's wake-up budget); an admission starts a new
  round, as the router's `notify` after a successful reservation does;
- a request whose TTFT deadline passes while it waits is withdrawn (the router's 429).

The engine (`disagg_tools.simcluster.engine`) keeps its own FIFO deque when no policy is given,
so runs without tenants are unchanged.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping
from dataclasses import replace

from disagg_tools.simcluster.workers import Job
from policies.base import AdmissionCost, FairnessPolicy, Tenant, WaitingRequest, blocks_for
from policies.fairness import admission_charge, estimate_cost

__all__ = ["BACKFILL", "FairQueue", "actual_cost"]

# router/admission.py's BACKFILL: waiters one wake-up may reach while each finds no room.
BACKFILL = 8


def actual_cost(job: Job, now: float, completed: bool) -> AdmissionCost:
    """What the job's reservation took, at its release (router/request/reserve.py
    `actual_cost`): its blocks as grown — the reservation, or what a completed answer came to
    hold when it outgrew it — for the time since its reservation, and its prompt tokens."""
    blocks = job.res
    if completed and job.d is not None:
        # (`asked`: a preempted stream's continuation has its answer so far in `prompt`)
        blocks = max(blocks, blocks_for(job.asked + job.out, job.d.bs))
    return AdmissionCost(blocks * max(0.0, now - job.admitted_at), job.prompt)


class FairQueue:
    """The waiting jobs, in `policy`'s order, and what it charged the admitted ones."""

    __slots__ = (
        "policy",
        "queue_first",
        "_tenants",
        "_jobs",
        "_tickets",
        "_itl_s",
        "_ttft_s",
        "_earmarks",
        "_lines",
        "_stamps",
        "_stamp",
    )

    def __init__(
        self,
        policy: FairnessPolicy,
        tenants: Mapping[str, Tenant],
        itl_s: float,
        ttft_s: float,
    ) -> None:
        self.policy = policy
        self.queue_first = policy.name != "fifo"
        self._tenants = dict(tenants)
        self._jobs: dict[int, Job] = {}  # ticket -> job, while it is in the policy
        self._tickets = itertools.count()
        self._itl_s = itl_s
        self._ttft_s = ttft_s
        # (class, tenant) -> until when room freed for that line is its waiters' first
        # (router/admission.py `earmark`).
        self._earmarks: dict[tuple[int, str], float] = {}
        # (class, tenant) -> its waiting jobs by ticket: an earmarked line's first is found
        # among its own waiters, and the take-back's registration recounts only the lines that
        # changed (`stamp`), not every waiter (1,000 tenants: ~17,000 of them).
        self._lines: dict[tuple[int, str], dict[int, Job]] = {}
        self._stamps: dict[tuple[int, str], int] = {}  # line -> the count of its last change
        self._stamp = 0

    def __repr__(self) -> str:
        return f"FairQueue(waiting={len(self._jobs)}, {self.policy!r})"

    @property
    def waiting(self) -> int:
        """Jobs waiting in this queue (in the policy)."""
        return len(self._jobs)

    def holds_back(self, job: Job, waiting: int) -> bool:
        """Whether an arrival must queue behind the `waiting` ones: under any order but
        `fifo` while anything waits (the policy must see every admission)."""
        return self.queue_first and waiting > 0

    def tenant(self, name: str) -> Tenant:
        """A tenant of the table; one it does not name has weight 1, class 0."""
        tenant = self._tenants.get(name)
        if tenant is None:
            tenant = self._tenants[name] = Tenant(name)
        return tenant

    def arrived(self, job: Job) -> None:
        """The job (estimated) asks for admission: its ticket and estimated cost."""
        assert job.info is not None
        tenant = self.tenant(job.tenant)
        cost = estimate_cost(job.info, self._itl_s, self._ttft_s)
        job.waiting = WaitingRequest(next(self._tickets), tenant, tenant.priority, cost)

    def wait(self, job: Job, now: float) -> None:
        assert job.waiting is not None
        job.waiting = replace(job.waiting, since_s=now)
        self._jobs[job.waiting.ticket] = job
        line = (job.waiting.priority, job.tenant)
        self._lines.setdefault(line, {})[job.waiting.ticket] = job
        self._changed(line)
        self.policy.enqueue(job.waiting)

    def admitted(self, job: Job) -> None:
        """It got its room (waited or not) on `job.placed`: its tenant is charged what it is
        expected to hold there."""
        assert job.waiting is not None and job.info is not None and job.placed is not None
        self._leave(job)
        if self._earmarks:
            self._earmarks.pop((job.waiting.priority, job.tenant), None)
        cand = job.placed
        charged = admission_charge(
            job.info,
            cand.reserve_blocks,
            cand.predicted_ttft_s,
            cand.predicted_itl_s or self._itl_s,
        )
        job.charge = self.policy.admit(replace(job.waiting, cost=charged))

    def withdraw(self, job: Job) -> None:
        if job.waiting is not None and self._leave(job):
            self.policy.withdraw(job.waiting.ticket)

    def _leave(self, job: Job) -> bool:
        """The job stops waiting here (admitted or withdrawn); False if it was not waiting."""
        assert job.waiting is not None
        if self._jobs.pop(job.waiting.ticket, None) is None:
            return False
        line = (job.waiting.priority, job.tenant)
        jobs = self._lines[line]
        del jobs[job.waiting.ticket]
        if not jobs:
            del self._lines[line]
        self._changed(line)
        return True

    def _changed(self, line: tuple[int, str]) -> None:
        self._stamp += 1
        self._stamps[line] = self._stamp

    def lines(self) -> Mapping[tuple[int, str], Mapping[int, Job]]:
        """The waiting jobs by (class, tenant), each line's by ticket (not to be changed)."""
        return self._lines

    def stamp(self, line: tuple[int, str]) -> int:
        """A number that changes whenever a job starts or stops waiting in `line`."""
        return self._stamps.get(line, 0)

    def settle(self, job: Job, actual: AdmissionCost) -> None:
        """Its reservation is released: the charge is corrected to `actual`."""
        if job.charge is not None:
            self.policy.settle(job.charge, actual)
            job.charge = None

    def earmark(self, priority: int, tenant: str, until: float) -> None:
        """Streams were taken back for a waiting request of `tenant` in class `priority`: the
        room they free is its first, until one of that line is admitted or `until` (the
        router's `Admission.earmark`)."""
        self._earmarks[(priority, tenant)] = until

    def _next(self, now: float, skip: set[int]) -> WaitingRequest | None:
        """The oldest waiter of an earmarked line not in `skip`, else the policy's pick."""
        marks = self._earmarks
        if marks:
            for line in [line for line, until in marks.items() if until < now]:
                del marks[line]
            marked = [
                ticket
                for line in marks
                for ticket in self._lines.get(line, ())
                if ticket not in skip
            ]
            if marked:
                return self._jobs[min(marked)].waiting  # the oldest: the lowest ticket
        return self.policy.pick(now, skip)

    def drain(self, now: float, try_admit: Callable[[Job], bool]) -> int:
        """Offer the room to the waiters, an earmarked line's first, then in the policy's
        order; returns how many got in."""
        admitted = 0
        skip: set[int] = set()
        while len(skip) < BACKFILL and (chosen := self._next(now, skip)) is not None:
            job = self._jobs[chosen.ticket]
            if not try_admit(job):
                skip.add(chosen.ticket)
                continue
            job.queued = False
            self.admitted(job)
            admitted += 1
            skip.clear()  # a new wake-up: from the head of the line again
        return admitted
