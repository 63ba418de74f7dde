"""What a store loss and a worker's delete leave, on both stores (memory, Redis, Redis Cluster):
the conformance fixtures of tests/state/test_state_conformance.py, the same assertions for each.

- `unregister_worker` deletes every key named after the worker, and its field in every
  registry hash and set, listed with SCAN (Redis) or by walking the store's maps (memory);
- drain marks keep undrains with their time; `restore_registry` keeps the freshest of the
  replicas' views (a later mark, a higher role version), whichever replica writes first;
- on Redis, every store object (one per replica) learns of a loss from the marker, not only
  the first to look.
"""

from __future__ import annotations

from typing import Any

import pytest
import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster

from state import Keys, MemoryStore, RedisStore, StateStore
from state.base import DrainMark, StrandIntent, WorkerRole
from tests.state.test_state_conformance import (
    SteppedClock,
    _delete_prefix,
    clocked,
    prefix,
    redis_client,
    redis_cluster,
    store,
)

__all__ = ["clocked", "prefix", "redis_client", "redis_cluster", "store"]  # fixtures

LONG = 60.0


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


async def _redis_traces(store: RedisStore, worker_id: str) -> set[str]:
    """Every trace of `worker_id` under the store's prefix: a key whose name holds the id, or a
    hash field / set or zset member equal to it ("key" or "key[field]")."""
    client = store._client
    found: set[str] = set()
    async for raw in client.scan_iter(match=f"{store.keys.prefix}*", count=500):
        key = _text(raw)
        if f"{{d:{worker_id}}}" in key or f"{{p:{worker_id}}}" in key:
            found.add(key)
            continue
        kind = _text(await client.type(key))
        members: list[Any] = []
        if kind == "hash":
            members = list(await client.hkeys(key))
        elif kind == "set":
            members = list(await client.smembers(key))
        elif kind == "zset":
            members = list(await client.zrange(key, 0, -1))
        if worker_id in {_text(m) for m in members}:
            found.add(f"{key}[{worker_id}]")
    return found


def _memory_traces(store: MemoryStore, worker_id: str) -> set[str]:
    """The memory store's equivalent: every map or set it keeps that holds the id."""
    found: set[str] = set()
    for name, value in vars(store).items():
        if isinstance(value, dict | set) and worker_id in value:
            found.add(f"{name}[{worker_id}]")
    return found


async def _traces(store: StateStore, worker_id: str) -> set[str]:
    if isinstance(store, RedisStore):
        return await _redis_traces(store, worker_id)
    assert isinstance(store, MemoryStore)
    return _memory_traces(store, worker_id)


async def _leave_every_trace(store: StateStore, wid: str) -> None:
    """A `both` worker with a bit of everything: registration, capacity, a reservation with
    its stranded intent, a stranded entry, a drain, a role."""
    await store.register_worker(wid, f'{{"id": "{wid}", "role": "both"}}')
    await store.set_capacity(wid, 100)
    intent = StrandIntent(wid, f"{wid}-q1", 4096, 30.0)
    assert (await store.reserve(wid, f"{wid}-r1", 10, LONG, intent=intent)).held
    await store.strand(wid, f"{wid}-q2", 512)
    assert await store.set_drained(wid, True)
    assert await store.set_role(wid, "prefill", 0) is not None


async def test_unregistering_a_worker_deletes_every_key_it_had(store: StateStore) -> None:
    for wid in ("w9", "w8"):
        await _leave_every_trace(store, wid)
    before = await _traces(store, "w9")
    if isinstance(store, RedisStore):
        k = store.keys
        expected = {*k.decode_worker("w9"), *k.stranded_worker("w9")}
        expected |= {f"{key}[w9]" for key in k.registry_fields()}
        assert before == expected
    else:
        assert {"_decode[w9]", "_ledgers[w9]", "_registry[w9]", "_roles[w9]"} <= before
    other_before = await _traces(store, "w8")

    assert await store.unregister_worker("w9") is True
    assert await _traces(store, "w9") == set()
    assert await _traces(store, "w8") == other_before  # the other worker keeps all of its own
    # What the reads answer agrees.
    assert "w9" not in await store.registered_workers()
    assert "w9" not in await store.drained_workers()
    assert "w9" not in await store.drain_marks()
    assert "w9" not in await store.worker_roles()
    assert (await store.decode_usage(["w9"]))["w9"].capacity_blocks == 0
    assert (await store.stranded_bytes(["w9"]))["w9"] == 0
    # A request still on it ends cleanly: nothing left to release.
    assert await store.release("w9", "w9-r1") == 0
    assert await store.unregister_worker("w9") is False


async def test_drain_marks_keep_undrains_with_their_time(
    clocked: tuple[StateStore, SteppedClock],
) -> None:
    store, clock = clocked
    assert await store.drain_marks() == {}
    assert await store.set_drained("d1", True)
    drained_at = clock.now
    clock.advance(3.0)
    assert not await store.set_drained("d1", True)  # no change: the first time stays
    marks = await store.drain_marks()
    assert marks["d1"].drained and marks["d1"].since_s == pytest.approx(drained_at, abs=1e-5)
    assert await store.set_drained("d1", False)
    marks = await store.drain_marks()
    assert marks == {"d1": DrainMark(False, pytest.approx(clock.now, abs=1e-5))}  # type: ignore[arg-type]
    assert await store.drained_workers() == set()


async def test_a_put_back_keeps_the_freshest_view_whoever_writes_first(store: StateStore) -> None:
    """Replica A last saw d1 drained (at 100) and b1 as prefill v3; replica B saw d1 undrained
    later (at 200) and b1 at v4. Whichever order they put back in, the store ends with B's."""
    stale_drains = {"d1": DrainMark(True, 100.0), "d2": DrainMark(True, 50.0)}
    fresh_drains = {"d1": DrainMark(False, 200.0)}
    stale_roles = {"b1": WorkerRole("prefill", 3, 90.0)}
    fresh_roles = {"b1": WorkerRole("draining-to-decode", 4, 190.0)}
    for order in ("stale first", "fresh first"):
        views = [(stale_drains, stale_roles), (fresh_drains, fresh_roles)]
        if order == "fresh first":
            views.reverse()
        for drains, roles in views:
            await store.restore_registry(drains, roles)
        assert await store.drained_workers() == {"d2"}, order  # d2: only A knew, A's stands
        marks = await store.drain_marks()
        assert marks["d1"] == DrainMark(False, pytest.approx(200.0)), order  # type: ignore[arg-type]
        roles_now = await store.worker_roles()
        assert roles_now["b1"].role == "draining-to-decode" and roles_now["b1"].version == 4
        assert roles_now["b1"].since_s == pytest.approx(190.0)
        # The restored role continues its versions: the next change is a CAS on 4.
        assert await store.set_role("b1", "decode", 3) is None
        assert (await store.set_role("b1", "decode", 4)) is not None
        for wid in ("d1", "d2", "b1"):
            await store.unregister_worker(wid)
    # A change made after the loss (later than every put-back) is never undone by one.
    assert await store.set_drained("d3", True)
    await store.restore_registry({"d3": DrainMark(False, 1.0)}, {})
    assert await store.drained_workers() == {"d3"}
    await store.restore_registry({}, {})  # nothing to put back: a no-op
    with pytest.raises(ValueError):
        await store.restore_registry({"bad{id}": DrainMark(True, 1.0)}, {})
    with pytest.raises(ValueError):
        await store.restore_registry({}, {"b1": WorkerRole("sideways", 1, 1.0)})


async def test_every_replica_learns_of_a_loss_not_only_the_first_to_look(
    redis_client: aioredis.Redis | RedisCluster, prefix: str
) -> None:
    """Two replicas' store objects on one Redis: after the keys are gone, the first check of
    each says so (before, the second to look saw the first's marker and knew of nothing)."""
    a, b = (RedisStore(redis_client, Keys(prefix)) for _ in "ab")
    assert await a.check_marker(30.0)  # first use
    assert not await b.check_marker(30.0)  # b's first look: a's marker, no loss known
    assert not await a.check_marker(30.0) and not await b.check_marker(30.0)
    await _delete_prefix(redis_client, prefix)  # what a restart with no persistence does
    assert await a.check_marker(30.0)  # missing
    assert (await b.registry_view(30.0))[0]  # re-created by a since b looked: a loss
    assert not await a.check_marker(30.0) and not (await b.registry_view(30.0))[0]
    # A second loss shows again to both, whichever looks first.
    await _delete_prefix(redis_client, prefix)
    assert (await b.registry_view(30.0))[0]
    assert await a.check_marker(30.0)
    assert not await a.check_marker(30.0) and not await b.check_marker(30.0)
