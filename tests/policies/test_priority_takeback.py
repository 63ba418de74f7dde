"""Priority classes (issue 33): the class names (policies/priority_classes.py), a more urgent class
taking room back from a less urgent one (policies/fair_share.py `take_back_for_class`,
`plan_take_back`), and the starvation bound, as functions, with hypothesis over random clusters."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policies.base import AdmissionCost, Tenant, WaitingRequest
from policies.fair_share import ClusterWaiter, Occupancy, plan_take_back, take_back_for_class
from policies.fairness import VTCFairness
from policies.preemption import StreamFacts
from policies.priority_classes import BATCH, DEFAULT, INTERACTIVE, class_name, parse_class

BOUND = 2  # preemption.max_per_stream


def _stream(sid: str, tenant: str, at: float, priority: int, preempted: int = 0) -> StreamFacts:
    return StreamFacts(sid, tenant, "d0", at, 20, preempted, priority)


def _waiter(
    priority: int, count: int = 1, waited_s: float = 0.5, tenant: str = "i"
) -> ClusterWaiter:
    return ClusterWaiter("r1", priority, tenant, 0.0, count, waited_s)


# -- the names --------------------------------------------------------------------------------


def test_class_names_map_onto_the_integer_classes() -> None:
    assert (INTERACTIVE, DEFAULT, BATCH) == (-1, 0, 1)  # lower first; unset is 0, as before
    for raw, want in [
        ("interactive", -1),
        (" Batch ", 1),
        ("DEFAULT", 0),
        (7, 7),
        ("-3", -3),
        ("+2", 2),
        ("12", 12),
    ]:
        assert parse_class(raw) == want
    assert [class_name(p) for p in (-1, 0, 1, 5)] == ["interactive", "default", "batch", "5"]


@pytest.mark.parametrize(
    "raw", ["urgent", "", "1.5", "²", "1" * 40, True, 1.0, None, ["batch"], "- 1", "0x1"]
)
def test_anything_else_is_not_a_class(raw: object) -> None:
    with pytest.raises(ValueError, match="interactive, default, batch"):
        parse_class(raw)


# -- a more urgent class takes room back --------------------------------------------------------


def test_an_interactive_request_takes_the_newest_stream_of_the_least_urgent_class() -> None:
    streams = [
        _stream("d1", "x", 5.0, DEFAULT),
        _stream("b1", "y", 1.0, BATCH),
        _stream("b2", "y", 2.0, BATCH),
        _stream("b3", "z", 3.0, BATCH, preempted=BOUND),  # taken `bound` times: never again
    ]
    assert take_back_for_class(streams, [_waiter(INTERACTIVE)], 0.1, BOUND, 5)[0] == ("b2",)
    # one per waiting request, the least urgent class first, then the next class up
    two, left = take_back_for_class(streams, [_waiter(INTERACTIVE, 3)], 0.1, BOUND, 5)
    assert two == ("b2", "b1", "d1") and left == (_waiter(INTERACTIVE, 0),)
    # at most the budget; nothing before `after_s`; nothing with no budget
    assert take_back_for_class(streams, [_waiter(INTERACTIVE, 3)], 0.1, BOUND, 1)[0] == ("b2",)
    assert take_back_for_class(streams, [_waiter(INTERACTIVE)], 1.0, BOUND, 5)[0] == ()
    assert take_back_for_class(streams, [_waiter(INTERACTIVE)], 0.1, BOUND, 0)[0] == ()


def test_a_class_never_takes_from_its_own_or_a_more_urgent_one() -> None:
    streams = [_stream("i1", "x", 1.0, INTERACTIVE), _stream("d1", "x", 2.0, DEFAULT)]
    assert take_back_for_class(streams, [_waiter(DEFAULT, 4)], 0.1, BOUND, 5)[0] == ()
    assert take_back_for_class(streams, [_waiter(BATCH, 4)], 0.1, BOUND, 5)[0] == ()
    # a default waiter takes batch streams only, however many default ones there are
    streams.append(_stream("b1", "x", 0.5, BATCH))
    assert take_back_for_class(streams, [_waiter(DEFAULT, 4)], 0.1, BOUND, 5)[0] == ("b1",)


def test_the_most_urgent_waiters_are_served_first() -> None:
    streams = [_stream("b1", "y", 1.0, BATCH)]
    waiters = [_waiter(DEFAULT, waited_s=9.0, tenant="d"), _waiter(INTERACTIVE, tenant="i")]
    chosen, left = take_back_for_class(streams, waiters, 0.1, BOUND, 5)
    assert chosen == ("b1",) and [w.count for w in left] == [1, 0]  # the interactive one's


def test_a_request_served_by_its_class_takes_nothing_more_for_its_share() -> None:
    # A flooding batch tenant holds the pool; an interactive tenant under its share waits.
    streams = [_stream(f"b{i}", "flood", float(i), BATCH) for i in range(5)]
    occ = Occupancy(100, {"flood": 100}, {}, frozenset({"flood", "i"}))
    plan = plan_take_back(streams, [_waiter(INTERACTIVE, 1)], occ, 0.1, BOUND, 5)
    assert plan.for_class == ("b4",) and plan.for_share == ()
    # two waiting: one stream each, whichever rule takes it
    plan = plan_take_back(streams, [_waiter(INTERACTIVE, 2)], occ, 0.1, BOUND, 5)
    assert len(plan) == 2 and set(plan.for_class) | set(plan.for_share) == {"b4", "b3"}


def test_the_share_never_takes_from_a_more_urgent_class() -> None:
    # A batch tenant under its share: the interactive tenant over its share keeps its streams.
    streams = [_stream(f"s{i}", "loud", float(i), INTERACTIVE) for i in range(5)]
    occ = Occupancy(100, {"loud": 100}, {}, frozenset({"loud", "quiet"}))
    quiet = _waiter(BATCH, 2, tenant="quiet")  # two 20-block requests: within its share of 50
    assert len(plan_take_back(streams, [quiet], occ, 0.1, BOUND, 5)) == 0
    # the same tenant in the same class as the quiet one's: the share's rule applies
    same = [_stream(f"s{i}", "loud", float(i), BATCH) for i in range(5)]
    # (two of 20 blocks: a third would take loud below its share of 50, and give quiet more)
    assert plan_take_back(same, [quiet], occ, 0.1, BOUND, 5).for_share == ("s4", "s3")


# -- properties ---------------------------------------------------------------------------------

CLASSES = st.sampled_from([INTERACTIVE, DEFAULT, BATCH, 3])
TENANTS = ["a", "b", "c"]
waiters_st = st.lists(
    st.builds(
        ClusterWaiter,
        st.sampled_from(["r1", "r2"]),
        CLASSES,
        st.sampled_from(TENANTS),
        st.floats(0, 100),
        st.integers(0, 4),
        st.floats(0, 2),
    ),
    max_size=6,
)
streams_st = st.lists(
    st.builds(
        StreamFacts,
        st.uuids().map(str),
        st.sampled_from(TENANTS),
        st.sampled_from(["d0", "d1"]),
        st.floats(0, 100),
        st.integers(1, 40),
        st.integers(0, 3),
        CLASSES,
    ),
    max_size=12,
    unique_by=lambda s: s.stream_id,
)


@settings(max_examples=400, deadline=None)
@given(
    streams_st,
    waiters_st,
    st.dictionaries(st.sampled_from(TENANTS), st.integers(0, 200)),
    st.integers(1, 400),
    st.integers(0, 5),
)
def test_taking_back_for_a_class_keeps_its_bounds(
    streams: list[StreamFacts],
    waiters: list[ClusterWaiter],
    held: dict[str, int],
    capacity: int,
    budget: int,
) -> None:
    chosen, left = take_back_for_class(streams, waiters, 0.5, BOUND, budget)
    assert (chosen, left) == take_back_for_class(streams[::-1], waiters, 0.5, BOUND, budget)
    assert len(chosen) <= budget and len(set(chosen)) == len(chosen)
    starved = [w for w in waiters if w.waited_s >= 0.5]
    # one per waiting request, each taken off the count of a starved waiter
    assert sum(w.count - v.count for w, v in zip(waiters, left, strict=True)) == len(chosen)
    assert all(v.count >= 0 for v in left)
    for w, v in zip(waiters, left, strict=True):
        assert v.count == w.count or w in starved
    if chosen:
        by_id = {s.stream_id: s for s in streams}
        picked = [by_id[i] for i in chosen]
        most_urgent = min(w.priority for w in starved if w.count)
        assert all(s.preempted < BOUND and s.priority > most_urgent for s in picked)
        # the least urgent class first, newest dispatch first: a prefix of that order
        eligible = sorted(
            (s for s in streams if s.preempted < BOUND and s.priority > most_urgent),
            key=lambda s: (s.priority, s.dispatched, s.stream_id),
            reverse=True,
        )
        assert [s.stream_id for s in eligible[: len(chosen)]] == list(chosen)
    # with the share's rule: still within the budget, each stream once, never more streams
    # than requests starved
    occ = Occupancy(capacity, held, {}, frozenset(held) | {w.tenant for w in waiters})
    plan = plan_take_back(streams, waiters, occ, 0.5, BOUND, budget)
    both = plan.for_class + plan.for_share
    assert plan.for_class == chosen
    assert len(both) <= budget and len(set(both)) == len(both)
    assert len(both) <= sum(w.count for w in starved)
    if plan.for_share:  # the share's rule: never a stream of a class more urgent than the
        # starved tenant's it takes for (under its share, with requests not served by a class)
        by_id = {s.stream_id: s for s in streams}
        takers = [w for w in left if w.waited_s >= 0.5 and w.count and occ.under(w.tenant)]
        assert all(by_id[i].priority >= min(w.priority for w in takers) for i in plan.for_share)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.sampled_from(TENANTS), CLASSES), min_size=1, max_size=10),
    st.integers(1, 3),
    st.integers(1, 4),
)
def test_no_stream_is_starved_forever_by_more_urgent_waiters(
    live: list[tuple[str, int]], bound: int, budget: int
) -> None:
    """The preemption side of the starvation bound: under a permanent flood of the most urgent
    class (waiting forever, as many as it likes), each stream is taken at most `bound` times,
    and then never again: every answer of a less urgent class runs to its end."""
    streams = {
        f"s{i}": StreamFacts(f"s{i}", tenant, "d0", float(i), 10, 0, priority)
        for i, (tenant, priority) in enumerate(live)
    }
    flood = [ClusterWaiter("r1", INTERACTIVE - 1, "flood", 0.0, 1_000, 60.0)]
    occ = Occupancy(100, {"flood": 0}, {}, frozenset({"flood", *TENANTS}))
    clock = itertools.count(len(live))
    for _ in range(bound * len(live) + 1):
        plan = plan_take_back(streams.values(), flood, occ, 0.1, bound, budget)
        for sid in plan.for_class + plan.for_share:  # preempted: resumed, dispatched anew
            s = streams[sid]
            streams[sid] = StreamFacts(
                sid,
                s.tenant,
                s.decode_id,
                float(next(clock)),
                s.blocks,
                s.preempted + 1,
                s.priority,
            )
    assert all(s.preempted <= bound for s in streams.values())
    assert len(plan_take_back(streams.values(), flood, occ, 0.1, bound, budget)) == 0


def test_a_batch_class_is_admitted_under_an_interactive_flood() -> None:
    """The admission side of the bound with the named classes: one batch admission in at most
    max_bypass + 1 while interactive requests never stop coming."""
    policy = VTCFairness(max_bypass=4)
    cost = AdmissionCost(decode_block_s=1.0, prefill_tokens=1)
    tickets = itertools.count()
    batch = Tenant("b", 1.0, BATCH)
    for _ in range(3):
        policy.enqueue(WaitingRequest(next(tickets), batch, BATCH, cost))
    interactive = Tenant("i", 1.0, INTERACTIVE)
    since_batch = 0
    batch_admitted = 0
    for _ in range(40):
        policy.enqueue(WaitingRequest(next(tickets), interactive, INTERACTIVE, cost))
        nxt = policy.pick(0.0)
        assert nxt is not None
        policy.admit(nxt)
        if nxt.priority == BATCH:
            batch_admitted += 1
            since_batch = 0
        else:
            since_batch += 1
            assert since_batch <= 4 or batch_admitted == 3
    assert batch_admitted == 3
