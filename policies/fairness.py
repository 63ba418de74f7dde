"""Fair share among tenants: which waiting request gets the room that frees (issue 25).

Behind `policies.base.FairnessPolicy`. The policy keeps the admission queue's waiting requests
in its own queues and names the next one; the caller (router/admission.py, the simulator) wakes
it, and tells the policy when it is admitted (its estimated cost is charged), when it ends (the
difference to the actual cost is charged) or when it stops waiting.

**Cost.** What is scarce in a disaggregated cluster is decode room, held from the reservation
before the prefill to the release at the end, and prefill time. A request's cost is

    units = block_s_weight × decode block-seconds + prefill_token_weight × prefill tokens

(`AdmissionCost`). A request is charged at admission what it is expected to hold once placed
(`admission_charge`: its reserved blocks for the placement's predicted time to first token and
its expected answer at the predicted decode step — an unbiased guess, not an upper bound) and
settled with what it held at its release. `estimate_cost` is the bound used to weigh a request
before it is placed (the reserved quantile at the SLOs). To weigh both as
fractions of their pool's second, set prefill_token_weight / block_s_weight to the decode
pool's blocks over the prefill pool's tokens/s; the defaults (1, 1) suppose the two are equal.

**fifo**: today's order: priority class, then ticket (router/admission.py's heap order). Tenants
and costs are ignored.

**vtc**: within a priority class, weighted fair queuing over the units above after VTC (Sheng et
al., "Fairness in Serving Large Language Models", OSDI 2024). Each tenant has a virtual counter per
class; admission charges it units / weight (the estimate; `settle` adds actual − estimate); the
next request is the oldest ticket of the tenant with the least counter (ties: the older head
ticket). A tenant that starts to wait in a class is lifted to the floor: the least counter of the
tenants waiting there (none waiting: the counter of the last one to leave; never lower than an
earlier floor, below), so idle time is not banked: its share was lent to the busy tenants and is
only taken back from now on. A request admitted while nothing waits in its class (the router lets
it take free room at once) leaves too: the floor follows its charged counter (never down).
Otherwise the floor stays where the last *waiter* left it, and a tenant that starts to wait later
is credited with all the service taken meanwhile from room no one else asked for: live, a tenant
served alone for 40 s then lost every admission for ~13 s to a flooding newcomer
(docs/benchmarks.md, "Live flood"). The floor never goes down: a counter holds estimates until they
settle, and a settlement's refund can put a waiting tenant below the floor it was lifted to (a lone
admission's estimate set it); were the floor to follow it down, every tenant that starts to wait
afterwards would be lifted less than the ones that started before (1,000 simulated tenants: 630
never admitted in a minute instead of ~170; docs/benchmarks.md, "Tenants under a flood"). The
refunded tenant alone keeps its refund, at most what it was overcharged. Room is never left unused
while a request that fits waits, with one exception that fairness needs: room that the least-served
tenant's request did not fit is held for it (its own smaller requests may take it) rather than lent
to tenants more than `backfill_slack` units / weight ahead of it — as VTC stops at the least-served
client's request that does not fit. Without it a tenant with large requests loses every freed slot
to a flooding tenant's small ones (found in the simulator: docs/benchmarks.md, "Tenants under a
flood"). `backfill_slack` = inf is unbounded backfill. Served shares of backlogged tenants converge
to weight / Σ weights: two backlogged tenants' counters differ by at most about one request's units
/ weight.

**Priority classes and the starvation bound.** A more urgent class (lower number) goes first,
but every admission of a more urgent class while class c waits counts against c; after
`max_bypass` of them c is *starving*: it joins a line of starving classes, and while that line
is not empty only its first class's requests are offered (room is held for it: no backfill to
other classes). So between two admissions of a waiting class at most `max_bypass` + m − 1
admissions of more urgent classes happen, m the number of classes waiting; with two classes,
the lower one gets at least 1 admission in `max_bypass` + 1 under a permanent flood of the
higher. The bound counts admissions the policy ordered: the caller must pass every request
through the queue while anything waits (a request admitted around it still counts, but can
break the bound).

**Cost per decision.** Enqueue, pick and admit are O(log n) heap operations (n waiting
requests) plus O(m) over the classes waiting; stale heap entries are dropped lazily and the heaps
rebuilt when they double. `pick` with `skip` (backfill) sets aside O(len(skip)) entries
and puts them back. Measured: scripts/fairness_cost.py and docs/policies.md.
"""

from __future__ import annotations

import heapq
import math
from bisect import insort
from collections import deque
from collections.abc import Callable, Collection, Mapping
from typing import TypeVar

from policies.base import AdmissionCost, Charge, RequestInfo, WaitingRequest, blocks_for

__all__ = ["FifoFairness", "VTCFairness", "admission_charge", "estimate_cost", "MIN_UNITS"]

_Entry = TypeVar("_Entry", int, tuple[int, int])  # a ticket, or (priority, ticket)

# Every admission costs something, so a tenant of free requests still takes turns.
MIN_UNITS = 1e-9
# A lazily cleaned heap is rebuilt when it holds more than twice its live entries plus this.
_HEAP_SLACK = 64
# Idle tenants' counters are swept when a class remembers this many more than it has waiting.
_COUNTER_SLACK = 1024


def estimate_cost(request: RequestInfo, step_s: float, ttft_s: float = 0.0) -> AdmissionCost:
    """The cost to charge at admission: the blocks the placement reserves for the request
    (`blocks_for(prompt + reserve_output_tokens, block_size)`) for the time it is expected to
    hold them (`ttft_s` + one choice's reserved output × `step_s`, the decode step time the
    caller expects, e.g. its ITL SLO), and its prompt tokens to prefill."""
    blocks = blocks_for(request.prompt_tokens + request.reserve_output_tokens, request.block_size)
    held_s = ttft_s + request.reserve_choice_tokens * step_s
    return AdmissionCost(decode_block_s=blocks * held_s, prefill_tokens=request.prompt_tokens)


def admission_charge(
    request: RequestInfo, blocks: int, ttft_s: float, itl_s: float
) -> AdmissionCost:
    """What to charge a request that got its room, known once it is placed: the `blocks` its
    reservation holds, for the time its answer is *expected* to hold them — the placement's
    predicted time to first token, then one choice's expected answer (the estimate's median,
    else what is reserved) at the predicted decode step — and its prompt's tokens to prefill.

    An unbiased guess, not an upper bound: the settlement at release (`settle`) corrects it
    both ways. An upper bound charged at admission (the reserved quantile at the ITL SLO: 10 x
    and more what requests really hold) would sit on a busy tenant's counter until each of its
    requests ends, and a tenant that comes back would pay that excess before its next turn
    while the flooding one is refunded (found by the simulator: 76 % off the weight share
    against 0.6 % when charged like this)."""
    held_s = max(0.0, ttft_s) + request.expected_choice_tokens * max(0.0, itl_s)
    return AdmissionCost(decode_block_s=blocks * held_s, prefill_tokens=request.prompt_tokens)


def _first_live(
    heap: list[_Entry], live: Callable[[_Entry], bool], skip: Callable[[_Entry], bool]
) -> _Entry | None:
    """The least entry of `heap` that is live and not skipped. Dead entries are dropped on the
    way; skipped ones are put back, so the heap is unchanged but for its dead entries."""
    aside: list[_Entry] = []
    found: _Entry | None = None
    while heap:
        entry = heap[0]
        if not live(entry):
            heapq.heappop(heap)
        elif skip(entry):
            aside.append(heapq.heappop(heap))
        else:
            found = entry
            break
    for entry in aside:
        heapq.heappush(heap, entry)
    return found


# -- fifo: today's order ---------------------------------------------------------------------


class FifoFairness:
    """Priority class, then ticket: the order of router/admission.py. Tenants and costs are not
    looked at; admissions charge nothing."""

    name = "fifo"
    __slots__ = ("_waiting", "_heap")

    def __init__(self) -> None:
        self._waiting: dict[int, WaitingRequest] = {}
        self._heap: list[tuple[int, int]] = []  # (priority, ticket); dead ones dropped lazily

    def __repr__(self) -> str:
        return f"FifoFairness(waiting={len(self._waiting)})"

    def __len__(self) -> int:
        return len(self._waiting)

    def enqueue(self, request: WaitingRequest) -> None:
        if request.ticket in self._waiting:
            return
        self._waiting[request.ticket] = request
        heapq.heappush(self._heap, (request.priority, request.ticket))
        if len(self._heap) > 2 * len(self._waiting) + _HEAP_SLACK:
            self._heap = [(r.priority, r.ticket) for r in self._waiting.values()]
            heapq.heapify(self._heap)

    def withdraw(self, ticket: int) -> None:
        self._waiting.pop(ticket, None)

    def pick(self, now_s: float, skip: Collection[int] = ()) -> WaitingRequest | None:
        entry = _first_live(self._heap, self._is_live, lambda e: e[1] in skip)
        return None if entry is None else self._waiting[entry[1]]

    def admit(self, request: WaitingRequest) -> Charge:
        self._waiting.pop(request.ticket, None)
        return Charge(request.tenant.name, request.priority, 0.0, request.tenant.weight)

    def settle(self, charge: Charge, actual: AdmissionCost) -> None:
        return None

    def _is_live(self, entry: tuple[int, int]) -> bool:
        request = self._waiting.get(entry[1])
        return request is not None and request.priority == entry[0]


# -- vtc: weighted fair queuing within a class, classes with a starvation bound ----------------


class _TenantLine:
    """One tenant's waiting tickets in one class, oldest first."""

    __slots__ = ("live", "heap", "entry")

    def __init__(self) -> None:
        self.live: set[int] = set()
        self.heap: list[int] = []  # tickets; ones no longer live are dropped lazily
        # Its entry in the class's order heap; an entry that is not this one is stale.
        self.entry: _OrderEntry | None = None

    def add(self, ticket: int) -> None:
        self.live.add(ticket)
        heapq.heappush(self.heap, ticket)
        if len(self.heap) > 2 * len(self.live) + _HEAP_SLACK:
            self.heap = sorted(self.live)  # a sorted list is a heap

    def head(self, skip: Collection[int] = ()) -> int | None:
        """Its oldest live ticket not in `skip`."""
        return _first_live(self.heap, self.live.__contains__, skip.__contains__)


# A tenant's place in its class's order: (counter, 0 while it sits where it was lifted to else 1,
# its head ticket, its name).
_OrderEntry = tuple[float, int, int, str]


class _ClassQueue:
    """The waiting requests of one priority class and its tenants' virtual counters (VTC).

    Ties: a tenant lifted to the floor as it starts to wait has exactly the counter of the
    least-served tenant waiting, which has waited longer, so by ticket age alone the newcomer
    would lose every tie — one more release to wait for on every request of a tenant that comes
    and goes while another floods (and a room taken back for it handed to the flooder first).
    Its counter is credited service it never got; it goes first among equal counters until it
    is charged (`lifted`)."""

    __slots__ = ("lines", "counters", "order", "floor", "sweep_above", "lifted")

    def __init__(self) -> None:
        self.lines: dict[str, _TenantLine] = {}  # tenants with something waiting here
        # Every tenant's counter here, in units / weight. Idle tenants at or below the floor are
        # forgotten now and then: they would be lifted to it anyway.
        self.counters: dict[str, float] = {}
        self.order: list[_OrderEntry] = []  # lazy: stale entries dropped as met
        # Where a tenant that starts to wait is lifted to: the least counter of the tenants
        # waiting when last looked at, when none wait that of the last one to leave (VTC);
        # never lower than it was (`_current_floor`).
        self.floor = 0.0
        self.sweep_above = _COUNTER_SLACK  # counters remembered before idle ones are swept
        self.lifted: dict[str, float] = {}  # waiting tenants at the counter they were lifted to

    def __bool__(self) -> bool:
        return bool(self.lines)

    def add(self, ticket: int, tenant: str) -> None:
        line = self.lines.get(tenant)
        if line is None:
            self._lift(tenant)
            line = self.lines[tenant] = _TenantLine()
        old_head = line.entry[2] if line.entry is not None else None
        line.add(ticket)
        if old_head is None or ticket < old_head:
            self._reorder(tenant, line)

    def remove(self, ticket: int, tenant: str) -> None:
        line = self.lines.get(tenant)
        if line is None or ticket not in line.live:
            return
        line.live.discard(ticket)
        if not line.live:
            del self.lines[tenant]
            self.lifted.pop(tenant, None)
            if not self.lines:
                self.floor = max(self.floor, self.counters[tenant])
            if len(self.counters) > self.sweep_above:
                self._forget_idle()
        elif line.entry is not None and line.entry[2] == ticket:
            self._reorder(tenant, line)

    def charge(self, tenant: str, amount: float) -> None:
        """Add `amount` (units / weight) to the tenant's counter; one not waiting here is lifted
        first, as if it had started to wait (a request admitted without waiting). Admitted
        while nothing waits here, it is also the last to leave: the floor follows it."""
        if tenant not in self.lines:
            self._lift(tenant)
            self.lifted.pop(tenant, None)  # kept for waiting tenants only
        self.correct(tenant, amount)
        if not self.lines:
            # Else the floor stays where the last *waiter* left it, and a tenant that starts to
            # wait later is lifted only that far: credited with all the service others took
            # meanwhile from room no one else asked for, which it then takes back from them.
            self.floor = max(self.floor, self.counters[tenant])

    def correct(self, tenant: str, amount: float) -> None:
        """Add `amount` (possibly < 0) to the counter as it is: a settlement, no lift."""
        self.counters[tenant] = self.counters.get(tenant, self.floor) + amount
        line = self.lines.get(tenant)
        if line is not None:
            self._reorder(tenant, line)

    def best(self, skip: Collection[int], slack: float = math.inf) -> int | None:
        """The ticket that goes next: the least-served tenant's oldest, `skip` left out, from
        tenants whose counter is within `slack` of the least one's (backfill bound)."""
        order = self.order
        while order and not self._current(order[0]):
            heapq.heappop(order)
        if not order:
            return None
        if not skip:
            return order[0][2]
        return self._best_skipping(skip, order[0][0] + slack)

    def _best_skipping(self, skip: Collection[int], ceiling: float) -> int | None:
        # Entries come out in (counter, head) order; a tenant whose head is skipped offers its
        # next ticket, which sorts after its entry, so an entry is a lower bound and the search
        # stops at the first entry above the best found, or above `ceiling`.
        order = self.order
        taken: list[_OrderEntry] = []
        best: tuple[float, int, int] | None = None
        while order:
            entry = heapq.heappop(order)
            if not self._current(entry):
                continue
            taken.append(entry)
            if entry[0] > ceiling or (best is not None and entry[:3] > best):
                break
            ticket = self.lines[entry[3]].head(skip)
            if ticket is not None and (best is None or (entry[0], entry[1], ticket) < best):
                best = (entry[0], entry[1], ticket)
        for entry in taken:
            heapq.heappush(order, entry)
        return None if best is None else best[2]

    def _lift(self, tenant: str) -> None:
        floor = self._current_floor()
        counter = self.counters.get(tenant)
        if counter is None or counter < floor:  # credited service it did not get
            self.lifted[tenant] = floor
        self.counters[tenant] = floor if counter is None else max(counter, floor)

    def _current_floor(self) -> float:
        order = self.order
        while order and not self._current(order[0]):
            heapq.heappop(order)
        # Never down: only a refund (`correct` < 0) puts a waiter below where the floor was,
        # and one tenant's refund is not a lift lost to every tenant that starts to wait after
        # it (1,000 simulated tenants: 2,200 units, a minute's turns, between those lifted
        # before a refund and those lifted after; docs/benchmarks.md, "Tenants under a flood").
        if order and order[0][0] > self.floor:
            self.floor = order[0][0]
        return self.floor

    def _current(self, entry: _OrderEntry) -> bool:
        line = self.lines.get(entry[3])
        return line is not None and line.entry is entry

    def _reorder(self, tenant: str, line: _TenantLine) -> None:
        """The tenant's counter or head changed: a new entry; the old one is now stale."""
        head = line.head()
        assert head is not None  # a line exists only while it has a live ticket
        counter = self.counters[tenant]
        rank = 0 if self.lifted.get(tenant) == counter else 1
        line.entry = (counter, rank, head, tenant)
        heapq.heappush(self.order, line.entry)
        if len(self.order) > 2 * len(self.lines) + _HEAP_SLACK:
            self.order = [ln.entry for ln in self.lines.values() if ln.entry is not None]
            heapq.heapify(self.order)

    def _forget_idle(self) -> None:
        """Drop idle tenants at or below the floor (lossless: they would be lifted to it). The
        next sweep waits until the table has doubled, so sweeps cost O(1) a request."""
        floor = self._current_floor()
        self.counters = {t: c for t, c in self.counters.items() if t in self.lines or c > floor}
        self.sweep_above = 2 * len(self.counters) + _COUNTER_SLACK


class VTCFairness:
    """Weighted fair queuing over decode block-seconds and prefill tokens (VTC) within a
    priority class; a more urgent class first, with the starvation bound of the module's
    docstring (`max_bypass`)."""

    name = "vtc"
    __slots__ = (
        "block_s_weight",
        "prefill_token_weight",
        "max_bypass",
        "backfill_slack",
        "_waiting",
        "_queues",
        "_live_classes",
        "_bypassed",
        "_starving",
    )

    def __init__(
        self,
        block_s_weight: float = 1.0,
        prefill_token_weight: float = 1.0,
        max_bypass: int = 16,
        backfill_slack: float = 0.0,
    ) -> None:
        if not (block_s_weight >= 0 and prefill_token_weight >= 0):
            raise ValueError(
                "block_s_weight and prefill_token_weight must be >= 0, "
                f"got {block_s_weight} and {prefill_token_weight}"
            )
        if block_s_weight + prefill_token_weight <= 0:
            raise ValueError("block_s_weight and prefill_token_weight cannot both be 0")
        if not isinstance(max_bypass, int) or max_bypass < 1:
            raise ValueError(f"max_bypass must be an int >= 1, got {max_bypass!r}")
        self.block_s_weight = float(block_s_weight)
        self.prefill_token_weight = float(prefill_token_weight)
        if not backfill_slack >= 0:
            raise ValueError(f"backfill_slack must be >= 0 (units / weight), got {backfill_slack}")
        self.max_bypass = max_bypass
        self.backfill_slack = float(backfill_slack)
        self._waiting: dict[int, WaitingRequest] = {}
        self._queues: dict[int, _ClassQueue] = {}  # every class seen (counters outlive waits)
        self._live_classes: list[int] = []  # classes with something waiting, most urgent first
        self._bypassed: dict[int, int] = {}  # live class -> more urgent admissions since its last
        self._starving: deque[int] = deque()  # classes bypassed max_bypass times, in that order

    def __repr__(self) -> str:
        return (
            f"VTCFairness(waiting={len(self._waiting)}, classes={self._live_classes}, "
            f"starving={list(self._starving)}, max_bypass={self.max_bypass}, "
            f"backfill_slack={self.backfill_slack})"
        )

    def __len__(self) -> int:
        return len(self._waiting)

    def units(self, cost: AdmissionCost) -> float:
        """The cost as one number (the module's docstring)."""
        return (
            self.block_s_weight * cost.decode_block_s
            + self.prefill_token_weight * cost.prefill_tokens
        )

    def counter(self, tenant: str, priority: int = 0) -> float:
        """The tenant's virtual counter in a class (for metrics, /admin and tests)."""
        queue = self._queues.get(priority)
        return 0.0 if queue is None else queue.counters.get(tenant, queue.floor)

    def adopt(self, counters: Mapping[tuple[int, str], float], floors: Mapping[int, float]) -> None:
        """The cluster's counters, shared through the store (router/fair_share.py, issue 33):
        each (class, tenant) named takes its value there (the caller adds what it charged
        since), each class's floor rises to the cluster's (never down)."""
        for priority, floor in floors.items():
            queue = self._queue(priority)
            queue.floor = max(queue.floor, floor)
        for (priority, tenant), value in counters.items():
            queue = self._queue(priority)
            queue.counters[tenant] = value
            if tenant in queue.lifted and value <= queue.floor:
                queue.lifted[tenant] = value  # lifted in the store: still uncharged credit
            line = queue.lines.get(tenant)
            if line is not None:
                queue._reorder(tenant, line)

    def enqueue(self, request: WaitingRequest) -> None:
        if request.ticket in self._waiting:
            return
        self._waiting[request.ticket] = request
        queue = self._queue(request.priority)
        if not queue:
            insort(self._live_classes, request.priority)
            self._bypassed[request.priority] = 0
        queue.add(request.ticket, request.tenant.name)

    def withdraw(self, ticket: int) -> None:
        request = self._waiting.pop(ticket, None)
        if request is not None:
            self._leave(request)

    def pick(self, now_s: float, skip: Collection[int] = ()) -> WaitingRequest | None:
        # A starving class is offered alone: the room is held for it, not backfilled. Within a
        # class, room the least-served tenant's request did not fit goes only to tenants
        # within `backfill_slack` of it: held for it otherwise (its share is not lent to the
        # tenant it is behind; VTC stops at the least-served client's request that does not
        # fit). Nor to a less urgent class (the more urgent one is admitted first), unless
        # backfill is unbounded (`backfill_slack` = inf: every waiter may take what fits).
        classes = (self._starving[0],) if self._starving else self._live_classes
        for priority in classes:
            ticket = self._queues[priority].best(skip, self.backfill_slack)
            if ticket is not None:
                return self._waiting[ticket]
            if skip and self._queues[priority] and self.backfill_slack != math.inf:
                return None  # this class's least-served tenant waits for more room
        return None

    def admit(self, request: WaitingRequest) -> Charge:
        waited = self._waiting.pop(request.ticket, None)
        # Charged the caller's cost (its latest estimate: `admission_charge` once placed), in
        # the class and tenant it was queued under, so it leaves the queue it is in.
        units = max(MIN_UNITS, self.units(request.cost))
        request = waited or request
        tenant = request.tenant
        # Charged before it leaves: a tenant that stops waiting leaves its charged counter
        # as the class's floor (VTC's "last to leave").
        self._queue(request.priority).charge(tenant.name, units / tenant.weight)
        if waited is not None:
            self._leave(waited)
        self._count_bypass(request.priority)
        return Charge(tenant.name, request.priority, units, tenant.weight)

    def settle(self, charge: Charge, actual: AdmissionCost) -> None:
        delta = max(MIN_UNITS, self.units(actual)) - charge.units
        self._queue(charge.priority).correct(charge.tenant, delta / charge.weight)

    def _queue(self, priority: int) -> _ClassQueue:
        queue = self._queues.get(priority)
        if queue is None:
            queue = self._queues[priority] = _ClassQueue()
        return queue

    def _leave(self, request: WaitingRequest) -> None:
        queue = self._queues[request.priority]
        queue.remove(request.ticket, request.tenant.name)
        if not queue:
            self._live_classes.remove(request.priority)
            del self._bypassed[request.priority]
            if request.priority in self._starving:
                self._starving.remove(request.priority)

    def _count_bypass(self, admitted: int) -> None:
        """An admission of class `admitted`: it is served, every less urgent one passed by."""
        for priority in self._live_classes:
            if priority < admitted:
                continue
            if priority == admitted:
                self._bypassed[priority] = 0
                if priority in self._starving:
                    self._starving.remove(priority)
                continue
            self._bypassed[priority] += 1
            if self._bypassed[priority] == self.max_bypass:
                self._starving.append(priority)
