"""`StateStore.registry_view` and `usage_view`: the registry sync's and the state refresher's
one read each, the same on every store.

It must answer exactly what its four single reads answer (`check_marker`,
`registered_workers`, `drained_workers`, `worker_roles`), marker semantics included: missing on
first use and after the store lost its data, present otherwise. Run on `MemoryStore`, the
session's real Redis (tests/conftest.py; a key prefix per test, deleted afterwards) and the
private Redis Cluster of tests/redis_cluster.py (skipped without redis-server).
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster

from state import Keys, MemoryStore, RedisStore, StateStore
from state.base import DrainMark
from tests.conftest import REDIS_URL
from tests.redis_cluster import PrivateRedisCluster, redis_cluster

__all__ = ["redis_cluster"]  # the session fixture, imported so the "cluster" variant finds it

TTL = 60.0


@pytest.fixture(params=["memory", "redis", "cluster"])
async def store(request: pytest.FixtureRequest) -> AsyncIterator[StateStore]:
    if request.param == "memory":
        yield MemoryStore()
        return
    prefix = f"test:{uuid.uuid4().hex}:"
    client: aioredis.Redis | RedisCluster
    if request.param == "cluster":
        cluster: PrivateRedisCluster = request.getfixturevalue("redis_cluster")
        client = RedisCluster(host=cluster.seed[0], port=cluster.seed[1])
    else:
        client = aioredis.Redis.from_url(REDIS_URL)
    try:
        yield RedisStore(client, Keys(prefix))
    finally:
        keys = [key async for key in client.scan_iter(match=f"{prefix}*", count=500)]
        for key in keys:  # one at a time: on a cluster the keys are in several slots
            await client.delete(key)
        await client.aclose()


async def _single_reads(store: StateStore) -> tuple[object, ...]:
    return (
        await store.registered_workers(),
        await store.drain_marks(),
        await store.worker_roles(),
    )


def _drained(marks: dict[str, DrainMark]) -> set[str]:
    return {wid for wid, mark in marks.items() if mark.drained}


async def test_an_empty_store_answers_a_missing_marker_then_a_present_one(
    store: StateStore,
) -> None:
    assert await store.registry_view(TTL) == (True, {}, {}, {})
    assert await store.registry_view(TTL) == (False, {}, {}, {})
    assert await store.check_marker(TTL) is False  # the view set the marker, as check_marker does


async def test_the_view_is_what_the_single_reads_answer(store: StateStore) -> None:
    await store.check_marker(TTL)
    await store.register_worker("d-new", '{"id": "d-new", "role": "decode"}')
    await store.register_worker("p-new", '{"id": "p-new", "role": "prefill"}')
    await store.set_drained("d-new", True)
    await store.set_drained("d0", True)
    flipped = await store.set_role("b0", "prefill", 0)
    assert flipped is not None
    await store.set_role("b1", "decode", 0)

    lost, workers, drained, roles = await store.registry_view(TTL)
    assert lost is False
    assert (workers, drained, roles) == await _single_reads(store)
    assert workers == {
        "d-new": '{"id": "d-new", "role": "decode"}',
        "p-new": '{"id": "p-new", "role": "prefill"}',
    }
    assert _drained(drained) == await store.drained_workers() == {"d-new", "d0"}
    assert roles["b0"] == flipped and roles["b1"].role == "decode"

    # Changes show at the next view: one left, one back in use, one role forgotten.
    await store.unregister_worker("p-new")
    await store.set_drained("d0", False)
    await store.forget_role("b1")
    lost, workers, drained, roles = await store.registry_view(TTL)
    assert (lost, set(workers), _drained(drained), set(roles)) == (
        False,
        {"d-new"},
        {"d-new"},
        {"b0"},
    )
    assert set(drained) == {"d-new", "d0"} and drained["d0"].drained is False  # its undrain


async def test_the_usage_view_is_what_decode_usage_and_stranded_bytes_answer(
    store: StateStore,
) -> None:
    """The refresher's one read: reservations (with their stranded-KV intent) and ledger sums
    of workers that may sit on different cluster nodes, ids repeated or unknown included."""
    for wid in ("d0", "d1"):
        await store.set_capacity(wid, 100)
    assert (await store.reserve("d0", "r1", 10, 30.0)).held
    assert (await store.reserve("d0", "r2", 5, 30.0)).held
    assert (await store.reserve("d1", "r3", 7, 30.0)).held
    await store.strand("p0", "q1", 4096)
    await store.strand("p1", "q2", 512)
    decode, prefill = ["d0", "d1", "d0", "d-none"], ["p0", "p1", "p-none"]
    usage, stranded = await store.usage_view(decode, prefill)
    assert usage == await store.decode_usage(decode)
    assert stranded == await store.stranded_bytes(prefill)
    assert (usage["d0"].reserved_blocks, usage["d0"].reservations) == (15, 2)
    assert usage["d1"].capacity_blocks == 100 and usage["d-none"].capacity_blocks == 0
    assert stranded == {"p0": 4096, "p1": 512, "p-none": 0}
    assert await store.usage_view([], []) == ({}, {})
    assert await store.usage_view([], ["p1"]) == ({}, {"p1": 512})


async def test_a_store_that_lost_its_data_shows_as_a_missing_marker() -> None:
    """The marker's TTL lapsing stands for the store losing it (a Redis restarted empty)."""
    now = [1000.0]
    store = MemoryStore(clock=lambda: now[0])
    assert (await store.registry_view(5.0))[0] is True
    now[0] += 4.0
    assert (await store.registry_view(5.0))[0] is False  # refreshed: alive 5 s from here
    now[0] += 6.0
    assert (await store.registry_view(5.0))[0] is True
