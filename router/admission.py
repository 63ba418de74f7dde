"""Admission: a true concurrency cap and a bounded, priority-then-FIFO wait for decode room.

A request that finds no room (or no free concurrency slot) waits here until room may have
appeared — a local release, or a store refresh that shows other replicas' releases — or until
its deadline; a full queue refuses at once. A wake-up goes to the head waiter, so the order is
FIFO within a priority (lower `priority` first, as vLLM orders it), and carries a small budget:
a waiter that still finds no room passes the wake-up on to the next one in line, at most
`BACKFILL` waiters a round. So a large request at the head (4,000 tokens asked on full workers)
does not hold back the small ones behind it that fit, and a wake-up never sets off a thundering
herd of placement attempts.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from dataclasses import dataclass, field

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


@dataclass(order=True, slots=True)
class _Waiter:
    priority: int
    seq: int
    future: asyncio.Future[int] = field(compare=False)


class Admission:
    def __init__(self, settings: AdmissionSettings) -> None:
        self.settings = settings
        self.inflight = 0
        self._heap: list[_Waiter] = []
        self._waiting = 0
        self._seq = itertools.count()

    def __repr__(self) -> str:
        return f"Admission(inflight={self.inflight}, waiting={self._waiting})"

    @property
    def waiting(self) -> int:
        return self._waiting

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

    async def wait(self, priority: int, ticket: int, deadline: float) -> int:
        """Wait for a wake-up: its budget (>= 1: how many waiters, this one included, it may
        still reach, see `pass_on`); 0 when the loop-time `deadline` passes first."""
        if self._waiting >= self.settings.max_waiters:
            raise QueueFull(f"the admission queue is full ({self.settings.max_waiters} waiting)")
        loop = asyncio.get_running_loop()
        if deadline <= loop.time():
            return 0
        waiter = _Waiter(priority, ticket, loop.create_future())
        heapq.heappush(self._heap, waiter)
        self._waiting += 1
        try:
            async with asyncio.timeout_at(deadline):
                return await waiter.future
        except TimeoutError:
            return 0
        finally:
            self._waiting -= 1
            if not waiter.future.done():
                waiter.future.cancel()  # lazily dropped from the heap by notify()

    def notify(self, budget: int = BACKFILL) -> None:
        """Room may have appeared: let the head waiter try again (and pass it on, `pass_on`)."""
        while self._heap:
            head = heapq.heappop(self._heap)
            if not head.future.done():
                head.future.set_result(budget)
                return

    def pass_on(self, priority: int, ticket: int, budget: int) -> None:
        """The waiter (`priority`, `ticket`) woke and found no room: wake the first one after
        it in line with what is left of the wake-up's budget (nothing when it is spent)."""
        if budget < 1:
            return
        after = (priority, ticket)
        nxt: _Waiter | None = None
        for w in self._heap:  # at most max_waiters, at most BACKFILL times a round
            if not w.future.done() and (w.priority, w.seq) > after:
                if nxt is None or (w.priority, w.seq) < (nxt.priority, nxt.seq):
                    nxt = w
        if nxt is not None:
            nxt.future.set_result(budget)  # its entry leaves the heap lazily (notify)
