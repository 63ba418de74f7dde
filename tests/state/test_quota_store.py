"""Tenants' quotas in the store (state/quotas.py): the memory store and Redis (one server and a
cluster) held to the same results, on a stepped clock (the Redis scripts' ARGV[1] clock)."""

from __future__ import annotations

import asyncio

import pytest

from state import MemoryStore, StateStore
from state.quotas import Quota
from tests.state.test_state_conformance import SteppedClock, clocked, prefix, redis_cluster, store

__all__ = ["clocked", "prefix", "redis_cluster", "store"]

LEASE = 30.0


async def test_requests_per_minute_is_a_bucket_of_one_minute(
    clocked: tuple[StateStore, SteppedClock],
) -> None:
    store, clock = clocked
    quota = Quota(requests_per_minute=3)
    for i in range(3):  # a minute's worth at once
        assert await store.take_quota("acme", quota, f"r{i}", 10, 1, LEASE, 5)
    refused = await store.take_quota("acme", quota, "r3", 10, 1, LEASE, 5)
    assert not refused and refused.limit == "requests_per_minute"
    assert refused.retry_after_s == pytest.approx(20.0)  # one request every 20 s
    assert refused.remaining_requests == 0 and refused.remaining_tokens is None
    clock.advance(19.9)
    assert not await store.take_quota("acme", quota, "r3", 10, 1, LEASE, 5)
    clock.advance(0.1)
    taken = await store.take_quota("acme", quota, "r3", 10, 1, LEASE, 5)
    assert taken and taken.remaining_requests == 0
    # Another tenant is not touched.
    assert await store.take_quota("other", quota, "o1", 10, 1, LEASE, 5)


async def test_tokens_per_minute_charged_then_corrected(
    clocked: tuple[StateStore, SteppedClock],
) -> None:
    store, clock = clocked
    quota = Quota(tokens_per_minute=6000)
    first = await store.take_quota("acme", quota, "r1", 4000, 1, LEASE, 5)
    assert first and first.remaining_tokens == 2000
    refused = await store.take_quota("acme", quota, "r2", 3000, 1, LEASE, 5)
    assert not refused and refused.limit == "tokens_per_minute"
    assert refused.retry_after_s == pytest.approx(10.0)  # 1000 short at 100 a second
    # r1 ended having cost 1000, not 4000: 3000 come back at once.
    assert await store.settle_quota("acme", quota, "r1", 1000 - 4000) == 0
    assert await store.take_quota("acme", quota, "r2", 3000, 1, LEASE, 5)
    # A longer answer than charged takes the bucket below zero: the next wait for the debt.
    await store.settle_quota("acme", quota, "r2", 5000)
    refused = await store.take_quota("acme", quota, "r3", 100, 1, LEASE, 5)
    # 5000 - 3000 - 5000 = -3000 left: 3100 short of 100, at 100 a second.
    assert not refused and refused.retry_after_s == pytest.approx(31.0)
    clock.advance(31.0)
    assert await store.take_quota("acme", quota, "r3", 100, 1, LEASE, 5)


async def test_a_correction_never_fills_past_the_limit(
    clocked: tuple[StateStore, SteppedClock],
) -> None:
    store, _ = clocked
    quota = Quota(tokens_per_minute=1000)
    assert await store.take_quota("acme", quota, "r1", 100, 1, LEASE, 5)
    await store.settle_quota("acme", quota, "r1", -5000)  # a refund larger than the charge
    taken = await store.take_quota("acme", quota, "r2", 1, 1, LEASE, 5)
    assert taken.remaining_tokens == 999


async def test_a_request_larger_than_a_minute_passes_on_a_full_bucket(
    clocked: tuple[StateStore, SteppedClock],
) -> None:
    store, clock = clocked
    quota = Quota(tokens_per_minute=1000)
    assert await store.take_quota("acme", quota, "big", 5000, 1, LEASE, 5)
    refused = await store.take_quota("acme", quota, "big2", 5000, 1, LEASE, 5)
    # -4000 now: a full bucket again (1000) is 5000 away, 300 s at 1000 a minute.
    assert not refused and refused.retry_after_s == pytest.approx(300.0)
    clock.advance(300.0)
    assert await store.take_quota("acme", quota, "big2", 5000, 1, LEASE, 5)


async def test_reserved_blocks_are_held_until_settled_or_expired(
    clocked: tuple[StateStore, SteppedClock],
) -> None:
    store, clock = clocked
    quota = Quota(max_reserved_blocks=10)
    assert (await store.take_quota("acme", quota, "r1", 0, 6, LEASE, 8)).held_blocks == 6
    assert (await store.take_quota("acme", quota, "r2", 0, 4, LEASE, 3)).held_blocks == 10
    refused = await store.take_quota("acme", quota, "r3", 0, 1, LEASE, 5)
    assert not refused and refused.limit == "max_reserved_blocks"
    assert refused.retry_after_s == pytest.approx(3.0)  # r2 is expected to end first
    assert await store.take_quota("acme", quota, "r2", 0, 4, LEASE, 3)  # a retried call: no-op
    assert await store.settle_quota("acme", quota, "r2", 0) == 4
    assert await store.settle_quota("acme", quota, "r2", 0) == 0
    assert (await store.take_quota("acme", quota, "r3", 0, 4, LEASE, 5)).held_blocks == 10
    # Holds not renewed expire with their lease: a replica that died frees its tenants' room.
    clock.advance(LEASE)
    assert (await store.take_quota("acme", quota, "r4", 0, 10, LEASE, 5)).held_blocks == 10


async def test_a_request_larger_than_the_block_limit_passes_alone(
    clocked: tuple[StateStore, SteppedClock],
) -> None:
    store, _ = clocked
    quota = Quota(max_reserved_blocks=4)
    assert await store.take_quota("acme", quota, "huge", 0, 9, LEASE, 5)
    refused = await store.take_quota("acme", quota, "small", 0, 1, LEASE, 5)
    assert not refused and refused.retry_after_s == pytest.approx(5.0)


async def test_renewal_keeps_holds_and_puts_back_lost_ones(
    clocked: tuple[StateStore, SteppedClock],
) -> None:
    store, clock = clocked
    quota = Quota(max_reserved_blocks=10)
    assert await store.take_quota("acme", quota, "r1", 0, 6, LEASE, 100)
    clock.advance(LEASE - 1)
    assert await store.renew_quota_holds("acme", {"r1": 6}, LEASE) == []
    clock.advance(LEASE - 1)  # past the first lease, within the renewed one
    assert not await store.take_quota("acme", quota, "r2", 0, 5, LEASE, 5)
    # A hold the store lost (its lease ran out under an unreachable store) is put back.
    assert await store.renew_quota_holds("acme", {"r1": 6, "lost": 3}, LEASE) == ["lost"]
    refused = await store.take_quota("acme", quota, "r2", 0, 2, LEASE, 5)
    assert not refused and refused.held_blocks == 9
    assert await store.renew_quota_holds("acme", {}, LEASE) == []


async def test_every_limit_at_once_names_the_longest_wait_and_takes_nothing(
    clocked: tuple[StateStore, SteppedClock],
) -> None:
    store, _ = clocked
    quota = Quota(requests_per_minute=60, tokens_per_minute=600, max_reserved_blocks=100)
    assert await store.take_quota("acme", quota, "r1", 590, 10, LEASE, 5)
    # Requests are fine (59 left); 20 tokens is 10 short (1 s); blocks fine.
    refused = await store.take_quota("acme", quota, "r2", 20, 10, LEASE, 5)
    assert refused.limit == "tokens_per_minute" and refused.retry_after_s == pytest.approx(1.0)
    # Nothing of r2 was taken: 59 requests and 10 tokens left, 10 blocks held.
    taken = await store.take_quota("acme", quota, "r3", 10, 90, LEASE, 5)
    assert taken and taken.remaining_requests == 58 and taken.held_blocks == 100


async def test_no_limit_takes_nothing(store: StateStore) -> None:
    taken = await store.take_quota("acme", Quota(), "r1", 10**9, 10**6, LEASE, 5)
    assert taken and taken.remaining_requests is None and taken.remaining_tokens is None
    assert await store.settle_quota("acme", Quota(), "r1", 5) == 0


async def test_concurrent_takes_never_pass_the_limit(store: StateStore) -> None:
    """Many calls at once (on Redis: each on its own connection, interleaved on the server):
    exactly the limit's worth is granted."""
    quota = Quota(requests_per_minute=7, max_reserved_blocks=1000)
    results = await asyncio.gather(
        *(store.take_quota("acme", quota, f"r{i}", 1, 1, LEASE, 5) for i in range(40))
    )
    assert sum(bool(r) for r in results) == 7


async def test_bad_arguments_are_refused_alike(store: StateStore) -> None:
    quota = Quota(requests_per_minute=1)
    for args in (
        ("a{b", quota, "r", 1, 1, LEASE, 5),
        ("acme", quota, "", 1, 1, LEASE, 5),
        ("acme", quota, "r", -1, 1, LEASE, 5),
        ("acme", quota, "r", 1, 1, 0.0, 5),
    ):
        with pytest.raises(ValueError):
            await store.take_quota(*args)  # type: ignore[arg-type]


def test_quota_checks_its_limits() -> None:
    assert not Quota() and Quota(tokens_per_minute=1)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError):
            Quota(requests_per_minute=bad)  # type: ignore[arg-type]


def test_memory_store_is_the_default() -> None:
    assert isinstance(MemoryStore(), StateStore)


async def test_a_hold_follows_its_reservation_within_the_limit(
    clocked: tuple[StateStore, SteppedClock],
) -> None:
    """Issue 31: a hold sized on a poisoned estimate (1 block) followed its reservation's
    growth nowhere, so 10 streams held 10 blocks of a 100-block limit while reserving 1,320.
    `resize_quota_hold` makes it what the request really holds, within the limit."""
    store, clock = clocked
    quota = Quota(max_reserved_blocks=100)
    for i in range(10):
        assert await store.take_quota("qc", quota, f"h{i}", 10, 1, LEASE, 5)
    grown = await store.resize_quota_hold("qc", quota, "h0", 60, LEASE)
    assert grown and grown.held_blocks == 69
    refused = await store.resize_quota_hold("qc", quota, "h1", 60, LEASE)
    assert not refused and refused.limit == "max_reserved_blocks"
    assert refused.held_blocks == 69 and refused.retry_after_s >= 1.0
    # Nothing changed: h1 can still grow to what is left.
    assert (await store.resize_quota_hold("qc", quota, "h1", 32, LEASE)).held_blocks == 100
    # Shrinking is always granted; forcing records what the worker holds anyway.
    assert (await store.resize_quota_hold("qc", quota, "h0", 10, LEASE)).held_blocks == 50
    forced = await store.resize_quota_hold("qc", quota, "h2", 200, LEASE, force=True)
    assert forced and forced.held_blocks == 249
    # A hold's blocks are what settle gives back (the resized size, not the first).
    assert await store.settle_quota("qc", quota, "h2", 0) == 200
    assert await store.settle_quota("qc", quota, "h0", 0) == 10


async def test_a_hold_never_grows_past_the_limit_alone_and_a_lost_hold_is_put_back(
    clocked: tuple[StateStore, SteppedClock],
) -> None:
    """Unlike `take_quota`, a request alone may not grow past the limit (issue 31: the hold
    never above it); only `force` records blocks the worker holds anyway."""
    store, clock = clocked
    quota = Quota(max_reserved_blocks=100)
    assert await store.take_quota("qc", quota, "h0", 10, 1, LEASE, 5)
    alone = await store.resize_quota_hold("qc", quota, "h0", 150, LEASE)
    assert not alone and alone.limit == "max_reserved_blocks" and alone.held_blocks == 1
    assert (await store.resize_quota_hold("qc", quota, "h0", 100, LEASE)).held_blocks == 100
    forced = await store.resize_quota_hold("qc", quota, "h0", 150, LEASE, force=True)
    assert forced and forced.held_blocks == 150
    clock.advance(LEASE + 1)  # its lease ran out: the store dropped it
    back = await store.resize_quota_hold("qc", quota, "h0", 40, LEASE)
    assert back and back.held_blocks == 40
    assert not await store.take_quota("qc", quota, "h1", 10, 61, LEASE, 5)
    # Without a block limit there is nothing to hold.
    assert await store.resize_quota_hold("qc", Quota(requests_per_minute=5), "h9", 10**6, LEASE)


async def test_a_request_the_cluster_refused_gives_its_request_back(
    clocked: tuple[StateStore, SteppedClock],
) -> None:
    """Issue 31: five requests refused with 503 (no worker in rotation) cost the tenant 10.5 s
    of 429s. `refund_request` gives the request back to the bucket, never above its limit."""
    store, clock = clocked
    quota = Quota(requests_per_minute=5)
    for i in range(5):
        assert await store.take_quota("acme", quota, f"r{i}", 10, 1, LEASE, 5)
    assert not await store.take_quota("acme", quota, "r5", 10, 1, LEASE, 5)
    for _ in range(5):
        await store.settle_quota("acme", quota, "", 0, refund_request=True)
    for i in range(5, 10):
        assert await store.take_quota("acme", quota, f"r{i}", 10, 1, LEASE, 5)
    assert not await store.take_quota("acme", quota, "r10", 10, 1, LEASE, 5)
    # Refunds never fill the bucket past its limit.
    clock.advance(120)
    for _ in range(3):
        await store.settle_quota("acme", quota, "", 0, refund_request=True)
    for i in range(11, 16):
        assert await store.take_quota("acme", quota, f"r{i}", 10, 1, LEASE, 5)
    assert not await store.take_quota("acme", quota, "r16", 10, 1, LEASE, 5)
