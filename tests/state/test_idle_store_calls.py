"""An idle router's store calls (issues 24 and 36): none while quiet, and nothing it promised is
weaker.

- `StateStore.registry_and_usage_view`, a quiet replica's one read (its registry sync's, the
  state refresher's taken along), answers what `registry_view` and `usage_view` answer, marker
  semantics included, on `MemoryStore`, the session's real Redis and the private Redis Cluster
  (tests/redis_cluster.py).
- A router in front of four simulated workers (2 prefill, 2 decode), on the real Redis, no
  traffic: its calls are counted on the server (``MONITOR``, the commands under its key
  prefix sent by a client, not those a script runs): none at all over 3 s once quiet, its
  registry sync blocked on the registry's change feed (router/workers/registry.py). Before
  issue 24 it was nine a second, before issue 36 one.
- While it is quiet, what the docs promise still holds: a Redis restarted empty is noticed and
  put back within a registry refresh of its return (docs/reliability.md rows 3 and 9: the feed's
  connection breaks); keys lost on a running Redis (nothing closes a connection) within
  `registry_quiet_wait_s`; a drain made on another replica is applied within a registry
  refresh (the feed); another replica's reservation shows once a request arrives.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import orjson
import redis.asyncio as aioredis

from state import Keys, MemoryStore, RedisStore, StateStore
from tests.conftest import MODEL, REDIS_URL, SimCluster, sim_cluster
from tests.redis_server import PrivateRedis
from tests.state.test_state_registry_read import redis_cluster, store

__all__ = ["redis_cluster", "store"]  # fixtures, imported so the parametrized store finds them

TTL = 60.0
QUIET_REFRESH_S = 1.0  # the quiet cadence of the refresher and the registry sync (defaults)


# -- the store method -------------------------------------------------------------------------
async def test_the_quiet_read_is_the_registry_view_and_the_usage_view(store: StateStore) -> None:
    assert await store.registry_and_usage_view(TTL, [], []) == ((True, {}, {}, {}), ({}, {}))
    await store.register_worker("d-new", '{"id": "d-new", "role": "decode"}')
    await store.set_drained("d-new", True)
    await store.set_drained("d0", True)
    await store.set_drained("d0", False)
    assert await store.set_role("b0", "prefill", 0) is not None
    for wid in ("d0", "d1"):
        await store.set_capacity(wid, 100)
    assert (await store.reserve("d0", "r1", 10, 30.0)).held
    assert (await store.reserve("d0", "short", 5, 0.05)).held
    assert (await store.reserve("d1", "r3", 7, 30.0)).held
    await store.strand("p0", "q1", 4096)
    await asyncio.sleep(0.1)  # `short` expires: not counted, as by usage_view
    decode, prefill = ["d0", "d1", "d0", "d-none"], ["p0", "p1"]

    registry, usage = await store.registry_and_usage_view(TTL, decode, prefill)

    assert registry == await store.registry_view(TTL)
    assert usage == await store.usage_view(decode, prefill)
    assert registry[0] is False and set(registry[1]) == {"d-new"}
    assert {wid for wid, mark in registry[2].items() if mark.drained} == {"d-new"}
    assert (usage[0]["d0"].reserved_blocks, usage[0]["d0"].reservations) == (10, 1)
    assert usage[0]["d-none"].capacity_blocks == 0
    assert usage[1] == {"p0": 4096, "p1": 0}


async def test_every_replica_learns_of_a_loss_from_the_quiet_read(redis_prefix: str) -> None:
    """Two replicas' store objects: the first to look after a loss finds the marker missing,
    the other finds it re-created by another token. Both count it as a loss."""
    client = aioredis.Redis.from_url(REDIS_URL)
    try:
        one, two = RedisStore(client, Keys(redis_prefix)), RedisStore(client, Keys(redis_prefix))
        for replica in (one, two):
            await replica.registry_and_usage_view(TTL, ["d0"], ["p0"])
        assert (await one.registry_and_usage_view(TTL, ["d0"], ["p0"]))[0][0] is False
        await client.delete(Keys(redis_prefix).marker)  # the store lost its data
        assert (await one.registry_and_usage_view(TTL, ["d0"], ["p0"]))[0][0] is True
        assert (await two.registry_and_usage_view(TTL, ["d0"], ["p0"]))[0][0] is True
        assert (await two.registry_and_usage_view(TTL, ["d0"], ["p0"]))[0][0] is False
    finally:
        await client.aclose()


async def test_the_memory_store_reads_the_same_as_its_two_views() -> None:
    store = MemoryStore()
    await store.set_capacity("d0", 8)
    assert await store.registry_and_usage_view(TTL, ["d0"], ["p0"]) == (
        (True, {}, {}, {}),
        await store.usage_view(["d0"], ["p0"]),
    )


# -- an idle router on the real Redis ---------------------------------------------------------
@contextlib.asynccontextmanager
async def quiet_router(
    redis_prefix: str,
    redis_url: str = REDIS_URL,
    admission: dict[str, Any] | None = None,
    **loops: float,
) -> AsyncIterator[SimCluster]:
    """Four simulated workers and a router at the default quiet cadences, once it is quiet:
    its refresher has backed off and rides on the registry sync, which waits on the feed."""
    async with sim_cluster(
        prefill=2,
        decode=2,
        redis_prefix=redis_prefix,
        redis_url=redis_url,
        loops={"state_refresh_s": 0.1, **loops},
        admission=admission or {},
    ) as cluster:
        refresher = cluster.parts.refresher
        await _within(5.0, lambda: _true(refresher.riding), "the refresher never rode")
        # The registry sync's first quiet wait starts the feed and reads once more, then blocks.
        await asyncio.sleep(1.5 * QUIET_REFRESH_S)
        yield cluster


async def _true(value: bool) -> bool:
    return value


async def _within(timeout_s: float, check: Callable[[], Awaitable[bool]], what: str) -> float:
    """Seconds until `check` holds, polled every 20 ms; fails with `what` after `timeout_s`."""
    start = time.monotonic()
    while not await check():
        if time.monotonic() - start > timeout_s:
            raise AssertionError(f"{what} (waited {timeout_s} s)")
        await asyncio.sleep(0.02)
    return time.monotonic() - start


async def _commands_sent(prefix: str, window_s: float) -> list[str]:
    """The commands naming a key under `prefix` that clients sent over `window_s` (``MONITOR``
    on the server; the commands a script runs are left out: they are not round trips)."""
    client = aioredis.Redis.from_url(REDIS_URL)
    seen: list[str] = []

    async def listen(monitor: Any) -> None:
        while True:
            cmd = await monitor.next_command()
            if cmd["client_type"] != "lua" and prefix in cmd["command"]:
                seen.append(cmd["command"])

    try:
        async with client.monitor() as monitor:
            task = asyncio.create_task(listen(monitor))
            await asyncio.sleep(window_s)
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    finally:
        await client.aclose()
    return seen


async def test_an_idle_router_makes_no_store_call_while_quiet(redis_prefix: str) -> None:
    window_s = 3.0
    async with quiet_router(redis_prefix) as cluster:
        sent = await _commands_sent(redis_prefix, window_s)
        assert cluster.parts.refresher.riding
    # Before issue 36: one script a beat (3-4 in 3 s); before issue 24: ~27.
    assert sent == [], sent


def _put_back(client: aioredis.Redis, keys: Keys) -> Callable[[], Awaitable[bool]]:
    async def check() -> bool:
        caps = await client.mget(keys.decode_capacity("d0"), keys.decode_capacity("d1"))
        return None not in caps and bool(await client.exists(keys.marker))

    return check


async def test_a_redis_restarted_empty_is_put_back_by_a_quiet_replica(redis_prefix: str) -> None:
    """The feed's blocking connection breaks when Redis goes: the registry sync reads at once,
    and on the beat until the store answers, then finds the marker gone and puts back."""
    keys = Keys(redis_prefix)
    with PrivateRedis() as redis:
        async with quiet_router(redis_prefix, redis.url) as cluster:
            redis.kill()
            redis.start()  # empty
            client = aioredis.Redis.from_url(redis.url)
            try:
                took = await _within(5 * QUIET_REFRESH_S, _put_back(client, keys), "not put back")
            finally:
                await client.aclose()
            assert took <= QUIET_REFRESH_S + 1.0, took  # within a refresh (+ a loaded CI)
            assert cluster.parts.metrics.store_resets._value.get() == 1


async def test_keys_lost_on_a_running_redis_are_put_back_within_the_quiet_wait(
    redis_prefix: str,
) -> None:
    """No connection breaks and nobody writes the feed (it is gone too): the quiet wait's bound
    (`registry_quiet_wait_s`) is what notices, or the next request."""
    keys = Keys(redis_prefix)
    wait_s = 2.0
    client = aioredis.Redis.from_url(REDIS_URL)
    try:
        async with quiet_router(redis_prefix, registry_quiet_wait_s=wait_s) as cluster:
            doomed = [k async for k in client.scan_iter(match=f"{redis_prefix}*", count=1000)]
            assert keys.marker.encode() in doomed and keys.decode_capacity("d0").encode() in doomed
            await client.delete(*doomed)  # a FLUSHALL, as this replica sees it
            took = await _within(3 * wait_s, _put_back(client, keys), "not put back")
            assert took <= wait_s + 1.0, took
            assert cluster.parts.metrics.store_resets._value.get() == 1
    finally:
        await client.aclose()


async def test_another_replicas_drain_shows_within_a_refresh_and_its_reservation_at_a_request(
    redis_prefix: str,
) -> None:
    client = aioredis.Redis.from_url(REDIS_URL)
    other = RedisStore(client, Keys(redis_prefix))  # another replica's store
    try:
        async with quiet_router(redis_prefix) as cluster:
            pools = cluster.parts.pools
            assert await other.set_drained("d1", True)
            took = await _within(
                3 * QUIET_REFRESH_S,
                lambda: _true(pools.workers["d1"].drained),
                "the drain was not applied",
            )
            assert took <= QUIET_REFRESH_S + 1.0, took

            # Reservations are not on the feed (they are the hot path): a quiet replica's view
            # of them waits for its next request, whose placement is right either way (the
            # reservation itself is checked in the store, atomically).
            assert (await other.reserve("d0", "elsewhere", 12, 30.0)).held
            admission = cluster.parts.admission
            assert admission.on_arrival is not None
            admission.on_arrival()  # as a request arriving does
            took = await _within(
                3 * QUIET_REFRESH_S,
                lambda: _true(pools.workers["d0"].reserved_blocks == 12),
                "the other replica's reservation did not show",
            )
            assert took <= QUIET_REFRESH_S + 1.0, took
            # The request ended the ride: the refresher reads on its own for a while.
            assert not cluster.parts.refresher.riding
    finally:
        await client.aclose()


async def test_another_replicas_registration_and_removal_show_within_a_refresh(
    redis_prefix: str,
) -> None:
    spec = {"id": "d9", "url": "http://127.0.0.1:9", "role": "decode", "adapter": "sim"}
    client = aioredis.Redis.from_url(REDIS_URL)
    other = RedisStore(client, Keys(redis_prefix))  # another replica's store
    try:
        async with quiet_router(redis_prefix) as cluster:
            workers = cluster.parts.pools.workers
            await other.register_worker("d9", orjson.dumps(spec | {"kv_blocks": 64}).decode())
            took = await _within(
                3 * QUIET_REFRESH_S, lambda: _true("d9" in workers), "not registered"
            )
            assert took <= QUIET_REFRESH_S + 1.0, took
            assert await other.unregister_worker("d9")
            took = await _within(
                3 * QUIET_REFRESH_S, lambda: _true("d9" not in workers), "not removed"
            )
            assert took <= QUIET_REFRESH_S + 1.0, took
    finally:
        await client.aclose()


async def test_a_request_is_not_refused_on_a_view_left_from_a_quiet_spell(
    redis_prefix: str,
) -> None:
    """The quiet replica's view says both decode workers are full, from before its quiet spell,
    and it made no read since. Its next request, refused at once when there is no room
    (`admission.mode: instant`), reads the store before it is refused, and is served.

    A replica rides the change feed (no reads) only once its last read showed no reservation
    but its own (router/workers/refresher.py `_can_ride`): another replica's keep it reading at
    its quiet cadence. So the stale view is made here by hand, on the replica's own figures,
    once it rides: what a view from before a quiet spell would say."""
    async with quiet_router(redis_prefix, admission={"mode": "instant"}) as cluster:
        decode, refresher = cluster.parts.pools.workers, cluster.parts.refresher
        await _within(10.0, lambda: _true(refresher.riding), "never quiet")
        await asyncio.sleep(1.5 * refresher.stale_after_s)  # a quiet spell: no reads
        for wid in ("d0", "d1"):  # the view left from before it: full
            decode[wid].reserved_blocks = decode[wid].capacity_blocks
        # The arrival's own wake-up of the refresher usually reads before the placement;
        # without it, what the placement does on a miss is all there is.
        cluster.parts.admission.on_arrival = None
        body = {"model": MODEL, "prompt": "hello", "max_tokens": 8}
        async with aiohttp.ClientSession() as s:
            async with s.post(cluster.router_url + "/v1/completions", json=body) as r:
                assert r.status == 200, await r.text()


# -- a busy replica alone -----------------------------------------------------------------------
def _usage_reads(commands: list[str]) -> list[str]:
    """The refresher's reads among `commands`: the usage script names a decode capacity key
    first (the registry sync's reads name `{reg}` keys)."""
    return [c for c in commands if c.startswith("EVALSHA") and "}:cap " in c]


def _streaming(cluster: SimCluster, max_tokens: int) -> asyncio.Task[None]:
    """A long stream through the router, read to its end in the background."""

    async def stream() -> None:
        body = {"model": MODEL, "prompt": "one long answer", "max_tokens": max_tokens}
        body |= {"stream": True, "ignore_eos": True}
        async with aiohttp.ClientSession() as s:
            async with s.post(cluster.router_url + "/v1/completions", json=body) as r:
                assert r.status == 200, await r.text()
                async for _ in r.content.iter_any():
                    pass

    return asyncio.create_task(stream())


async def test_a_busy_replica_alone_reads_the_usage_at_the_quiet_cadence(
    redis_prefix: str,
) -> None:
    """One stream on a replica alone: its own accounting is the whole truth, so the refresher
    backs off as if quiet (about 1 read a second, not 20: issue 24's one-stream cost). Another
    replica's reservation on the same worker brings the busy cadence back at once."""
    window_s = 3.0
    client = aioredis.Redis.from_url(REDIS_URL)
    other = RedisStore(client, Keys(redis_prefix))  # another replica's store
    # 20 simulated ms a token at time scale 2: a 1,500-token answer streams for ~15 s.
    async with sim_cluster(
        prefill=1,
        decode=1,
        redis_prefix=redis_prefix,
        loops={"state_refresh_s": 0.1},
        time_scale=2.0,
    ) as cluster:
        refresher = cluster.parts.refresher
        stream = _streaming(cluster, 1500)
        try:
            await _within(5.0, lambda: _true(refresher.alone and not stream.done()), "alone")
            alone = _usage_reads(await _commands_sent(redis_prefix, window_s))
            assert not stream.done(), "the stream ended inside the window: nothing was busy"
            # Before: 10 usage reads a second (and as many marker checks), 30 in 3 s.
            assert len(alone) <= window_s + 2, alone

            assert (await other.reserve("d0", "elsewhere", 12, 30.0)).held
            await _within(3.0, lambda: _true(not refresher.alone), "the other replica not seen")
            shared = _usage_reads(await _commands_sent(redis_prefix, window_s))
            assert not stream.done(), "the stream ended inside the window: nothing was busy"
            assert len(shared) >= 3 * max(1, len(alone)), (len(shared), len(alone))
        finally:
            stream.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await stream
            await other.release("d0", "elsewhere")
            await client.aclose()
