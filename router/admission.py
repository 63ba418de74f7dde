"""Admission: a true concurrency cap and a bounded wait for decode room, in the order of the
fairness policy (policies/fairness.py, settings `fairness`: `fifo`, the default, is priority then
FIFO; `vtc` shares the room among tenants by weight).

A request that finds no room (or no free concurrency slot) waits here until room may have
appeared — a local release, or a store refresh that shows other replicas' releases — or until
its deadline; a full queue refuses at once. A wake-up goes to the head waiter (the policy's
`pick`), so under `fifo` the order is FIFO within a priority (lower `priority` first, as vLLM
orders it), and carries a small budget: a waiter that still finds no room passes the wake-up on
to the next one in line (`pick` skipping those this wake-up tried), at most `BACKFILL` waiters a
round. So a large request at the head (4,000 tokens asked on full workers)
does not hold back the small ones behind it that fit, and a wake-up never sets off a thundering
herd of placement attempts.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from policies.base import AdmissionCost, Charge, FairnessPolicy, Tenant, WaitingRequest
from policies.fairness import FifoFairness

__all__ = ["AdmissionSettings", "Admission", "QueueFull", "BACKFILL"]

# Waiters one wake-up may reach: the head, then the next ones in line while each finds no room.
BACKFILL = 8


class QueueFull(Exception):
    """The admission queue holds its maximum number of waiters."""


@dataclass(frozen=True, slots=True)
class AdmissionSettings:
    # queue: wait for room until the deadline | instant: refuse at once | predictive: also admit
    # on room forecast to free before the prefill ends (Mooncake), else wait like `queue`
    mode: str = "queue"
    max_inflight: int = 4096  # requests being served at once by this replica
    max_waiters: int = 1024
    max_wait_s: float = 30.0  # never wait longer than this (nor past the TTFT deadline)

    def __post_init__(self) -> None:
        if self.mode not in ("queue", "instant", "predictive"):
            raise ValueError(
                f"admission.mode must be queue, instant or predictive, not {self.mode!r}"
            )
        if self.max_inflight < 1 or self.max_waiters < 0 or self.max_wait_s < 0:
            raise ValueError("admission limits must be positive")


# The request of a caller that names no tenant (`wait` without `request`): tests, tools.
_ANONYMOUS = Tenant("default")
_NO_COST = AdmissionCost(0.0, 0)


class Admission:
    """The concurrency cap and the queue. The order of the queue is the fairness policy's
    (policies/fairness.py; `fifo`, the default, is priority then ticket). A request is in the
    policy from its first wait until it is admitted (`admitted`) or gives up (`withdraw`, or a
    deadline or cancel inside `wait`): while it is awake (woken, trying for room) it stays there,
    skipped by `pick`, so a re-wait keeps its place and its tenant stays a waiting one."""

    def __init__(
        self,
        settings: AdmissionSettings,
        policy: FairnessPolicy | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings
        self.policy: FairnessPolicy = policy if policy is not None else FifoFairness()
        # fifo lets an arrival that finds room go before the waiters (today's behaviour: a small
        # request fits where the head does not). Any other order must see every admission while
        # something waits, or its shares (and its starvation bound) do not hold: arrivals queue.
        self.queue_first = self.policy.name != "fifo"
        self.inflight = 0
        self._clock = clock
        self._waiting = 0
        self._seq = itertools.count()
        self._queued: dict[int, WaitingRequest] = {}  # in the policy: parked or awake
        self._parked: dict[int, asyncio.Future[int]] = {}  # waiting for a wake-up
        self._awake: set[int] = set()  # woken, trying for room, still in the policy
        # What the wake-up round a woken request belongs to has tried (it, and those before it
        # on the chain): `pass_on` skips them, so the round moves on down the line.
        self._tried: dict[int, tuple[int, ...]] = {}

    def __repr__(self) -> str:
        return (
            f"Admission(inflight={self.inflight}, waiting={self._waiting}, "
            f"queued={len(self._queued)}, {self.policy!r})"
        )

    @property
    def waiting(self) -> int:
        """Requests parked in the queue, waiting for a wake-up."""
        return self._waiting

    @property
    def queued(self) -> int:
        """Requests in the queue's order: parked, or woken and trying for room."""
        return len(self._queued)

    def ticket(self) -> int:
        """A request's place in line, kept across its re-waits."""
        return next(self._seq)

    def has_slot(self) -> bool:
        return self.inflight < self.settings.max_inflight

    def enter(self) -> None:
        self.inflight += 1

    def leave(self) -> None:
        self.inflight -= 1
        self.notify()

    async def wait(
        self,
        priority: int,
        ticket: int,
        deadline: float,
        request: WaitingRequest | None = None,
    ) -> int:
        """Wait for a wake-up: its budget (>= 1: how many waiters, this one included, it may
        still reach, see `pass_on`); 0 when the loop-time `deadline` passes first (the request
        then leaves the queue, as when it is cancelled). `request`: what the fairness policy
        orders by (its tenant and cost); None: the anonymous tenant's, at no cost."""
        if self._waiting >= self.settings.max_waiters:
            raise QueueFull(f"the admission queue is full ({self.settings.max_waiters} waiting)")
        loop = asyncio.get_running_loop()
        if deadline <= loop.time():
            self.withdraw(ticket)
            return 0
        if ticket not in self._queued:
            if request is None:
                request = WaitingRequest(ticket, _ANONYMOUS, priority, _NO_COST)
            request = replace(request, since_s=self._clock())
            self._queued[ticket] = request
            self.policy.enqueue(request)
        future: asyncio.Future[int] = loop.create_future()
        self._awake.discard(ticket)
        self._tried.pop(ticket, None)
        self._parked[ticket] = future
        self._waiting += 1
        try:
            async with asyncio.timeout_at(deadline):
                return await future
        except TimeoutError:
            self._parked.pop(ticket, None)
            self.withdraw(ticket)
            return 0
        except asyncio.CancelledError:
            self._parked.pop(ticket, None)
            self.withdraw(ticket)
            raise
        finally:
            self._waiting -= 1
            if self._parked.get(ticket) is future:
                del self._parked[ticket]

    def withdraw(self, ticket: int) -> None:
        """The request stops waiting without being admitted (deadline, cancel, an error)."""
        if self._queued.pop(ticket, None) is not None:
            self.policy.withdraw(ticket)
        self._awake.discard(ticket)
        self._tried.pop(ticket, None)

    def admitted(self, request: WaitingRequest) -> Charge:
        """The request got its room (waited or not): the policy charges its tenant the estimate;
        the charge is settled with the actual cost at its release (`settle`)."""
        queued = self._queued.pop(request.ticket, None)
        self._awake.discard(request.ticket)
        self._tried.pop(request.ticket, None)
        return self.policy.admit(queued or request)

    def settle(self, charge: Charge, actual: AdmissionCost) -> None:
        self.policy.settle(charge, actual)

    def notify(self, budget: int = BACKFILL) -> None:
        """Room may have appeared: let the head waiter try again (and pass it on, `pass_on`)."""
        self._wake(budget, ())

    def pass_on(self, priority: int, ticket: int, budget: int) -> None:
        """The waiter `ticket` woke and found no room: wake the next one in line that this
        wake-up has not tried, with what is left of its budget (nothing when it is spent)."""
        tried = self._tried.pop(ticket, (ticket,))
        if budget < 1:
            return
        self._wake(budget, tried)

    def _wake(self, budget: int, tried: tuple[int, ...]) -> None:
        if not self._parked:
            return
        now = self._clock()
        if not tried and self.queue_first and self._awake:
            # A fresh wake-up while the head is already awake (trying, or about to): it will
            # see this room too, or pass it on. Waking the next as well would set the two
            # racing for one room, and the order's shares would blur into who asked first.
            head = self.policy.pick(now)
            if head is not None and head.ticket in self._awake:
                return
        skip = self._awake.union(tried)
        while (chosen := self.policy.pick(now, skip)) is not None:
            future = self._parked.pop(chosen.ticket, None)
            if future is None or future.done():
                skip.add(chosen.ticket)  # cancelled, its task not yet run: it withdraws itself
                continue
            self._awake.add(chosen.ticket)
            self._tried[chosen.ticket] = (*tried, chosen.ticket)
            future.set_result(budget)
            return
