"""Admission: a true concurrency cap and a bounded wait for decode room, in the order of the
fairness policy (policies/fairness.py, setting `admission.fairness`: `fifo`, the default, is
priority then FIFO; `vtc` shares the room among tenants by weight).

A request that finds no room (or no free concurrency slot) waits here until room may have
appeared — a local release, or a store refresh that shows other replicas' releases — or until
its deadline; a full queue refuses at once. A wake-up goes to the head waiter (the policy's
`pick`), so under `fifo` the order is FIFO within a priority (lower `priority` first, as vLLM
orders it), and carries a small budget: a waiter that still finds no room passes the wake-up on
to the next one in line (`pick` skipping those this wake-up tried), at most `BACKFILL` waiters a
round. So a large request at the head (4,000 tokens asked on full workers)
does not hold back the small ones behind it that fit, and a wake-up never sets off a thundering
herd of placement attempts.

The queue's places (`max_waiters`) are shared by the tenants' weights (policies/queue_shares.py,
issue 31): in a full queue a request of a tenant below its share takes the place of the newest
waiter of the tenant most over its share, which is refused (`QueueFull`, reason `queue_share`);
a tenant at or over its share is the one refused. With one tenant a full queue refuses as it
always did. The queue lives in this process: `max_waiters` and the shares are per router
replica, with the in-memory store and with Redis alike (nothing of it is in the store).

The order's own state is the cluster's under `vtc` (issue 33, `admission.fair_cluster`): every
charge goes to the `ledger` too (router/fair_share.py `ClusterShare`), which shares the counters,
this queue's waiting tenants (`waiting_tenants`) and the blocks its admitted requests hold with
the other replicas through the store once a sync period, and adopts the cluster's counters into
the policy; room a replica finds may be left for a more under-served tenant waiting on another
(router/request/reserve.py asks it before placing), and room is taken back by preemption
(router/request/fair_takeback.py). docs/design.md §5, "One fair share for the cluster".
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from policies.base import AdmissionCost, Charge, FairnessPolicy, Tenant, WaitingRequest
from policies.fairness import MIN_UNITS, FifoFairness
from policies.queue_shares import queue_share, queue_share_victim

__all__ = ["AdmissionSettings", "Admission", "Ledger", "QueueFull", "BACKFILL"]

# Waiters one wake-up may reach: the head, then the next ones in line while each finds no room.
BACKFILL = 8


class QueueFull(Exception):
    """The admission queue holds its maximum number of waiters. `reason` is the refusal's
    (router/request/reserve.py counts it by it): `queue_full` for a request refused at the
    door, `queue_share` for a waiter whose place went to a tenant below its share."""

    def __init__(self, message: str, reason: str = "queue_full") -> None:
        super().__init__(message)
        self.reason = reason


class _Places:
    """The places one tenant holds in the queue: its tickets counted against `max_waiters`."""

    __slots__ = ("tickets", "weight")

    def __init__(self, weight: float) -> None:
        self.tickets: set[int] = set()
        self.weight = weight


@dataclass(frozen=True, slots=True)
class AdmissionSettings:
    """The admission queue of this replica (the `doc` of each field: docs/configuration.md)."""

    mode: str = field(
        default="queue",
        metadata={
            "doc": "queue: wait for room until the deadline | instant: refuse at once | "
            "predictive: also admit on room forecast to free before the prefill ends "
            "(Mooncake), else wait like queue"
        },
    )
    max_inflight: int = field(
        default=4096, metadata={"doc": "requests being served at once by this replica"}
    )
    max_waiters: int = field(
        default=1024, metadata={"doc": "places in the queue, shared by the tenants' weights"}
    )
    max_wait_s: float = field(
        default=30.0,
        metadata={"doc": "never wait longer than this (nor past the TTFT deadline)"},
    )
    # The queue's order among tenants: loaded with its args when the app is built.
    fairness: str = field(
        default="fifo",
        metadata={
            "doc": "the queue's order among tenants (policies/fairness.py): fifo (priority, "
            "then arrival), vtc (weighted fair share of decode block-seconds and prefill "
            "tokens) or a dotted path"
        },
    )
    fairness_args: Mapping[str, Any] = field(
        default_factory=dict, metadata={"doc": "the fairness policy's arguments"}
    )
    # The cluster's fair share (issue 33, router/fair_share.py): with `vtc` only.
    fair_cluster: bool = field(
        default=True,
        metadata={
            "doc": "with vtc: one fair share for the cluster — the counters and who waits "
            "where shared through the store, room left for the most under-served waiting "
            "tenant whichever replica holds it; false: each replica its own"
        },
    )
    fair_sync_s: float = field(
        default=0.05,
        metadata={
            "doc": "how often a busy replica sends its charges and waiting tenants to the "
            "store and reads the cluster's back (one call; none on a request's path)"
        },
    )
    fair_handoff_grace_s: float = field(
        default=0.25,
        metadata={
            "doc": "room left for an under-served tenant waiting on another replica is "
            "taken by anyone after this long (and not left again for as long)"
        },
    )
    # 0.05: a starved request's first token is then due within about this, a sync period or
    # two (0.05 s each) and a prefill — inside issue 33's bound of 1.5 x solo + 0.15 s; at 0.1
    # the sync periods alone pushed it past (docs/benchmarks.md, "Fair share across replicas").
    fair_preempt_after_s: float = field(
        default=0.05,
        metadata={
            "doc": "with vtc: a tenant whose waiting requests fit within its share, waiting "
            "this long with no room, takes room back — streams of the tenant most over its "
            "share are preempted and resume (exact text, a pause); 0: never"
        },
    )
    fair_preempt_per_s: float = field(
        default=4.0,
        metadata={
            "doc": "streams one replica may preempt for the fair share a second (on average: "
            "a burst of two at once)"
        },
    )
    # A client that sends its next request as its answer ends comes back within milliseconds;
    # 0.05 s leaves room for a loaded machine, and at most that much of one answer's room
    # idle when the tenant does not come back (docs/benchmarks.md, "Fair share across
    # replicas").
    fair_keep_s: float = field(
        default=0.05,
        metadata={
            "doc": "with vtc: room a tenant within its share gives back is kept this long for "
            "its next request on the same replica; tenants over their share wait meanwhile "
            "(0: never)"
        },
    )

    def __post_init__(self) -> None:
        if self.mode not in ("queue", "instant", "predictive"):
            raise ValueError(
                f"admission.mode must be queue, instant or predictive, not {self.mode!r}"
            )
        if self.max_inflight < 1 or self.max_waiters < 0 or self.max_wait_s < 0:
            raise ValueError("admission limits must be positive")
        if not (self.fair_sync_s > 0 and self.fair_handoff_grace_s >= 0):
            raise ValueError("admission.fair_sync_s must be > 0, fair_handoff_grace_s >= 0")
        if self.fair_preempt_after_s < 0 or self.fair_preempt_per_s < 0:
            raise ValueError("admission.fair_preempt_after_s and fair_preempt_per_s must be >= 0")
        if self.fair_keep_s < 0:
            raise ValueError("admission.fair_keep_s must be >= 0")


class Ledger(Protocol):
    """Where the charges of the fairness policy go besides the policy (router/fair_share.py
    `ClusterShare`): `amount` in units / weight, `admission` False for a settlement."""

    def charged(self, priority: int, tenant: str, amount: float, admission: bool) -> None: ...

    def held(self, priority: int, tenant: str, blocks: int) -> None:
        """The tenant's admitted requests here hold `blocks` more (fewer, < 0)."""

    def start(self) -> None:
        """Something to share (a charge, a hold): the cluster must hear of it."""

    def waits(self, priority: int, tenant: str) -> None:
        """A request of `tenant` in class `priority` starts waiting here for decode room."""


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
        # The queue's places (`max_waiters`): the tickets parked (or woken, their task not yet
        # run) and their tenants', shared by weight when the queue is full (`_make_room`).
        self._placed: dict[int, str] = {}  # ticket -> its tenant
        self._places: dict[str, _Places] = {}  # tenant -> the places it holds
        self._seq = itertools.count()
        self._queued: dict[int, WaitingRequest] = {}  # in the policy: parked or awake
        # The queued that wait for decode room (not for a concurrency slot), since when.
        self._for_room: dict[int, float] = {}
        self._parked: dict[int, asyncio.Future[int]] = {}  # waiting for a wake-up
        self._awake: set[int] = set()  # woken, trying for room, still in the policy
        # What the wake-up round a woken request belongs to has tried (it, and those before it
        # on the chain): `pass_on` skips them, so the round moves on down the line.
        self._tried: dict[int, tuple[int, ...]] = {}
        # Woken by a pass-on, not yet run, when a fresh wake-up woke a waiter ahead of them in
        # the order: they go back to waiting without trying (`wait`), or the room the fresh
        # wake-up is for would go to whichever task the loop runs first — a chain's, woken
        # earlier, ahead of the head (fifo served 6 before 3 in CI that way).
        self._superseded: set[int] = set()
        # The cluster's fair share (router/fair_share.py), told every charge; None: this
        # replica's order is its own.
        self.ledger: Ledger | None = None
        # Room taken back for a waiting tenant here (router/request/fair_takeback.py): its
        # oldest waiter of that class is woken first until admitted, or until the loop-clock
        # time given. (class, tenant) -> until.
        self._earmarks: dict[tuple[int, str], float] = {}
        # Told each admission's tenant and how long it waited in the queue (0: it did not), from
        # its first wait, re-waits included (router/tenant_metrics.py: a histogram by tenant).
        self.wait_observer: Callable[[str, float], None] | None = None
        # Told of each request as it is admitted or first queued: the quiet loops wake
        # (router/loop_timing.py `LoopTiming.arrived`).
        self.on_arrival: Callable[[], None] | None = None
        # Told when a request starts waiting for decode room: the state refresher reads at its
        # busy cadence again (router/workers/refresher.py `room_wait`).
        self.on_room_wait: Callable[[], None] | None = None

    def __repr__(self) -> str:
        return (
            f"Admission(inflight={self.inflight}, waiting={self.waiting}, "
            f"queued={len(self._queued)}, {self.policy!r})"
        )

    @property
    def waiting(self) -> int:
        """Requests parked in the queue, waiting for a wake-up."""
        return len(self._placed)

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
        if self.on_arrival is not None:
            self.on_arrival()

    def leave(self) -> None:
        self.inflight -= 1
        self.notify()

    async def wait(
        self,
        priority: int,
        ticket: int,
        deadline: float,
        request: WaitingRequest | None = None,
        for_room: bool = True,
    ) -> int:
        """Wait for a wake-up: its budget (>= 1: how many waiters, this one included, it may
        still reach, see `pass_on`); 0 when the loop-time `deadline` passes first (the request
        then leaves the queue, as when it is cancelled). `request`: what the fairness policy
        orders by (its tenant and cost); None: the anonymous tenant's, at no cost. A full queue
        refuses it (`QueueFull`) unless its tenant is below its share of the queue: then the
        newest waiter of the tenant most over its share is refused instead (`_make_room`).
        `for_room`: it waits for decode room (or behind those that do), not for a concurrency
        slot: only such waiters are the cluster's (`waiting_tenants`)."""
        loop = asyncio.get_running_loop()
        known = self._queued.get(ticket, request)  # a re-wait keeps the request it queued
        tenant = known.tenant if known is not None else _ANONYMOUS
        if len(self._placed) >= self.settings.max_waiters:
            # Past its deadline it would take a place only to leave it: no one gives it up.
            self._make_room(tenant, evict=deadline > loop.time())
        if deadline <= loop.time():
            self.withdraw(ticket)
            return 0
        if ticket not in self._queued:
            if self.on_arrival is not None:
                self.on_arrival()
            if request is None:
                request = WaitingRequest(ticket, _ANONYMOUS, priority, _NO_COST)
            request = replace(request, since_s=self._clock())
            self._queued[ticket] = request
            self.policy.enqueue(request)
        if for_room:
            if ticket not in self._for_room:
                self._for_room[ticket] = self._clock()
                if self.on_room_wait is not None:
                    self.on_room_wait()
                if self.ledger is not None:
                    queued = self._queued[ticket]
                    self.ledger.waits(queued.priority, queued.tenant.name)
        else:
            self._for_room.pop(ticket, None)
        future: asyncio.Future[int] = loop.create_future()
        self._awake.discard(ticket)
        self._tried.pop(ticket, None)
        self._parked[ticket] = future
        self._place(ticket, tenant)
        try:
            async with asyncio.timeout_at(deadline):
                while True:
                    budget = await future
                    if ticket not in self._superseded:
                        return budget
                    # A fresh wake-up went to a waiter ahead of this one: back in line, untried
                    # (that wake-up's own pass-on reaches it if the room is not for the head).
                    self._superseded.discard(ticket)
                    self._awake.discard(ticket)
                    self._tried.pop(ticket, None)
                    future = loop.create_future()
                    self._parked[ticket] = future
        except TimeoutError:
            self._parked.pop(ticket, None)
            self.withdraw(ticket)
            return 0
        except asyncio.CancelledError:
            self._parked.pop(ticket, None)
            self.withdraw(ticket)
            raise
        finally:
            self._unplace(ticket)  # none left when its place was given away (`_evict`)
            if self._parked.get(ticket) is future:
                del self._parked[ticket]

    def _place(self, ticket: int, tenant: Tenant) -> None:
        self._placed[ticket] = tenant.name
        places = self._places.get(tenant.name)
        if places is None:
            places = self._places[tenant.name] = _Places(tenant.weight)
        places.weight = tenant.weight
        places.tickets.add(ticket)

    def _unplace(self, ticket: int) -> None:
        name = self._placed.pop(ticket, None)
        if name is None:
            return
        places = self._places[name]
        places.tickets.discard(ticket)
        if not places.tickets:
            del self._places[name]

    def _make_room(self, tenant: Tenant, evict: bool) -> None:
        """The queue is full: the newest waiter of the tenant most over its share gives its
        place to this request of `tenant` (policies/queue_shares.py), or this one is refused."""
        holders = [(name, len(p.tickets), p.weight) for name, p in self._places.items()]
        victim = queue_share_victim(tenant.name, tenant.weight, holders) if evict else None
        if victim is not None:
            ticket = self._newest_parked(victim)
            if ticket is not None:
                self._evict(ticket, victim, tenant, holders)
                return
        raise self._full(tenant, holders)

    def door(self, tenant: Tenant) -> QueueFull | None:
        """The refusal a request of `tenant` meets at the queue's door when it may take no one's
        place (past its deadline, `wait`): None while the queue has a place. A pure read, for
        the admission decision (router/request/admit.py)."""
        if len(self._placed) < self.settings.max_waiters:
            return None
        return self._full(tenant, [(n, len(p.tickets), p.weight) for n, p in self._places.items()])

    def _full(self, tenant: Tenant, holders: list[tuple[str, int, float]]) -> QueueFull:
        message = f"the admission queue is full ({self.settings.max_waiters} waiting)"
        if any(name != tenant.name for name, _, _ in holders):
            # Several tenants wait: say which share it is over (no other tenant is named).
            own = len(self._places[tenant.name].tickets) if tenant.name in self._places else 0
            share = queue_share(tenant.name, tenant.weight, holders, self.settings.max_waiters)
            message += (
                f"; queue share: tenant {tenant.name} holds {own} of its places, its share "
                f"by weight is {share:.1f}"
            )
        return QueueFull(message)

    def _newest_parked(self, tenant: str) -> int | None:
        """The tenant's newest waiter still parked (one woken is trying for room: left be)."""
        parked = self._parked
        return max(
            (t for t in self._places[tenant].tickets if t in parked and not parked[t].done()),
            default=None,
        )

    def _evict(
        self,
        ticket: int,
        victim: str,
        arriving: Tenant,
        holders: list[tuple[str, int, float]],
    ) -> None:
        """The waiter `ticket` of `victim` gives its place up, refused with the reason."""
        held = len(self._places[victim].tickets)
        if arriving.name not in self._places:
            holders = [*holders, (arriving.name, 1, arriving.weight)]
        share = queue_share(victim, self._places[victim].weight, holders, self.settings.max_waiters)
        future = self._parked.pop(ticket)
        self._unplace(ticket)  # now, so the arriving request has the place at once
        self.withdraw(ticket)
        future.set_exception(
            QueueFull(
                f"the admission queue is full ({self.settings.max_waiters} waiting) and tenant "
                f"{victim} held more than its queue share ({held} places, its share by weight "
                f"{share:.1f}): its newest request gave its place to a tenant below its share",
                reason="queue_share",
            )
        )

    def earmark(self, priority: int, tenant: str, for_s: float) -> None:
        """Streams were preempted for a request of `tenant` in class `priority` waiting here:
        the room they free is its, not the order's next (the take-back's rule, by each tenant's
        occupancy, chose it; the order's counters may not). Its oldest such waiter is woken
        first until one is admitted, for at most `for_s`."""
        self._earmarks[(priority, tenant)] = self._clock() + for_s

    def _next(self, now: float, skip: set[int]) -> WaitingRequest | None:
        """The next waiter to wake, not in `skip`: an earmarked line's first, else the order's."""
        chosen = self._earmarked(now, skip) if self._earmarks else None
        return chosen if chosen is not None else self.policy.pick(now, skip)

    def _earmarked(self, now: float, skip: set[int]) -> WaitingRequest | None:
        """The oldest parked waiter of an earmarked line, not in `skip` (expired marks go)."""
        marks = self._earmarks
        for line, until in list(marks.items()):
            if until < now:
                del marks[line]
        if not marks:
            return None
        for ticket, request in self._queued.items():  # in ticket order: oldest first
            if (request.priority, request.tenant.name) in marks and ticket not in skip:
                return request
        return None

    def withdraw(self, ticket: int) -> None:
        """The request stops waiting without being admitted (deadline, cancel, an error)."""
        if self._queued.pop(ticket, None) is not None:
            self.policy.withdraw(ticket)
        self._for_room.pop(ticket, None)
        self._awake.discard(ticket)
        self._tried.pop(ticket, None)
        self._superseded.discard(ticket)

    def admitted(self, request: WaitingRequest, blocks: int = 0) -> Charge:
        """The request got its room (`blocks`, waited or not): the policy charges its tenant
        the estimate; the charge is settled with the actual cost at its release (`settle`)."""
        queued = self._queued.pop(request.ticket, None)
        self._for_room.pop(request.ticket, None)
        self._awake.discard(request.ticket)
        self._tried.pop(request.ticket, None)
        if self.wait_observer is not None:
            waited = self._clock() - queued.since_s if queued is not None else 0.0
            self.wait_observer((queued or request).tenant.name, waited)
        admitted = queued or request
        if self._earmarks:
            self._earmarks.pop((admitted.priority, admitted.tenant.name), None)
        charge = self.policy.admit(admitted)
        ledger = self.ledger
        if ledger is None:
            return charge
        charge = replace(charge, blocks=blocks)
        ledger.held(charge.priority, charge.tenant, blocks)
        if charge.units:
            ledger.charged(charge.priority, charge.tenant, charge.units / charge.weight, True)
        return charge

    def settle(self, charge: Charge, actual: AdmissionCost) -> None:
        self.policy.settle(charge, actual)
        ledger = self.ledger
        if ledger is None:
            return
        ledger.held(charge.priority, charge.tenant, -charge.blocks)
        units = getattr(self.policy, "units", None)
        if charge.units and units is not None:
            # What `VTCFairness.settle` added to the counter, for the cluster's too.
            delta = (max(MIN_UNITS, units(actual)) - charge.units) / charge.weight
            ledger.charged(charge.priority, charge.tenant, delta, False)

    def waiting_tenants(self) -> dict[tuple[int, str], tuple[int, float]]:
        """{(class, tenant): (requests in the queue's order, the oldest's wait in s)}: what
        this replica registers as waiting in the cluster's fair share (router/fair_share.py).
        Only those waiting for decode room, and for how long they have: one held at this
        replica's concurrency cap would take no room handed to it, and preempting a stream for
        it (router/request/fair_takeback.py) would cut a stream for nothing."""
        now = self._clock()
        out: dict[tuple[int, str], tuple[int, float]] = {}
        queued = self._queued
        for ticket, since in self._for_room.items():
            r = queued.get(ticket)
            if r is None:
                continue
            slot = (r.priority, r.tenant.name)
            count, age = out.get(slot, (0, 0.0))
            out[slot] = (count + 1, max(age, now - since))
        return out

    def notify(self, budget: int = BACKFILL) -> None:
        """Room may have appeared: let the head waiter try again (and pass it on, `pass_on`)."""
        self._wake(budget, ())

    def pass_on(self, priority: int, ticket: int, budget: int) -> None:
        """The waiter `ticket` woke and found no room: wake the next one in line that this
        wake-up has not tried, with what is left of its budget (nothing when it is spent)."""
        tried = self._tried.pop(ticket, (ticket,))
        if budget < 1 or self._earmarked_for(ticket):
            # An earmarked line's waiter found the room not free yet (the preempted stream's
            # release is on its way): it is woken again when it lands. Passed on, the room
            # would go to whoever tries next, the very tenant it was taken from as likely as not.
            return
        self._wake(budget, tried)

    def _earmarked_for(self, ticket: int) -> bool:
        """Whether the waiter `ticket` is of a line whose earmark has not lapsed."""
        if not self._earmarks:
            return False
        request = self._queued.get(ticket)
        if request is None:
            return False
        until = self._earmarks.get((request.priority, request.tenant.name))
        return until is not None and until >= self._clock()

    def _wake(self, budget: int, tried: tuple[int, ...]) -> None:
        if not self._parked:
            return
        now = self._clock()
        if not tried and self.queue_first and self._awake:
            # A fresh wake-up while the head is already awake (trying, or about to): it will
            # see this room too, or pass it on. Waking the next as well would set the two
            # racing for one room, and the order's shares would blur into who asked first.
            head = self._next(now, set())
            if head is not None and head.ticket in self._awake:
                return
        skip = self._awake.union(tried)
        while (chosen := self._next(now, skip)) is not None:
            future = self._parked.pop(chosen.ticket, None)
            if future is None or future.done():
                skip.add(chosen.ticket)  # cancelled, its task not yet run: it withdraws itself
                continue
            if not tried:
                self._supersede_behind(chosen.ticket, now)
            self._awake.add(chosen.ticket)
            self._tried[chosen.ticket] = (*tried, chosen.ticket)
            future.set_result(budget)
            return

    def _supersede_behind(self, head: int, now: float) -> None:
        """A fresh wake-up goes to `head`: a waiter a pass-on woke that is behind it in the
        order and has not run yet must not try first (the loop runs it first: it was woken
        first). It waits again (`wait`); the head's own pass-on reaches it if need be."""
        for ticket in self._awake:
            if len(self._tried.get(ticket, ())) < 2 or ticket in self._superseded:
                continue  # a fresh wake-up's own head, not a pass-on's: it keeps its try
            first = self._next(now, self._awake - {ticket})
            if first is not None and first.ticket != ticket:  # it is behind the head
                self._superseded.add(ticket)
