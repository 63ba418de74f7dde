"""One fair share for the cluster (issue 33): the two rules that act on the fairness state every
router replica shares through the store (state/fair_shares.py), pure and deterministic, so the
live router (router/fair_share.py, router/request/fair_takeback.py) and a simulator run the
same code.

Both read the same facts: every replica's waiting tenants (`ClusterWaiter`: its class, its
virtual counter as the store last had it, how many requests and how long the oldest has waited),
and the counters (VTC units served / weight; policies/fairness.py).

**Shares of the pool.** A tenant's share of the decode pool is its capacity times the tenant's
weight over the weights of the tenants that hold or wait anywhere (`Occupancy`); VTC's counters
say who was served more over time, the occupancy who holds more now. Both matter: a tenant that
starts to wait is lifted to the floor (its counter then equals the least-served waiter's), so
only the occupancy tells that a newcomer holds nothing while a flooding tenant holds the pool.

**Hand-off** (`handoff_to`). Room that frees on a decode worker goes to the cluster's most
under-served waiting tenant, whichever replica holds its request. A replica about to place a
request of tenant t in class c first asks whether a waiter on *another* replica should have it:
one of a more urgent class; one of class c whose counter is lower than t's by more than `slack`
(one of t's requests' units / weight: two backlogged tenants' counters differ by about that),
unless that tenant holds more than its share of the pool while t, with the room, stays within
its own (the counters and the occupancy disagree: the occupancy decides, or the two replicas
each leave the room for the other);
or, while t holds more than its share of the pool, one of a tenant that would still be within
its own share with the room (`need`: the blocks t's request asks, standing for the waiter's).
Then it leaves the room (the request waits as if there were none) for that tenant's replica,
whose refresh sees it; the answer names the first such waiter by (class, counter, longest wait,
name). The caller bounds how long room is left (router/fair_share.py: at most the grace, then
anyone takes it, and not again before another grace has passed): the cluster stays
work-conserving.

**Taking room back** (`take_back`). A tenant whose waiting requests, all admitted, would keep it
within its share of the pool (`_owed`: the blocks it holds plus, for each of its waiting
requests, one stream of the mean size the replica relays) has waited longer than `after_s` (a
setting) and still has no room: the replica preempts streams it relays of the tenant most over
its share (the most blocks held per weight, among tenants holding more than their share) —
newest dispatch first (the least work to redo), never a stream already preempted `bound`
times, at most `budget` of them (the caller's rate limit), at most one per request the owed
tenant has waiting, and only while the victim is still over its share (it is never taken below
it), and never from a class more urgent than the owed tenant's. The stream resumes with its
exact text (issue 31); its continuation waits in the queue like any request of its tenant. Two
tenants each within their shares never take from each other, so there is no back and forth: a
preemption moves room from a tenant over its share to one under it.

Why a tenant's demand and not its holdings decide: a tenant that asks for more than its share
is backlogged, and the order (vtc's counters) already gives it its share over time; taking
room for it whenever it holds little works against the order — it holds little exactly when
the counters say it was served more before. In the simulator's 10 backlogged tenants the
holdings rule (a tenant holding under half its share took back) put the worst share 19-31 %
off the weights with ~200-300 take-backs a minute; by demand it is 2.8 % with 14, and a flooded
victim that asks no more than its share is still served first (docs/benchmarks.md).

**Room kept for its tenant** (`keeps_room`, `yields_kept_room`). Room a tenant within its
share gives back (an answer ended) is kept for that tenant's next request for a short time (the
caller's `admission.fair_keep_s`), against requests of tenants over their share: a client that
sends its next request as its answer ends finds it, instead of waiting for a take-back.

**A more urgent class takes room back** (`take_back_for_class`), before the share's rule and
within the same budget. A request of class c (policies/priority_classes.py: interactive -1,
default 0, batch 1; lower is more urgent) that has waited longer than `after_s` with no room
preempts a stream of the *least urgent* class present that is less urgent than c — newest
dispatch first, never a stream already preempted `bound` times, at most one per waiting
request (the most urgent waiters first, then the longest waiting), whatever the tenants'
shares: a class is the operator's word (llm-d's flow control and SGLang's gateway order the
same way: priority bands, eviction lowest priority and newest dispatch first). A request a
stream was taken for counts as served for the share's rule in the same decision (still at
most one stream per waiting request). `plan_take_back` runs both rules.

**Starvation bound.** No class is starved forever. Admissions: a waiting class gets one
admission in at most `max_bypass` + m - 1 of more urgent ones (policies/fairness.py, m the
classes waiting). Preemptions: a stream is taken at most `bound` (`preemption.max_per_stream`)
times in its request's life, by either rule (or a growth's, policies/preemption.py), then it is
never a candidate again; its continuation waits like any request of its class, under the
admission bound. So a batch answer always completes: it loses at most `bound` decodes, each
resumed with its exact text, then runs to its end.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass, field, replace

from policies.preemption import StreamFacts

# Why a stream is taken back (the router's preemptions_total{reason}, the simulator's counts):
# for the cluster's fair share, or for a more urgent class. Such a stream had not outgrown its
# estimate (its continuation reserves the rest of it: router/request/reserve.py).
FAIR_SHARE = "fair_share"
PRIORITY = "priority"

__all__ = [
    "TAKE_BACK_BURST",
    "FAIR_SHARE",
    "PRIORITY",
    "ClusterWaiter",
    "Occupancy",
    "TakeBack",
    "handoff_to",
    "keeps_room",
    "under_share",
    "yields_kept_room",
    "plan_take_back",
    "take_back",
    "take_back_for_class",
]

# Take-backs one replica may make at once, on top of its rate (`admission.fair_preempt_per_s`).
# One was too few: two waiters on two replicas that start to wait together, served by one
# replica's streams, had the second wait out a whole token (0.25 s at 4 a second) — issue 33's
# spread row's tail. The rate bounds the average, this the burst.
TAKE_BACK_BURST = 2


@dataclass(frozen=True, slots=True)
class ClusterWaiter:
    """One replica's waiting requests of one tenant in one class, as the store has them."""

    replica: str
    priority: int
    tenant: str
    counter: float  # the tenant's virtual counter in its class
    count: int  # its requests waiting there
    waited_s: float  # how long the oldest has waited


@dataclass(frozen=True, slots=True)
class Occupancy:
    """Who holds the decode pool now, over every replica: its `capacity` in blocks, the blocks
    each tenant's admitted requests hold (`held`), the tenants' weights (absent: 1) and the
    tenants that hold or wait (`active`). A tenant's share is the capacity times its weight over
    the active tenants' weights (itself counted)."""

    capacity: int
    held: Mapping[str, int]
    weights: Mapping[str, float]
    active: frozenset[str]
    # The active tenants' weights summed, on first use: a snapshot is asked every tenant's
    # share, and summing them each time made a take-back O(tenants²) (1,000 simulated tenants:
    # two thirds of the run). The same sum (in some order of the set, as before: the order
    # of a set of names varies with the hash seed, an exact sum for whole weights).
    _active_weight: float | None = field(default=None, init=False, repr=False, compare=False)

    def weight(self, tenant: str) -> float:
        return self.weights.get(tenant, 1.0)

    def share(self, tenant: str) -> float:
        total = self._active_weight
        if total is None:
            total = sum(self.weight(t) for t in self.active)
            object.__setattr__(self, "_active_weight", total)  # frozen: a cache, not state
        if tenant not in self.active:
            total += self.weight(tenant)
        return self.capacity * self.weight(tenant) / total

    def load(self, tenant: str) -> float:
        """Blocks held per weight: the order of "more over its share"."""
        return self.held.get(tenant, 0) / self.weight(tenant)

    def under(self, tenant: str) -> bool:
        return self.held.get(tenant, 0) < self.share(tenant)


def handoff_to(
    waiters: Iterable[ClusterWaiter],
    replica: str,
    tenant: str,
    priority: int,
    counter: float,
    slack: float = 0.0,
    occupancy: Occupancy | None = None,
    need: int = 0,
) -> ClusterWaiter | None:
    """The waiter on another replica that room this replica found for `tenant` (class
    `priority`, at `counter`, asking `need` blocks) should be left for; None: take it (the
    module's rule)."""
    over = occupancy is not None and occupancy.held.get(tenant, 0) > occupancy.share(tenant)
    within = occupancy is not None and occupancy.held.get(tenant, 0) + need <= occupancy.share(
        tenant
    )
    best: ClusterWaiter | None = None
    for w in waiters:
        if w.replica == replica or w.tenant == tenant or w.priority > priority:
            continue
        more_urgent = w.priority < priority
        served_less = more_urgent or w.counter < counter - slack
        if (
            served_less
            and not more_urgent
            and within
            and occupancy is not None
            and occupancy.held.get(w.tenant, 0) > occupancy.share(w.tenant)
        ):
            # The counters say w was served less, but w holds more than its share now and this
            # tenant, with the room, stays within its own: the room is this tenant's. Without
            # it a flooded victim and its flooder, on two replicas, each left the room for the
            # other (the counters one way, the occupancy the other) until the grace ran out:
            # the victim's TTFT p99 0.9 s in issue 33's split rows.
            served_less = False
        held_less = (
            over
            and occupancy is not None
            and occupancy.held.get(w.tenant, 0) + need <= occupancy.share(w.tenant)
        )
        if not (served_less or held_less):
            continue
        if best is None or _before(w, best):
            best = w
    return best


def keeps_room(occupancy: Occupancy, tenant: str) -> bool:
    """Room `tenant` gives back is kept for its own next request (router/fair_share.py
    `ClusterShare.held`) while it holds no more than its share, that room counted: it asks no
    more than its share, and a client that sends its next request as its answer ends would
    otherwise find the room taken by a flood's waiter and wait for a take-back."""
    return occupancy.held.get(tenant, 0) <= occupancy.share(tenant)


def under_share(occupancy: Occupancy, tenant: str) -> bool:
    """`tenant` holds less than its share of the pool: a wait of its may be owed room (the
    take-back's rule decides), so it is worth a sync when it reaches the bound
    (router/fair_share.py `ClusterShare.waits`). A tenant at or over its share is served by
    the order; a sync of its own for each of its new waits only moved the shares (simulator,
    10 backlogged tenants: 3.0 → 5.5 % off the weights)."""
    return occupancy.held.get(tenant, 0) < occupancy.share(tenant)


def yields_kept_room(occupancy: Occupancy, tenant: str) -> bool:
    """A request of `tenant` leaves room kept for another tenant alone: it holds more than its
    share (a tenant within its own may take it)."""
    return occupancy.held.get(tenant, 0) > occupancy.share(tenant)


def _before(a: ClusterWaiter, b: ClusterWaiter) -> bool:
    return (a.priority, a.counter, -a.waited_s, a.tenant, a.replica) < (
        b.priority,
        b.counter,
        -b.waited_s,
        b.tenant,
        b.replica,
    )


def take_back(
    streams: Iterable[StreamFacts],
    waiters: Iterable[ClusterWaiter],
    occupancy: Occupancy,
    after_s: float,
    bound: int,
    budget: int,
) -> tuple[str, ...]:
    """The streams to preempt so that a tenant owed room gets it (the module's rule). Empty:
    none."""
    chosen = _take_back(streams, waiters, occupancy, after_s, bound, budget)
    return tuple(stream for stream, _ in chosen)


def _owed(occupancy: Occupancy, waiters: Sequence[ClusterWaiter], mean_blocks: float) -> set[str]:
    """The tenants a take-back may serve (the module's rule): each one's held blocks plus its
    waiting requests in every line, each as a stream of `mean_blocks`, within its share."""
    waiting: Counter[str] = Counter()
    for w in waiters:
        waiting[w.tenant] += w.count
    return {
        tenant
        for tenant, count in waiting.items()
        if count > 0
        and occupancy.held.get(tenant, 0) + count * mean_blocks <= occupancy.share(tenant)
    }


def _take_back(
    streams: Iterable[StreamFacts],
    waiters: Iterable[ClusterWaiter],
    occupancy: Occupancy,
    after_s: float,
    bound: int,
    budget: int,
) -> list[tuple[str, ClusterWaiter]]:
    """`take_back`'s streams, each with the waiter line whose request it serves (the owed
    tenant's lines, longest wait first)."""
    if budget < 1:
        return []
    streams, waiters = tuple(streams), tuple(waiters)
    if not streams:
        return []
    owed = _owed(occupancy, waiters, sum(s.blocks for s in streams) / len(streams))
    owed_lines = sorted(
        (w for w in waiters if w.waited_s >= after_s and w.count > 0 and w.tenant in owed),
        key=lambda w: (occupancy.load(w.tenant), w.counter, -w.waited_s, w.tenant, w.replica),
    )
    if not owed_lines:
        return []
    neediest = owed_lines[0]
    wanted = min(budget, sum(w.count for w in owed_lines if w.tenant == neediest.tenant))
    candidates = [
        s
        for s in streams
        if s.preempted < bound
        and s.tenant != neediest.tenant
        and s.priority >= neediest.priority  # never from a more urgent class
        and occupancy.held.get(s.tenant, 0) > occupancy.share(s.tenant)
    ]
    if not candidates:
        return []
    victim = max({s.tenant for s in candidates}, key=lambda t: (occupancy.load(t), t))
    newest = sorted(
        (s for s in candidates if s.tenant == victim),
        key=lambda s: (s.dispatched, s.stream_id),
        reverse=True,
    )
    over = occupancy.held.get(victim, 0) - occupancy.share(victim)
    under = occupancy.share(neediest.tenant) - occupancy.held.get(neediest.tenant, 0)
    units = [w for w in owed_lines if w.tenant == neediest.tenant for _ in range(w.count)]
    chosen: list[tuple[str, ClusterWaiter]] = []
    for stream in newest:
        if len(chosen) >= wanted:
            break
        # A move that overshoots neither side: the victim keeps at least its share and the
        # owed tenant gets at most its own. Without it two backlogged tenants took streams
        # from each other on every fluctuation around their shares (in the simulator, weights
        # 1:3: the shares 40 % off, the weight-1 tenant preempted 414 times in a minute).
        if stream.blocks > over or stream.blocks > under:
            continue  # an older, smaller stream may fit
        chosen.append((stream.stream_id, units[len(chosen)]))
        over -= stream.blocks
        under -= stream.blocks
    return chosen


def take_back_for_class(
    streams: Iterable[StreamFacts],
    waiters: Iterable[ClusterWaiter],
    after_s: float,
    bound: int,
    budget: int,
) -> tuple[tuple[str, ...], tuple[ClusterWaiter, ...]]:
    """The streams to preempt for requests of a more urgent class that waited `after_s` with no
    room (the module's rule), and the waiters with the requests served by them taken off their
    counts (for the share's rule in the same decision)."""
    chosen, left = _take_back_for_class(streams, waiters, after_s, bound, budget)
    return tuple(stream for stream, _ in chosen), left


def _take_back_for_class(
    streams: Iterable[StreamFacts],
    waiters: Iterable[ClusterWaiter],
    after_s: float,
    bound: int,
    budget: int,
) -> tuple[list[tuple[str, ClusterWaiter]], tuple[ClusterWaiter, ...]]:
    """`take_back_for_class`, each stream with the waiter line whose request it serves."""
    lines = tuple(waiters)
    if budget < 1:
        return [], lines
    starved = sorted(
        (i for i, w in enumerate(lines) if w.waited_s >= after_s and w.count > 0),
        key=lambda i: _urgency(lines[i]),
    )
    if not starved:
        return [], lines
    # Least urgent class first, newest dispatch first in it: a waiter may take any stream of
    # a class below its own, so the streams it may take are a prefix of this order.
    victims = sorted(
        (s for s in streams if s.preempted < bound and s.priority > lines[starved[0]].priority),
        key=lambda s: (s.priority, s.dispatched, s.stream_id),
        reverse=True,
    )
    most = min(budget, len(victims))
    chosen: list[tuple[str, ClusterWaiter]] = []
    served = [0] * len(lines)
    for i in starved:
        for _ in range(lines[i].count):
            if len(chosen) >= most or victims[len(chosen)].priority <= lines[i].priority:
                break  # the budget is spent, or every stream left is as urgent as this waiter
            chosen.append((victims[len(chosen)].stream_id, lines[i]))
            served[i] += 1
    left = tuple(
        replace(w, count=w.count - n) if n else w for w, n in zip(lines, served, strict=True)
    )
    return chosen, left


def _urgency(w: ClusterWaiter) -> tuple[int, float, float, str, str]:
    """The order the class's rule serves waiters in: most urgent class, longest wait first."""
    return (w.priority, -w.waited_s, w.counter, w.tenant, w.replica)


@dataclass(frozen=True, slots=True)
class TakeBack:
    """The streams to preempt, by why: for a more urgent class (`for_class`, counted as
    reason "priority") and for the share (`for_share`, reason "fair_share"); `serves`: each
    stream's waiter line (its replica, class, tenant), whose one request it makes room for —
    what a replica claims in the store before it preempts, so that two replicas reading the
    same waiter do not both preempt for it (router/request/fair_takeback.py)."""

    for_class: tuple[str, ...] = ()
    for_share: tuple[str, ...] = ()
    serves: Mapping[str, tuple[str, int, str]] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.for_class) + len(self.for_share)

    def claimed(
        self, streams: tuple[str, ...], claims: MutableMapping[tuple[str, int, str], int]
    ) -> tuple[str, ...]:
        """The `streams` (of this plan) whose waiting request was claimed: `claims` holds how
        many of each waiter line the replica got, each used once (decremented here)."""
        chosen: list[str] = []
        for stream in streams:
            line = self.serves[stream]
            if claims.get(line, 0) > 0:
                claims[line] -= 1
                chosen.append(stream)
        return tuple(chosen)


def plan_take_back(
    streams: Iterable[StreamFacts],
    waiters: Iterable[ClusterWaiter],
    occupancy: Occupancy,
    after_s: float,
    bound: int,
    budget: int,
) -> TakeBack:
    """Both rules in one decision (the module's docstring): the class's first, then the share's
    with what is left of the budget, on the streams not yet taken and the requests not yet
    served. At most `budget` streams, each at most once."""
    streams = tuple(streams)
    for_class, left = _take_back_for_class(streams, waiters, after_s, bound, budget)
    taken = {stream for stream, _ in for_class}
    rest = [s for s in streams if s.stream_id not in taken]
    for_share = _take_back(rest, left, occupancy, after_s, bound, budget - len(for_class))
    serves = {stream: (w.replica, w.priority, w.tenant) for stream, w in for_class + for_share}
    return TakeBack(
        tuple(stream for stream, _ in for_class),
        tuple(stream for stream, _ in for_share),
        serves,
    )
