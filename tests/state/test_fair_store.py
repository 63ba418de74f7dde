"""The cluster's fair share in the store (state/fair_shares.py, issue 33): the memory store and
Redis (one server and a cluster) held to the same results on a stepped clock, and a random
sequence of syncs from three replicas against the Python reference (`fair_sync_now`)."""

from __future__ import annotations

import asyncio
import random

import pytest

from state import StateStore
from state.fair_shares import FairTable, FairView, fair_sync_now
from tests.state.test_state_conformance import SteppedClock, clocked, prefix, redis_cluster, store

__all__ = ["clocked", "prefix", "redis_cluster", "store"]

LEASE = 1.0


async def test_charges_add_up_across_replicas(clocked: tuple[StateStore, SteppedClock]) -> None:
    store, _ = clocked
    await store.fair_sync("r1", {(0, "a"): 5.0}, {}, LEASE)
    view = await store.fair_sync("r2", {(0, "a"): 2.5, (0, "b"): 1.0}, {}, LEASE)
    assert view.counters[(0, "a")] == pytest.approx(7.5)
    # b charged while nobody waits: lifted to the floor the last charge of a left (5.0), +1
    assert view.counters[(0, "b")] == pytest.approx(6.0)
    assert view.waiters == ()


async def test_a_tenant_that_starts_to_wait_is_lifted_to_the_floor(
    clocked: tuple[StateStore, SteppedClock],
) -> None:
    store, clock = clocked
    # a waits on r1 with counter 10; b starts to wait on r2 at 0: lifted to a's 10
    await store.fair_sync("r1", {(0, "a"): 10.0}, {(0, "a"): (3, 0.5)}, LEASE)
    clock.advance(0.25)
    view = await store.fair_sync("r2", {}, {(0, "b"): (1, 0.0)}, LEASE)
    assert view.counters[(0, "b")] == pytest.approx(10.0)
    assert view.floors[0] == pytest.approx(10.0)
    waiters = {(w.replica, w.tenant): w for w in view.waiters}
    assert waiters[("r1", "a")].count == 3
    assert waiters[("r1", "a")].waited_s == pytest.approx(0.75)
    assert waiters[("r2", "b")].waited_s == pytest.approx(0.0)
    # b keeps waiting and is refunded below the floor: not lifted again while it waits
    view = await store.fair_sync("r2", {(0, "b"): -4.0}, {(0, "b"): (1, 0.1)}, LEASE)
    assert view.counters[(0, "b")] == pytest.approx(6.0)
    assert view.floors[0] == pytest.approx(10.0)  # never down


async def test_registrations_expire_and_are_replaced(
    clocked: tuple[StateStore, SteppedClock],
) -> None:
    store, clock = clocked
    await store.fair_sync("r1", {}, {(0, "a"): (1, 0.0), (1, "a"): (2, 0.0)}, LEASE)
    view = await store.fair_sync("r1", {}, {(1, "a"): (2, 0.0)}, LEASE)  # (0, a) left
    assert [(w.replica, w.priority, w.tenant) for w in view.waiters] == [("r1", 1, "a")]
    clock.advance(LEASE + 0.01)  # r1 died: its registration lapses
    view = await store.fair_sync("r2", {}, {}, LEASE)
    assert view.waiters == ()


async def test_holdings_add_up_over_replicas_and_are_no_waiters(
    clocked: tuple[StateStore, SteppedClock],
) -> None:
    store, clock = clocked
    await store.fair_sync("r1", {}, {}, LEASE, {(0, "a"): 30})
    view = await store.fair_sync("r2", {}, {(0, "b"): (1, 0.0)}, LEASE, {(0, "a"): 12})
    assert view.held == {(0, "a"): 42}
    assert [w.tenant for w in view.waiters] == ["b"]  # a holds, it does not wait
    assert (0, "a") in view.counters
    assert view.replicas == ("r1", "r2")  # a holder is a replica to tell, as a waiter's is
    view = await store.fair_sync("r1", {}, {}, LEASE, {})  # r1's requests ended
    assert view.held == {(0, "a"): 12}
    assert view.replicas == ("r2",)  # nothing left to register
    await store.fair_sync("r3", {}, {}, 10 * LEASE, {(0, "c"): 1})  # a quiet one's long lease
    clock.advance(LEASE + 0.01)
    view = await store.fair_sync("r4", {}, {}, LEASE)
    assert view.held == {(0, "c"): 1} and view.replicas == ("r3",)


async def test_classes_are_apart(clocked: tuple[StateStore, SteppedClock]) -> None:
    store, _ = clocked
    view = await store.fair_sync("r1", {(0, "a"): 3.0, (2, "a"): 7.0}, {}, LEASE)
    assert view.counters == {(0, "a"): 3.0, (2, "a"): 7.0}
    assert view.floors == {0: 3.0, 2: 7.0}


async def test_bad_arguments_raise_before_writing(store: StateStore) -> None:
    for replica, charges, waiting, lease in (
        ("", {}, {}, LEASE),
        ("r|1", {}, {}, LEASE),
        ("r1", {(0, "a|b"): 1.0}, {}, LEASE),
        ("r1", {(0, "a"): float("nan")}, {}, LEASE),
        ("r1", {}, {(0, "a"): (0, 1.0)}, LEASE),
        ("r1", {}, {}, 0.0),
    ):
        with pytest.raises(ValueError):
            await store.fair_sync(replica, charges, waiting, lease)
    with pytest.raises(ValueError):
        await store.fair_sync("r1", {}, {}, LEASE, {(0, "a"): -1})
    view = await store.fair_sync("r1", {}, {}, LEASE)
    assert view == FairView({}, {}, (), {}, ())


async def test_random_syncs_match_the_reference(clocked: tuple[StateStore, SteppedClock]) -> None:
    store, clock = clocked
    rng = random.Random(33)
    table = FairTable()
    tenants = ["a", "b", "c", "d"]
    for _ in range(60):
        replica = rng.choice(["r1", "r2", "r3"])
        charges = {
            (rng.choice([0, 1]), t): round(rng.uniform(-2, 10), 3)
            for t in rng.sample(tenants, rng.randint(0, 3))
        }
        waiting = {
            (rng.choice([0, 1]), t): (rng.randint(1, 4), round(rng.uniform(0, 0.5), 3))
            for t in rng.sample(tenants, rng.randint(0, 2))
        }
        holding = {
            (rng.choice([0, 1]), t): rng.randint(0, 40)
            for t in rng.sample(tenants, rng.randint(0, 3))
        }
        expected = fair_sync_now(table, clock(), replica, charges, waiting, LEASE, holding)
        got = await store.fair_sync(replica, charges, waiting, LEASE, holding)
        assert got.held == expected.held
        assert got.floors == pytest.approx(expected.floors)
        assert got.counters == pytest.approx(expected.counters)
        assert [(w.replica, w.priority, w.tenant, w.count) for w in got.waiters] == [
            (w.replica, w.priority, w.tenant, w.count) for w in expected.waiters
        ]
        assert [w.waited_s for w in got.waiters] == pytest.approx(
            [w.waited_s for w in expected.waiters], abs=1e-6
        )
        clock.advance(round(rng.uniform(0, 0.6), 3))


async def test_a_nudge_reaches_the_replica_listening_and_no_other(store: StateStore) -> None:
    """The hand-off's nudge (router/fair_share.py): `fair_nudge(r)` is heard by r's listener
    only, every one of them; a nudge nobody listens to is lost, not queued."""
    await store.fair_nudge("r1")  # nobody listens yet: lost
    heard: dict[str, int] = {"r1": 0, "r2": 0}
    news = asyncio.Event()  # set at each nudge heard
    subscribed = {"r1": asyncio.Event(), "r2": asyncio.Event()}

    async def listen(replica: str) -> None:
        nudges = store.fair_nudges(replica)
        waiting = asyncio.ensure_future(anext(nudges))
        subscribed[replica].set()
        try:
            while True:
                await waiting
                heard[replica] += 1
                news.set()
                waiting = asyncio.ensure_future(anext(nudges))
        finally:
            waiting.cancel()
            await nudges.aclose()

    listeners = [asyncio.create_task(listen(r)) for r in ("r1", "r2")]
    try:
        for event in subscribed.values():
            await event.wait()
        # Subscribing takes a round trip on Redis: nudge until the first is heard.
        async with asyncio.timeout(10):
            while heard["r1"] == 0:
                await store.fair_nudge("r1")
                await asyncio.sleep(0.05)
        before = heard["r1"]
        for _ in range(3):
            await store.fair_nudge("r1")
        async with asyncio.timeout(10):
            while heard["r1"] < before + 3:
                news.clear()
                await news.wait()
        assert heard["r2"] == 0
    finally:
        for task in listeners:
            task.cancel()
        await asyncio.gather(*listeners, return_exceptions=True)


async def test_a_waiters_requests_are_claimed_once_across_replicas(store: StateStore) -> None:
    """Before a take-back (router/request/fair_takeback.py): two replicas that read the same
    waiter claim its requests; each request goes to one of them until the claim expires."""
    line = "r9|0|victim"
    assert await store.fair_claim({line: (2, 1)}, "r1", 0.3) == {line: 1}
    assert await store.fair_claim({line: (2, 2)}, "r2", 0.3) == {line: 1}  # the second only
    assert await store.fair_claim({line: (2, 1), "r9|0|other": (1, 1)}, "r3", 0.3) == {
        line: 0,
        "r9|0|other": 1,
    }
    assert await store.fair_claim({line: (0, 1)}, "r3", 0.3) == {line: 0}
    await asyncio.sleep(0.5)  # the claims expire: the requests may be claimed again
    assert await store.fair_claim({line: (2, 2)}, "r2", 0.3) == {line: 2}


async def test_a_nudge_names_the_line_it_left_room_for(store: StateStore) -> None:
    """A take-back's nudge carries the waiter line (class, tenant) the room is for, which the
    nudged replica wakes first (router/fair_share.py `_listen`); a hand-off's nudge names none.
    A line the store could not carry back is refused before anything is sent."""
    for bad in ((0, ""), (0, "a|b")):
        with pytest.raises(ValueError):
            await store.fair_nudge("r1", bad)
    nudges = store.fair_nudges("r1")
    heard: list[tuple[int, str] | None] = []
    reading = asyncio.ensure_future(anext(nudges))
    try:
        # Subscribing takes a round trip on Redis: nudge until the first is heard.
        async with asyncio.timeout(10):
            while not reading.done():
                await store.fair_nudge("r1")
                await asyncio.sleep(0.05)
        while True:  # the bare nudges sent before the first was heard
            heard.append(reading.result())
            await store.fair_nudge("r1", (2, "tenant-é"))
            await store.fair_nudge("r1")
            reading = asyncio.ensure_future(anext(nudges))
            async with asyncio.timeout(10):
                first = await reading
            if first is not None:
                break
        async with asyncio.timeout(10):
            second = await anext(nudges)
        assert heard[0] is None
        assert first == (2, "tenant-é") and second is None
    finally:
        reading.cancel()
        await nudges.aclose()
