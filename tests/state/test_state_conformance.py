"""One conformance suite for both state stores (docs/design.md §5): `MemoryStore` and `RedisStore`,
the latter on one server and on a Redis Cluster.

Redis tests use the session's real server (tests/conftest.py), each under its own key prefix
(``test:<uuid>:``), and delete their keys afterwards. The "cluster" variants run on a private
3-node cluster started once per session (tests/redis_cluster.py), skipped without redis-server.
Leases are real and short on every store; where a test needs to step time exactly (ages, budget
windows) it injects a clock into the store, which exercises the Redis scripts' ``ARGV[1]``
clock path too.
"""

from __future__ import annotations

import asyncio
import random
import socket
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster
from redis.crc import key_slot

from state import (
    DecodeUsage,
    Keys,
    MemoryStore,
    RedisStore,
    RetryBudgetPolicy,
    StateStore,
    StoreError,
    StoreUnavailableError,
    StrandedEntry,
    open_store,
    redact_url,
)
from state.base import Reserved, StrandIntent
from state.keys import RETRY_TTL_S
from tests.conftest import REDIS_URL
from tests.redis_cluster import PrivateRedisCluster, redis_cluster

__all__ = ["redis_cluster"]  # the session fixture, imported so the "cluster" variants find it

LONG = 60.0  # a lease no test outlives
SHORT = 0.2  # a lease every expiry test outlives by sleeping EXPIRED_AFTER
EXPIRED_AFTER = 0.5


class SteppedClock:
    """A clock that moves only when told to."""

    def __init__(self, start: float = 1_000_000.25) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds

    def __repr__(self) -> str:
        return f"SteppedClock(now={self.now})"


async def _delete_prefix(client: aioredis.Redis | RedisCluster, prefix: str) -> None:
    # On a cluster, SCAN visits every primary and DEL is split by slot.
    keys = [key async for key in client.scan_iter(match=f"{prefix}*", count=500)]
    if keys:
        await client.delete(*keys)


@pytest.fixture
def prefix() -> str:
    return f"test:{uuid.uuid4().hex}:"


@asynccontextmanager
async def _redis(
    prefix: str, cluster: PrivateRedisCluster | None = None
) -> AsyncIterator[aioredis.Redis | RedisCluster]:
    # The client's default connection pool opens a connection per concurrent command, so the
    # race tests really interleave scripts on the server.
    client: aioredis.Redis | RedisCluster
    if cluster is None:
        client = aioredis.Redis.from_url(REDIS_URL)
    else:
        host, port = cluster.seed
        client = RedisCluster(host=host, port=port)
    try:
        yield client
    finally:
        await _delete_prefix(client, prefix)
        await client.aclose()


def _cluster_of(request: pytest.FixtureRequest) -> PrivateRedisCluster | None:
    """The session's cluster for a "cluster" variant (started on first use), else None."""
    if request.param != "cluster":
        return None
    cluster: PrivateRedisCluster = request.getfixturevalue("redis_cluster")
    return cluster


@pytest.fixture(params=["redis", "cluster"])
async def redis_client(
    request: pytest.FixtureRequest, prefix: str
) -> AsyncIterator[aioredis.Redis | RedisCluster]:
    async with _redis(prefix, _cluster_of(request)) as client:
        yield client


@pytest.fixture(params=["memory", "redis", "cluster"])
async def store(request: pytest.FixtureRequest, prefix: str) -> AsyncIterator[StateStore]:
    if request.param == "memory":
        yield MemoryStore()
        return
    async with _redis(prefix, _cluster_of(request)) as client:
        yield RedisStore(client, Keys(prefix))


@pytest.fixture(params=["memory", "redis", "cluster"])
async def clocked(
    request: pytest.FixtureRequest, prefix: str
) -> AsyncIterator[tuple[StateStore, SteppedClock]]:
    clock = SteppedClock()
    if request.param == "memory":
        yield MemoryStore(clock=clock), clock
        return
    async with _redis(prefix, _cluster_of(request)) as client:
        yield RedisStore(client, Keys(prefix), clock=clock), clock


async def _usage(store: StateStore, worker_id: str) -> DecodeUsage:
    return (await store.decode_usage([worker_id]))[worker_id]


# -- decode reservations ---------------------------------------------------------------------


async def test_store_satisfies_protocol(store: StateStore) -> None:
    assert isinstance(store, StateStore)
    assert await store.ping()
    assert type(store).__name__ in repr(store)


async def test_reserve_within_and_over_capacity(store: StateStore) -> None:
    await store.set_capacity("d1", 10)
    assert await store.reserve("d1", "r1", 6, LONG)
    assert not await store.reserve("d1", "r2", 5, LONG)  # 4 free
    assert await store.reserve("d1", "r3", 4, LONG)  # exactly fills
    assert not await store.reserve("d1", "r4", 1, LONG)
    assert await _usage(store, "d1") == DecodeUsage(10, 10, 2)
    assert (await _usage(store, "d1")).free_blocks == 0


async def test_unknown_worker_has_no_room(store: StateStore) -> None:
    assert await store.decode_usage(["nobody"]) == {"nobody": DecodeUsage(0, 0, 0)}
    assert not await store.reserve("nobody", "r1", 1, LONG)
    assert await store.decode_usage([]) == {}


async def test_reserve_is_idempotent_per_id(store: StateStore) -> None:
    await store.set_capacity("d1", 10)
    assert await store.reserve("d1", "r1", 6, LONG)
    # A retried call succeeds without counting twice, even though 6 more would not fit.
    assert await store.reserve("d1", "r1", 6, LONG)
    assert await _usage(store, "d1") == DecodeUsage(10, 6, 1)


async def test_release_returns_blocks_once_then_zero(store: StateStore) -> None:
    await store.set_capacity("d1", 10)
    assert await store.reserve("d1", "r1", 7, LONG)
    assert await store.release("d1", "r1") == 7
    assert await store.release("d1", "r1") == 0  # a double release is visible to the caller
    assert await store.release("d1", "never") == 0
    assert await _usage(store, "d1") == DecodeUsage(10, 0, 0)


async def test_capacity_change(store: StateStore) -> None:
    await store.set_capacity("d1", 4)
    assert await store.reserve("d1", "r1", 4, LONG)
    await store.set_capacity("d1", 10)
    assert await store.reserve("d1", "r2", 6, LONG)
    # Shrinking below what is held keeps the holders and refuses newcomers.
    await store.set_capacity("d1", 5)
    assert await _usage(store, "d1") == DecodeUsage(5, 10, 2)
    assert (await _usage(store, "d1")).free_blocks == -5
    assert not await store.reserve("d1", "r3", 1, LONG)
    assert await store.release("d1", "r2") == 6
    assert await store.reserve("d1", "r3", 1, LONG)


async def test_resize(store: StateStore) -> None:
    await store.set_capacity("d1", 10)
    assert await store.reserve("d1", "r1", 4, LONG)
    assert await store.reserve("d1", "r2", 2, LONG)
    assert await store.resize("d1", "r1", 8)  # grows by 4 into the 4 free
    assert not await store.resize("d1", "r1", 9)  # no room for one more
    assert await _usage(store, "d1") == DecodeUsage(10, 10, 2)
    assert await store.resize("d1", "r1", 3)  # shrinking always fits
    assert await _usage(store, "d1") == DecodeUsage(10, 5, 2)
    assert not await store.resize("d1", "gone", 1)
    assert await store.release("d1", "r1") == 3


async def test_lease_expiry_frees_blocks(store: StateStore) -> None:
    await store.set_capacity("d1", 10)
    assert await store.reserve("d1", "short", 6, SHORT)
    assert await store.reserve("d1", "long", 3, LONG)
    await asyncio.sleep(EXPIRED_AFTER)
    # A dead router's reservation vanishes after its lease: usage no longer counts it ...
    assert await _usage(store, "d1") == DecodeUsage(10, 3, 1)
    # ... its room is free again, and releasing it late reports nothing held.
    assert await store.reserve("d1", "new", 7, LONG)
    assert await store.release("d1", "short") == 0
    assert not await store.resize("d1", "short", 1)
    assert await _usage(store, "d1") == DecodeUsage(10, 10, 2)


async def test_expired_id_reserves_afresh(store: StateStore) -> None:
    await store.set_capacity("d1", 10)
    assert await store.reserve("d1", "r1", 6, SHORT)
    await asyncio.sleep(EXPIRED_AFTER)
    assert await store.reserve("d1", "r1", 2, LONG)
    assert await _usage(store, "d1") == DecodeUsage(10, 2, 1)


async def test_renew_live_vs_expired(store: StateStore) -> None:
    await store.set_capacity("d1", 10)
    assert await store.reserve("d1", "live", 2, LONG)
    assert await store.reserve("d1", "dead", 3, SHORT)
    await asyncio.sleep(EXPIRED_AFTER)
    assert await store.renew("d1", "live", LONG)
    assert not await store.renew("d1", "dead", LONG)
    assert not await store.renew("d1", "never", LONG)
    assert await _usage(store, "d1") == DecodeUsage(10, 2, 1)


async def test_renew_extends_lease(clocked: tuple[StateStore, SteppedClock]) -> None:
    store, clock = clocked
    await store.set_capacity("d1", 10)
    assert await store.reserve("d1", "r1", 4, 10.0)
    clock.advance(8.0)
    assert await store.renew("d1", "r1", 10.0)
    clock.advance(8.0)  # 16 s after the reserve, 8 s after the renew
    assert await _usage(store, "d1") == DecodeUsage(10, 4, 1)
    assert await store.reserve("d1", "r1", 4, 10.0)  # a repeated reserve renews too
    clock.advance(9.5)
    assert await _usage(store, "d1") == DecodeUsage(10, 4, 1)
    clock.advance(0.5)  # expiry is inclusive: at exactly now == expiry the lease is gone
    assert await _usage(store, "d1") == DecodeUsage(10, 0, 0)
    assert await store.release("d1", "r1") == 0


async def test_usage_of_several_workers(store: StateStore) -> None:
    await store.set_capacity("d1", 10)
    await store.set_capacity("d2", 20)
    assert await store.reserve("d1", "a", 1, LONG)
    assert await store.reserve("d2", "a", 5, LONG)  # ids are per worker
    assert await store.decode_usage(["d1", "d2", "d3"]) == {
        "d1": DecodeUsage(10, 1, 1),
        "d2": DecodeUsage(20, 5, 1),
        "d3": DecodeUsage(0, 0, 0),
    }


async def test_concurrent_reserves_race_for_last_blocks(store: StateStore) -> None:
    await store.set_capacity("d1", 23)
    assert await store.reserve("d1", "first", 3, LONG)
    # 20 blocks left, 50 callers want 2 each: exactly 10 may win.
    results = await asyncio.gather(*(store.reserve("d1", f"r{i}", 2, LONG) for i in range(50)))
    assert sum(r.held for r in results) == 10
    assert await _usage(store, "d1") == DecodeUsage(23, 23, 11)
    released = await asyncio.gather(*(store.release("d1", f"r{i}") for i in range(50)))
    assert sorted(released) == [0] * 40 + [2] * 10
    assert await _usage(store, "d1") == DecodeUsage(23, 3, 1)


async def test_concurrent_resizes_never_overbook(store: StateStore) -> None:
    await store.set_capacity("d1", 30)
    for i in range(10):
        assert await store.reserve("d1", f"r{i}", 1, LONG)
    # 20 free blocks, 10 holders each want 4 more: exactly 5 may grow.
    grown = await asyncio.gather(*(store.resize("d1", f"r{i}", 5) for i in range(10)))
    assert sum(grown) == 5
    assert await _usage(store, "d1") == DecodeUsage(30, 30, 10)


# -- stranded KV ledger ----------------------------------------------------------------------


async def test_stranded_add_clear_sum(store: StateStore) -> None:
    await store.strand("p1", "a", 100)
    await store.strand("p1", "b", 200)
    await store.strand("p2", "c", 50)
    assert await store.stranded_bytes(["p1", "p2", "p3"]) == {"p1": 300, "p2": 50, "p3": 0}
    assert await store.unstrand("p1", "a") == 100
    assert await store.unstrand("p1", "a") == 0
    assert await store.unstrand("p1", "never") == 0
    await store.strand("p1", "b", 250)  # re-stranding updates the size, never counts twice
    assert await store.stranded_bytes(["p1"]) == {"p1": 250}
    assert await store.stranded_bytes([]) == {}


async def test_reap_removes_and_returns_old_entries(store: StateStore) -> None:
    await store.strand("p1", "a", 100)
    await store.strand("p1", "b", 200)
    assert await store.reap_stranded("p1", 3600.0) == []
    reaped = await store.reap_stranded("p1", 0.0)
    assert sorted((e.prefill_id, e.request_id, e.nbytes) for e in reaped) == [
        ("p1", "a", 100),
        ("p1", "b", 200),
    ]
    assert all(isinstance(e, StrandedEntry) and e.since_s > 0 for e in reaped)
    assert await store.stranded_bytes(["p1"]) == {"p1": 0}
    assert await store.reap_stranded("p1", 0.0) == []
    assert await store.unstrand("p1", "a") == 0


async def test_reap_by_age(clocked: tuple[StateStore, SteppedClock]) -> None:
    store, clock = clocked
    start = clock.now
    await store.strand("p1", "old", 100)
    clock.advance(20.0)
    await store.strand("p1", "young", 30)
    await store.strand("p1", "old", 120)  # a resize keeps the first `since`
    clock.advance(15.0)  # old is 35 s stranded, young 15 s
    reaped = await store.reap_stranded("p1", 30.0)
    assert [(e.request_id, e.nbytes) for e in reaped] == [("old", 120)]
    assert reaped[0].since_s == pytest.approx(start, abs=1e-5)
    assert await store.stranded_bytes(["p1"]) == {"p1": 30}
    clock.advance(15.0)
    assert [e.request_id for e in await store.reap_stranded("p1", 30.0)] == ["young"]
    assert await store.stranded_bytes(["p1"]) == {"p1": 0}


# -- the stranded-KV intent, written with the reservation --------------------------------------


def _intent(entry: str, nbytes: int = 100, within_s: float = 120.0) -> StrandIntent:
    return StrandIntent("p1", entry, nbytes, within_s)


async def test_a_held_reservation_writes_its_intent(store: StateStore) -> None:
    await store.set_capacity("d1", 10)
    reserved = await store.reserve("d1", "r1", 4, LONG, intent=_intent("q1", 100))
    assert reserved == Reserved(held=True, stranded=True) and reserved
    assert await store.stranded_bytes(["p1"]) == {"p1": 100}
    assert await _usage(store, "d1") == DecodeUsage(10, 4, 1)
    # A repeated reserve (a retried call) neither books nor strands twice.
    assert (await store.reserve("d1", "r1", 4, LONG, intent=_intent("q1", 100))).stranded
    assert await store.stranded_bytes(["p1"]) == {"p1": 100}
    assert await _usage(store, "d1") == DecodeUsage(10, 4, 1)
    # Cleared the usual ways: the end of the request's one call.
    done = await store.finish(release=("d1", "r1"), unstrand=("p1", "q1"))
    assert (done.released_blocks, done.unstranded_bytes) == (4, 100)
    assert await store.stranded_bytes(["p1"]) == {"p1": 0}


async def test_a_refused_reservation_leaves_no_intent_once_unstranded(store: StateStore) -> None:
    """One server and the memory store write the intent only with the blocks held; a cluster
    may have written it beside the refusal (`stranded`), which the caller then unstrands."""
    await store.set_capacity("d1", 3)
    refused = await store.reserve("d1", "r1", 4, LONG, intent=_intent("q1", 100))
    assert not refused and not refused.held
    on_cluster = isinstance(store, RedisStore) and store.is_cluster
    assert refused.stranded == on_cluster
    expected = 100 if refused.stranded else 0
    assert await store.stranded_bytes(["p1"]) == {"p1": expected}
    assert await store.unstrand("p1", "q1") == expected
    assert await store.stranded_bytes(["p1"]) == {"p1": 0}
    assert await _usage(store, "d1") == DecodeUsage(3, 0, 0)


async def test_a_pending_intent_outlives_its_prefill_and_the_kv_lease(
    clocked: tuple[StateStore, SteppedClock],
) -> None:
    """A pending entry's lease counts from the latest its prefill can answer (`ready_within_s`
    ahead): the reaper leaves it for the prefill's time plus the KV lease, not the lease alone."""
    store, clock = clocked
    await store.set_capacity("d1", 10)
    start = clock.now
    assert await store.reserve("d1", "r1", 1, LONG, intent=_intent("q1", 100, within_s=120.0))
    clock.advance(100.0)  # longer than the 30 s KV lease, but its prefill may still run
    assert await store.reap_stranded("p1", 30.0) == []
    assert await store.reap_stranded("p1", 0.0) == []  # not even a drain's reap takes it
    clock.advance(49.0)  # 149 s: 1 s short of 120 + 30
    assert await store.reap_stranded("p1", 30.0) == []
    clock.advance(1.5)
    reaped = await store.reap_stranded("p1", 30.0)
    assert [(e.request_id, e.nbytes) for e in reaped] == [("q1", 100)]
    assert reaped[0].since_s == pytest.approx(start + 120.0, abs=1e-5)
    assert await store.stranded_bytes(["p1"]) == {"p1": 0}


async def test_mark_ready_starts_the_kv_lease_when_the_prefill_answered(
    clocked: tuple[StateStore, SteppedClock],
) -> None:
    store, clock = clocked
    await store.set_capacity("d1", 10)
    assert await store.reserve("d1", "r1", 1, LONG, intent=_intent("q1", 100, within_s=120.0))
    clock.advance(2.0)  # the prefill answered at +2 s; marked at +3 s
    answered = clock.now
    clock.advance(1.0)
    assert await store.mark_ready("p1", "q1", age_s=1.0)
    clock.advance(28.5)  # 29.5 s after the answer
    assert await store.reap_stranded("p1", 30.0) == []
    clock.advance(1.0)  # 30.5 s after the answer
    reaped = await store.reap_stranded("p1", 30.0)
    assert [e.request_id for e in reaped] == ["q1"]
    assert reaped[0].since_s == pytest.approx(answered, abs=1e-5)


async def test_mark_ready_never_brings_back_an_unstranded_entry(store: StateStore) -> None:
    """The mark and the unstrand are separate background calls: in whichever order they land,
    no entry is left behind."""
    await store.set_capacity("d1", 10)
    assert await store.reserve("d1", "r1", 1, LONG, intent=_intent("q1", 100))
    assert await store.unstrand("p1", "q1") == 100
    assert not await store.mark_ready("p1", "q1")
    assert not await store.mark_ready("p1", "never")
    assert await store.stranded_bytes(["p1"]) == {"p1": 0}
    assert await store.reap_stranded("p1", -1e9) == []  # nothing hidden in the since zset


async def test_strand_with_an_age_or_a_pending_time(
    clocked: tuple[StateStore, SteppedClock],
) -> None:
    """`ready_in_s` puts an entry back as it was (a store that lost its data): ready some
    seconds ago, or still pending."""
    store, clock = clocked
    now = clock.now
    await store.strand("p1", "ready", 10, ready_in_s=-12.0)
    await store.strand("p1", "pending", 20, ready_in_s=50.0)
    assert await store.stranded_bytes(["p1"]) == {"p1": 30}
    clock.advance(18.5)  # ready is 30.5 s old, pending not ready for 31.5 s more
    reaped = await store.reap_stranded("p1", 30.0)
    assert [(e.request_id, e.since_s) for e in reaped] == [("ready", pytest.approx(now - 12.0))]
    clock.advance(62.0)
    assert [e.request_id for e in await store.reap_stranded("p1", 30.0)] == ["pending"]


async def test_intent_arguments_are_checked(store: StateStore) -> None:
    await store.set_capacity("d1", 10)
    with pytest.raises(ValueError):
        await store.reserve("d1", "r1", 1, LONG, intent=_intent("q1", -1))
    with pytest.raises(ValueError):
        await store.reserve("d1", "r1", 1, LONG, intent=StrandIntent("p{1}", "q1", 1, 1.0))
    assert await _usage(store, "d1") == DecodeUsage(10, 0, 0)  # a refused call books nothing


# -- retry budget ------------------------------------------------------------------------------


async def test_retry_budget_is_a_fraction_of_requests(store: StateStore) -> None:
    policy = RetryBudgetPolicy(ratio=0.2, min_per_s=0.0, window_s=10.0)
    assert not await store.try_retry(policy)  # nothing sent yet, no floor: no retry
    for _ in range(100):
        await store.note_request()
    allowed = [await store.try_retry(policy) for _ in range(30)]
    assert sum(allowed) == 20
    assert allowed[:20] == [True] * 20  # once spent, it stays spent


async def test_retry_budget_floor_without_requests(store: StateStore) -> None:
    policy = RetryBudgetPolicy(ratio=0.2, min_per_s=10.0, window_s=10.0)
    allowed = [await store.try_retry(policy) for _ in range(120)]
    assert sum(allowed) == 100


async def test_retry_budget_window_slides(clocked: tuple[StateStore, SteppedClock]) -> None:
    store, clock = clocked
    policy = RetryBudgetPolicy(ratio=0.5, min_per_s=0.0, window_s=10.0)
    for _ in range(10):
        await store.note_request()
    assert sum([await store.try_retry(policy) for _ in range(8)]) == 5
    clock.advance(9.0)  # still inside the 10 s window
    assert not await store.try_retry(policy)
    for _ in range(2):
        await store.note_request()
    assert await store.try_retry(policy)  # 12 requests -> 6 retries
    assert not await store.try_retry(policy)
    clock.advance(1.0)  # the first second's 10 requests and 5 retries leave the window
    assert not await store.try_retry(policy)  # 2 requests -> 1 retry, already spent
    clock.advance(9.0)
    assert not await store.try_retry(policy)  # everything aged out: 0 requests, no floor
    await store.note_request()
    await store.note_request()
    assert await store.try_retry(policy)


async def test_retry_budget_rejects_bad_policies(store: StateStore) -> None:
    with pytest.raises(ValueError):
        await store.try_retry(RetryBudgetPolicy(window_s=0.0))
    with pytest.raises(ValueError):
        await store.try_retry(RetryBudgetPolicy(window_s=3600.0))
    with pytest.raises(ValueError):
        await store.try_retry(RetryBudgetPolicy(ratio=-1.0))


# -- output-length histograms ------------------------------------------------------------------


async def test_output_histograms(store: StateStore) -> None:
    await store.record_output(["model:m1", "model:m1|prompt:2"], 3)
    await store.record_output(["model:m1", "model:m1|prompt:2"], 3)
    await store.record_output(["model:m1"], 5)
    await store.record_output([], 7)
    hist = await store.output_histograms(["model:m1", "model:m1|prompt:2", "model:none"])
    assert {k: dict(v) for k, v in hist.items()} == {
        "model:m1": {3: 2, 5: 1},
        "model:m1|prompt:2": {3: 2},
        "model:none": {},
    }
    assert await store.output_histograms([]) == {}


# -- argument checks ---------------------------------------------------------------------------


async def test_bad_arguments_are_rejected_alike(store: StateStore) -> None:
    with pytest.raises(ValueError):
        await store.set_capacity("d{1}", 10)  # a brace would break the hash tag
    with pytest.raises(ValueError):
        await store.set_capacity("", 10)
    with pytest.raises(ValueError):
        await store.set_capacity("d1", -1)
    with pytest.raises(ValueError):
        await store.reserve("d1", "r1", -1, LONG)
    with pytest.raises(ValueError):
        await store.reserve("d1", "r1", 1, 0.0)
    with pytest.raises(ValueError):
        await store.strand("p1", "a", -5)
    with pytest.raises(ValueError):
        await store.record_output(["a}"], 1)


# -- the two stores agree ------------------------------------------------------------------------


async def test_memory_and_redis_agree_on_random_operations(
    redis_client: aioredis.Redis | RedisCluster, prefix: str
) -> None:
    keys = Keys(prefix)
    stores: list[StateStore] = [MemoryStore(), RedisStore(redis_client, keys)]
    rng = random.Random(20240517)
    outcomes: dict[tuple[str, bool], int] = {}
    workers = ["d1", "d2"]
    for w in workers:
        for s in stores:
            await s.set_capacity(w, 40)
    for step in range(300):
        w = rng.choice(workers)
        rid = f"r{rng.randrange(12)}"
        op = rng.choice(["reserve", "reserve", "resize", "release", "renew", "capacity"])
        results: list[object]
        if op == "reserve":
            n = rng.randrange(12)
            results = [await s.reserve(w, rid, n, LONG) for s in stores]
        elif op == "resize":
            n = rng.randrange(16)
            results = [await s.resize(w, rid, n) for s in stores]
        elif op == "release":
            results = [await s.release(w, rid) for s in stores]
        elif op == "renew":
            results = [await s.renew(w, rid, LONG) for s in stores]
        else:
            n = rng.randrange(20, 60)
            for s in stores:
                await s.set_capacity(w, n)
            results = [n, n]
        assert results[0] == results[1], (step, op, w, rid, results)
        outcomes[(op, bool(results[0]))] = outcomes.get((op, bool(results[0])), 0) + 1
        usages = [await s.decode_usage(workers) for s in stores]
        assert usages[0] == usages[1], (step, op, usages)
    # The walk saw both outcomes of every conditional operation, so it compared something.
    for op in ("reserve", "resize", "release", "renew"):
        assert outcomes.get((op, True)) and outcomes.get((op, False)), outcomes
    # The running sum the scripts keep equals the blocks actually held.
    for w in workers:
        held = sum(int(v) for v in await redis_client.hvals(keys.decode_blocks(w)))
        assert int(await redis_client.get(keys.decode_sum(w)) or 0) == held


# -- Redis specifics -----------------------------------------------------------------------------


async def test_two_replicas_share_reservations_and_budget(prefix: str) -> None:
    a = RedisStore.from_url(REDIS_URL, prefix)
    b = RedisStore.from_url(REDIS_URL, prefix)
    try:
        await a.set_capacity("d1", 10)
        assert await a.reserve("d1", "from-a", 6, LONG)
        assert await _usage(b, "d1") == DecodeUsage(10, 6, 1)
        assert not await b.reserve("d1", "from-b", 5, LONG)
        assert await b.release("d1", "from-a") == 6  # any replica may release
        assert await a.release("d1", "from-a") == 0
        assert await b.reserve("d1", "from-b", 5, LONG)

        policy = RetryBudgetPolicy(ratio=0.2, min_per_s=0.0, window_s=10.0)
        for _ in range(10):
            await a.note_request()
        assert await b.try_retry(policy)
        assert await a.try_retry(policy)
        assert not await b.try_retry(policy)  # 10 requests -> 2 retries, spent across replicas

        await a.strand("p1", "x", 64)
        assert await b.stranded_bytes(["p1"]) == {"p1": 64}
        await b.record_output(["c"], 2)
        assert await a.output_histograms(["c"]) == {"c": {2: 1}}
    finally:
        await a.close()
        await b.close()
        async with _redis(prefix):
            pass  # deletes the prefix's keys


async def test_each_script_touches_one_cluster_slot(
    redis_client: aioredis.Redis | RedisCluster, prefix: str
) -> None:
    store = RedisStore(redis_client, Keys(prefix))
    await store.set_capacity("d1", 10)
    await store.reserve("d1", "r", 1, LONG)
    await store.set_capacity("d2", 10)
    await store.reserve("d2", "r", 1, LONG)
    await store.strand("p1", "x", 1)
    # The reservation with its intent: one script on one server, two on a cluster.
    assert (await store.reserve("d1", "r2", 1, LONG, intent=StrandIntent("p2", "y", 1, 9.0))).held
    assert await store.mark_ready("p2", "y")
    await store.note_request()
    await store.try_retry(RetryBudgetPolicy())
    await store.record_output(["c1", "c2"], 1)
    found = sorted([k.decode() async for k in redis_client.scan_iter(match=f"{prefix}*")])
    by_tag: dict[str, set[int]] = {}
    for key in found:
        tag = key[key.index("{") + 1 : key.index("}")]
        by_tag.setdefault(tag, set()).add(key_slot(key.encode()))
    assert sorted(by_tag) == ["d:d1", "d:d2", "os:c1", "os:c2", "p:p1", "p:p2", "rb"]
    assert all(len(slots) == 1 for slots in by_tag.values()), by_tag
    assert len(found) == 4 + 4 + 3 + 3 + 2 + 2


async def test_retry_buckets_expire_when_quiet(
    redis_client: aioredis.Redis | RedisCluster, prefix: str
) -> None:
    keys = Keys(prefix)
    store = RedisStore(redis_client, keys)
    await store.note_request()
    assert await store.try_retry(RetryBudgetPolicy())
    for key in (keys.retry_requests, keys.retry_retries):
        assert 0 < await redis_client.ttl(key) <= RETRY_TTL_S


async def test_retry_buckets_pruned_past_retention(
    redis_client: aioredis.Redis | RedisCluster, prefix: str
) -> None:
    clock = SteppedClock()
    keys = Keys(prefix)
    store = RedisStore(redis_client, keys, clock=clock)
    for _ in range(3):
        await store.note_request()
        clock.advance(30.0)
    # Buckets at t, t+30, t+60: the one at t is a whole retention old once t+60 lands.
    assert await redis_client.hlen(keys.retry_requests) == 2


async def test_open_store_picks_the_implementation(prefix: str) -> None:
    assert isinstance(await open_store(None), MemoryStore)
    assert isinstance(await open_store(""), MemoryStore)
    store = await open_store(REDIS_URL, prefix)
    try:
        assert isinstance(store, RedisStore)
        assert await store.ping()
        assert redact_url(REDIS_URL) in repr(store)  # where it is, as the repr writes it
    finally:
        await store.close()
    with pytest.raises(ValueError, match="http://"):
        await open_store("http://127.0.0.1:6379")


async def test_open_store_names_an_unreachable_url_without_its_password() -> None:
    url = "redis://user:s3cret@127.0.0.1:1/0?socket_connect_timeout=2"
    with pytest.raises(StoreUnavailableError) as info:
        await open_store(url)
    message = str(info.value)
    assert "127.0.0.1:1" in message
    assert "user:***@" in message
    assert "s3cret" not in message
    assert info.value.__cause__ is not None  # the client's own error stays attached


def test_redact_url() -> None:
    assert redact_url("unix:///run/redis.sock?db=1") == "unix:///run/redis.sock?db=1"
    assert redact_url("rediss://:pw@h:6380/0") == "rediss://:***@h:6380/0"
    assert redact_url("redis://h/0?password=pw&db=2") == "redis://h/0?password=***&db=2"


async def test_redis_store_repr_hides_the_password() -> None:
    store = RedisStore.from_url("redis://:hunter2@127.0.0.1:6379/0?password=hunter2")
    try:
        text = repr(store)
    finally:
        await store.close()
    assert "hunter2" not in text
    assert "prefix='dr:'" in text


async def test_overbooking_counts_forecast_room(store: StateStore) -> None:
    await store.set_capacity("d-ob", 10)
    assert await store.reserve("d-ob", "a", 8, 30.0)
    assert not await store.reserve("d-ob", "b", 5, 30.0)  # 2 free now
    assert await store.reserve("d-ob", "b", 5, 30.0, overbook_blocks=3)  # 3 forecast to free
    assert not await store.reserve("d-ob", "c", 1, 30.0, overbook_blocks=0)
    assert (await store.decode_usage(["d-ob"]))["d-ob"].reserved_blocks == 13
    assert await store.release("d-ob", "a") == 8
    assert await store.release("d-ob", "b") == 5


async def test_worker_registry_is_shared(store: StateStore) -> None:
    assert await store.registered_workers() == {}
    await store.register_worker("w1", '{"id": "w1"}')
    await store.register_worker("w2", '{"id": "w2"}')
    await store.register_worker("w1", '{"id": "w1", "v": 2}')
    assert await store.registered_workers() == {"w1": '{"id": "w1", "v": 2}', "w2": '{"id": "w2"}'}
    assert await store.unregister_worker("w1") is True
    assert await store.unregister_worker("w1") is False
    assert await store.registered_workers() == {"w2": '{"id": "w2"}'}
    assert await store.unregister_worker("w2") is True


async def test_drained_workers_are_shared(store: StateStore) -> None:
    assert await store.drained_workers() == set()
    assert await store.set_drained("d1", True) is True
    assert await store.set_drained("d1", True) is False  # already drained
    assert await store.set_drained("p1", True) is True
    assert await store.drained_workers() == {"d1", "p1"}
    assert await store.set_drained("d1", False) is True
    assert await store.set_drained("d1", False) is False
    assert await store.drained_workers() == {"p1"}
    assert await store.set_drained("p1", False) is True
    assert await store.drained_workers() == set()
    with pytest.raises(ValueError):
        await store.set_drained("bad{id}", True)


# -- hardening: batched renewal, forced growth, the end-of-request call, the loss marker ------


async def test_renew_many_renews_and_puts_back_what_was_lost(
    clocked: tuple[StateStore, SteppedClock],
) -> None:
    store, clock = clocked
    await store.set_capacity("d1", 10)
    assert await store.reserve("d1", "r1", 4, 10.0)
    assert await store.reserve("d1", "r2", 6, 10.0)
    clock.advance(8.0)
    # r1 renewed; r2 released behind our back (as by a store that restarted empty); r3 unknown
    # with 0 blocks is not invented.
    assert await store.release("d1", "r2") == 6
    assert await store.reserve("d1", "other", 5, 10.0)
    back = await store.renew_many("d1", {"r1": 4, "r2": 6, "r3": 0}, 10.0)
    assert back == ["r2"]
    clock.advance(8.0)  # past r1's first lease: it lives because it was renewed
    # r1 + r2 + other: over capacity, but true (r2's sequence occupies the worker).
    assert await _usage(store, "d1") == DecodeUsage(10, 15, 3)
    assert await store.renew_many("d1", {}, 10.0) == []


async def test_forced_growth_follows_use_past_capacity(store: StateStore) -> None:
    await store.set_capacity("d1", 10)
    assert await store.reserve("d1", "r1", 8, LONG)
    assert not await store.resize("d1", "r1", 12)
    assert await store.resize("d1", "r1", 12, force=True)
    assert await _usage(store, "d1") == DecodeUsage(10, 12, 1)
    assert not await store.resize("d1", "gone", 3, force=True)  # never invents a reservation


async def test_finish_releases_unstrands_and_records_in_one_call(store: StateStore) -> None:
    await store.set_capacity("d1", 10)
    assert await store.reserve("d1", "r1", 7, LONG)
    await store.strand("p1", "q1", 1000)
    done = await store.finish(("d1", "r1"), ("p1", "q1"), (["c1", "c2"], 3))
    assert done.complete
    assert (done.released_blocks, done.unstranded_bytes, done.recorded) == (7, 1000, True)
    assert await _usage(store, "d1") == DecodeUsage(10, 0, 0)
    assert await store.stranded_bytes(["p1"]) == {"p1": 0}
    assert await store.output_histograms(["c1", "c2"]) == {"c1": {3: 1}, "c2": {3: 1}}
    again = await store.finish(("d1", "r1"), ("p1", "q1"))
    assert (again.released_blocks, again.unstranded_bytes) == (0, 0)
    assert (await store.finish()).complete


async def test_finish_step_failures_do_not_stop_the_others(
    redis_client: aioredis.Redis | RedisCluster, prefix: str
) -> None:
    """A step that fails in Redis (here: a key of the wrong type) is reported as failed while
    the other steps still happen: the reservation is freed whatever the ledger does."""
    store = RedisStore(redis_client, Keys(prefix))
    keys = Keys(prefix)
    await store.set_capacity("d1", 10)
    assert await store.reserve("d1", "r1", 7, LONG)
    await redis_client.set(keys.stranded_bytes("p1"), "not a hash")
    await redis_client.set(keys.output_stats("c1"), "not a hash")
    done = await store.finish(("d1", "r1"), ("p1", "q1"), (["c1"], 3))
    assert done.released_blocks == 7
    assert done.unstranded_bytes is None and not done.recorded and not done.complete
    assert await _usage(store, "d1") == DecodeUsage(10, 0, 0)

    await store.strand("p2", "q2", 50)
    await redis_client.set(keys.decode_blocks("d2"), "not a hash")
    done = await store.finish(("d2", "r2"), ("p2", "q2"))
    assert done.released_blocks is None and done.unstranded_bytes == 50


async def test_note_request_counts_in_batches(clocked: tuple[StateStore, SteppedClock]) -> None:
    store, _ = clocked
    policy = RetryBudgetPolicy(ratio=0.5, min_per_s=0.0, window_s=10.0)
    await store.note_request(10)
    await store.note_request(0)
    allowed = [await store.try_retry(policy) for _ in range(7)]
    assert allowed == [True] * 5 + [False] * 2


async def test_marker_reveals_a_store_that_lost_its_data(
    clocked: tuple[StateStore, SteppedClock],
) -> None:
    store, clock = clocked
    assert await store.check_marker(30.0)  # first use
    assert not await store.check_marker(30.0)
    clock.advance(5.0)
    assert not await store.check_marker(30.0)


async def test_marker_missing_after_redis_lost_the_keys(
    redis_client: aioredis.Redis | RedisCluster, prefix: str
) -> None:
    store = RedisStore(redis_client, Keys(prefix))
    assert await store.check_marker(30.0)
    assert not await store.check_marker(30.0)
    assert 0 < await redis_client.ttl(Keys(prefix).marker) <= 30
    await _delete_prefix(redis_client, prefix)  # what a restart with no persistence does
    assert await store.check_marker(30.0)


async def test_store_failures_are_store_errors() -> None:
    """An unreachable Redis surfaces as StoreError from every call (the router's 503)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    store = RedisStore.from_url(f"redis://127.0.0.1:{port}/0?socket_connect_timeout=0.5")
    try:
        with pytest.raises(StoreError):
            await store.reserve("d1", "r1", 1, LONG)
        with pytest.raises(StoreError):
            await store.finish(("d1", "r1"))
        with pytest.raises(StoreError):
            await store.renew_many("d1", {"r1": 1}, LONG)
        with pytest.raises(StoreError):
            await store.check_marker(30.0)
    finally:
        await store.close()


async def test_a_full_connection_pool_waits_instead_of_failing(prefix: str) -> None:
    """redis-py's default asyncio pool raises MaxConnectionsError past its cap; the store's
    pool makes the excess wait for a connection, so a burst larger than the pool succeeds."""
    store = RedisStore.from_url(REDIS_URL, prefix, max_connections=4, pool_timeout_s=10.0)
    try:
        await store.set_capacity("d1", 10_000)
        results = await asyncio.gather(*(store.reserve("d1", f"r{i}", 1, LONG) for i in range(300)))
        assert all(results)
        assert (await _usage(store, "d1")).reserved_blocks == 300
    finally:
        async with _redis(prefix):
            pass
        await store.close()


# -- roles of `both` workers (docs/elastic-roles.md, "Live") --------------------------------


async def test_role_changes_are_versioned_compare_and_set(store: StateStore) -> None:
    assert await store.worker_roles() == {}
    first = await store.set_role("b1", "decode", 0)
    assert first is not None and (first.role, first.version) == ("decode", 1)
    assert await store.set_role("b1", "prefill", 0) is None  # stale version: nothing written
    moving = await store.set_role("b1", "draining-to-prefill", 1)
    assert moving is not None and moving.draining and moving.target == "prefill"
    assert moving.version == 2 and moving.since_s >= first.since_s
    roles = await store.worker_roles()
    assert set(roles) == {"b1"} and roles["b1"] == moving
    assert await store.forget_role("b1") is True
    assert await store.forget_role("b1") is False
    assert await store.worker_roles() == {}
    with pytest.raises(ValueError):
        await store.set_role("b1", "sideways", 0)
    with pytest.raises(ValueError):
        await store.set_role("bad{id}", "decode", 0)


async def test_concurrent_role_changes_flip_a_worker_once(store: StateStore) -> None:
    await store.set_role("b1", "decode", 0)
    # Two replicas saw version 1 and both try to move the worker: exactly one wins.
    results = await asyncio.gather(
        *(store.set_role("b1", "draining-to-prefill", 1) for _ in range(8))
    )
    assert sum(1 for r in results if r is not None) == 1
    assert (await store.worker_roles())["b1"].version == 2


async def test_role_changes_carry_the_store_clock(
    clocked: tuple[StateStore, SteppedClock],
) -> None:
    store, clock = clocked
    rec = await store.set_role("b1", "prefill", 0)
    assert rec is not None and rec.since_s == pytest.approx(clock.now, abs=1e-5)
    clock.advance(7.5)
    rec = await store.set_role("b1", "draining-to-decode", 1)
    assert rec is not None and rec.since_s == pytest.approx(clock.now, abs=1e-5)


async def test_a_lease_has_one_holder_until_it_expires_or_is_released(
    store: StateStore,
) -> None:
    assert await store.hold_lease("roles", "a", SHORT) is True
    assert await store.hold_lease("roles", "a", SHORT) is True  # the holder extends it
    assert await store.hold_lease("roles", "b", LONG) is False
    await asyncio.sleep(EXPIRED_AFTER)
    assert await store.hold_lease("roles", "b", LONG) is True  # a's lapsed
    assert await store.release_lease("roles", "a") is False  # not a's to give back
    assert await store.release_lease("roles", "b") is True
    assert await store.hold_lease("roles", "a", LONG) is True
    assert await store.release_lease("roles", "a") is True
    with pytest.raises(ValueError):
        await store.hold_lease("roles", "a", 0)


# -- the hold-back after a capacity is written again (docs/reliability.md row 16) ----------------


async def test_a_capacity_written_again_holds_new_reservations_back_but_not_put_backs(
    clocked: tuple[StateStore, SteppedClock],
) -> None:
    """The worker's keys go (here: deleted; a Redis restarted empty alike) under a live
    reservation; the capacity written again by a store object that wrote it before holds new
    reservations back for the agreed round plus its margin (4 + 2 s), while the live one's
    put-back lands. Refused as no room (`Reserved(False)`), so the request waits."""
    store, clock = clocked
    store.advertise_renewal(4.0)
    await store.check_marker(60.0)
    await store.set_capacity("d", 100)
    assert await store.reserve("d", "live", 40, LONG)  # a first write holds nothing back
    await store.unregister_worker("d")
    await store.set_capacity("d", 100)
    assert await store.reserve("d", "new", 10, LONG) == Reserved(False)
    assert await store.renew_many("d", {"live": 40}, LONG) == ["live"]
    assert await store.reserve("d", "live", 40, LONG)  # held already: a renewal, not new room
    assert not await store.resize("d", "live", 50)  # growth is new room too
    assert await store.resize("d", "live", 50, force=True)  # unless the tokens are there
    clock.advance(5.9)
    assert not await store.reserve("d", "new", 10, LONG)
    clock.advance(0.2)
    assert await store.reserve("d", "new", 10, LONG)
    assert await _usage(store, "d") == DecodeUsage(100, 60, 2)


async def test_a_capacity_the_store_still_has_holds_nothing_back(
    clocked: tuple[StateStore, SteppedClock],
) -> None:
    """Another replica starting, or a capacity changed: no loss, no hold-back."""
    store, _ = clocked
    store.advertise_renewal(4.0)
    await store.check_marker(60.0)
    await store.set_capacity("d", 100)
    await store.set_capacity("d", 120)
    assert await store.reserve("d", "a", 120, LONG)


async def test_after_a_loss_the_hold_back_is_the_slowest_replicas_round(
    redis_client: aioredis.Redis | RedisCluster, prefix: str
) -> None:
    """Issue 31: two replicas on different lease settings, A renewing every 9 s at most, B
    every 2 s. Redis restarts empty; B finds it first and writes the capacity back: it holds
    new reservations back for A's round (9 + 4.5 s), which it read from the store before the
    loss, not for its own (2 + 1 s). A second loss before A has published again holds as
    long: B published what it remembered when it found the marker missing."""
    clock = SteppedClock()
    a = RedisStore(redis_client, Keys(prefix), clock=clock)
    b = RedisStore(redis_client, Keys(prefix), clock=clock)
    a.advertise_renewal(9.0)
    b.advertise_renewal(2.0)
    for replica in (a, b, b):
        await replica.check_marker(60.0)
    for replica in (a, b):
        await replica.set_capacity("d", 100)
    assert await a.reserve("d", "a-stream", 40, LONG)
    for _ in range(2):
        await _delete_prefix(redis_client, prefix)  # restarted empty
        assert await b.check_marker(60.0)
        await b.set_capacity("d", 100)
        assert not await b.reserve("d", "b-new", 60, LONG)
        clock.advance(13.4)
        assert not await b.reserve("d", "b-new", 60, LONG)
        assert await a.renew_many("d", {"a-stream": 40}, LONG) == ["a-stream"]
        clock.advance(0.2)
        assert not await b.reserve("d", "b-new", 61, LONG)  # A's 40 are back: 60 free
        assert await b.reserve("d", "b-new", 60, LONG)
        assert await _usage(b, "d") == DecodeUsage(100, 100, 2)
        assert await b.release("d", "b-new") == 60
        assert await b.check_marker(60.0) is False  # B's next check: A has not published again
