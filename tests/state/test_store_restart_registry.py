"""Drains and forced roles after Redis restarts empty (issue 20), on real Redis servers.

- Two router replicas on a private `redis-server` in front of simulated workers: d0 drained
  and b0 forced to prefill through one replica's admin API; Redis SIGKILLed and started
  empty. From the restart on, both replicas keep d0 drained and b0 in prefill (sampled
  throughout, not only at the end), and the new Redis holds both again.
- The replicas' put-back, step by step on two replicas' pools over the shared Redis (their own key
  prefix): a drain undone on one replica just before the loss, still shown by the other, is
  not brought back whichever replica puts back first; a newer role version wins the same way;
  a put-back cut short by a store error is finished at the next check.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import orjson
import pytest
import redis.asyncio as aioredis
from aiohttp import web

from disagg_tools.sim.worker import WorkerConfig, running_worker
from router.config import Settings, settings_from_mapping
from router.workers.drain import set_drained
from state import RedisStore
from state.base import StoreError
from tests.app_parts import parts
from tests.conftest import MODEL, REDIS_URL, running_router
from tests.redis_dump import delete_prefix
from tests.redis_server import PrivateRedis
from tests.router.edge.test_admin import TOKEN
from tests.router.workers.test_pools_idle import Replica, replica
from tests.state.test_state_loss import _redis_traces
from tests.state.test_store_faults import fail_calls

AUTH = {"Authorization": f"Bearer {TOKEN}"}


def _settings(redis_url: str, prefix: str, workers: list[dict[str, Any]]) -> Settings:
    return settings_from_mapping(
        {
            "model": MODEL,
            "perf": {"model": MODEL, "gpu": "h100"},
            "store": {"url": redis_url, "key_prefix": prefix},
            "auth": {"admin_token": TOKEN},
            "loops": {"registry_refresh_s": 0.1, "health_interval_s": 0.5, "state_refresh_s": 0.05},
            "leases": {"reservation_s": 3.0},
            "workers": workers,
            "roles": {"interval_s": 0.1, "settle_s": 0.2},
        }
    )


@contextlib.asynccontextmanager
async def _replicas(redis: PrivateRedis) -> AsyncIterator[list[tuple[str, web.Application]]]:
    """Replicas a and b on one private Redis, in front of p0, d0, d1 and the `both` b0, b1."""
    async with contextlib.AsyncExitStack() as stack:
        workers: list[dict[str, Any]] = []
        for role, wid in (("prefill", "p0"), ("decode", "d0"), ("decode", "d1"), ("both", "b0"),
                          ("both", "b1")):  # fmt: skip
            config = WorkerConfig(
                role=role, worker_id=wid, model=MODEL, time_scale=100.0, kv_blocks=4096,
                kv_lease_s=30.0 * 100,
            )  # fmt: skip
            url = await stack.enter_async_context(running_worker(config))
            entry: dict[str, Any] = {"id": wid, "url": url, "role": role, "adapter": "sim"}
            if role != "prefill":
                entry["kv_blocks"] = 4096
            workers.append(entry)
        settings = _settings(redis.url, "dr:", workers)
        yield [await stack.enter_async_context(running_router(settings)) for _ in "ab"]


def _view(app: web.Application) -> tuple[bool, str]:
    """What this replica places by: is d0 drained, what role does b0 serve."""
    workers = parts(app).pools.workers
    return workers["d0"].drained, workers["b0"].current_role


async def _until(cond: Any, what: str, timeout_s: float = 20.0) -> None:
    for _ in range(int(timeout_s / 0.05)):
        if cond():
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"never: {what}")


async def _ready(s: aiohttp.ClientSession, url: str) -> bool:
    async with s.get(url + "/ready") as r:
        return r.status == 200


async def test_drains_and_forced_roles_survive_redis_restarting_empty() -> None:
    with PrivateRedis() as redis:
        async with _replicas(redis) as replicas, aiohttp.ClientSession() as s:
            (a, _), _ = replicas
            apps = [app for _, app in replicas]
            async with s.post(f"{a}/admin/workers/d0/drain", headers=AUTH) as r:
                assert r.status == 200, await r.text()
            async with s.post(
                f"{a}/admin/workers/b0/role", json={"role": "prefill"}, headers=AUTH
            ) as r:
                assert r.status == 200, await r.text()
            await _until(
                lambda: all(_view(app) == (True, "prefill") for app in apps),
                "d0 drained and b0 in prefill on both replicas",
            )
            version = parts(apps[0]).pools.workers["b0"].role_state.version

            redis.kill()
            redis.start()  # empty
            # From the restart on, sampled until both replicas are ready and a few registry
            # refreshes and role ticks later: never undrained, never back to a default role.
            seen: list[tuple[bool, str]] = []
            for i in range(60):
                seen += [_view(app) for app in apps]
                if i >= 20 and all([await _ready(s, url) for url, _ in replicas]):
                    break
                await asyncio.sleep(0.05)
            assert set(seen) == {(True, "prefill")}, seen

            client = aioredis.from_url(redis.url)
            try:
                await _until_async(lambda: _restored(client), "the new Redis holds both again")
                raw = await client.hget("dr:{reg}:roles", "b0")
                assert raw is not None and raw.decode().split("|")[:2] == ["prefill", str(version)]
            finally:
                await client.aclose()
            # And what the replicas do with it: the forced role continues its versions.
            async with s.post(
                f"{a}/admin/workers/b0/role", json={"role": "decode"}, headers=AUTH
            ) as r:
                assert r.status == 200, await r.text()
                assert (await r.json())["role_version"] == version + 1


async def _restored(client: aioredis.Redis) -> bool:
    drained = {m.decode() for m in await client.smembers("dr:{reg}:drained")}
    return drained == {"d0"} and await client.hexists("dr:{reg}:roles", "b0")


async def _until_async(cond: Any, what: str, timeout_s: float = 10.0) -> None:
    for _ in range(int(timeout_s / 0.05)):
        if await cond():
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"never: {what}")


# -- the put-back, step by step -------------------------------------------------------------


def _pools(prefix: str) -> Replica:
    """A replica's pools on the shared Redis, with a store object of its own (as a replica
    has); workers at an address nothing answers (nothing here probes them)."""
    nowhere = "http://127.0.0.1:9"
    workers = [
        {"id": "p0", "url": nowhere, "role": "prefill", "adapter": "vllm"},
        {"id": "d0", "url": nowhere, "role": "decode", "adapter": "vllm", "kv_blocks": 100},
        {"id": "b0", "url": nowhere, "role": "both", "adapter": "vllm", "kv_blocks": 100},
    ]
    settings = _settings(REDIS_URL, prefix, workers)
    return replica(settings, RedisStore.from_url(REDIS_URL, prefix))


@contextlib.asynccontextmanager
async def _two_pools(prefix: str) -> AsyncIterator[tuple[Replica, Replica]]:
    a, b = _pools(prefix), _pools(prefix)
    try:
        await a.loss.register_capacities()
        for p in (a, b):
            await p.registry.sync()  # each one's first look at the marker
        yield a, b
    finally:
        for p in (a, b):
            await p.store.close()


async def _lose_everything(prefix: str) -> None:
    await delete_prefix(REDIS_URL, prefix)


@pytest.mark.parametrize("first", ["stale", "fresh"])
async def test_a_drain_undone_before_the_loss_is_not_brought_back(
    redis_prefix: str, first: str
) -> None:
    async with _two_pools(redis_prefix) as (a, b):
        # Drained and b0 moved through a, both replicas see it.
        await set_drained(a.store, a.members.workers.values(), "d0", True)
        assert await a.store.set_role("b0", "prefill", 0) is not None
        for p in (a, b):
            await p.registry.sync()
        assert a.members.workers["d0"].drained and b.members.workers["d0"].drained
        # Then b undoes the drain and moves b0 on; the store loses everything before a's next
        # registry read, so a still shows the drain and the older role.
        await set_drained(b.store, b.members.workers.values(), "d0", False)
        moved = await b.store.set_role("b0", "draining-to-decode", 1)
        assert moved is not None
        await b.registry.sync()
        await _lose_everything(redis_prefix)
        assert a.members.workers["d0"].drained and a.members.workers["b0"].role_state.version == 1

        order = [a, b] if first == "stale" else [b, a]
        for p in order:
            await p.registry.sync()  # each learns of the loss and puts back its own view
        for p in (a, b):
            await p.registry.sync()
        assert await a.store.drained_workers() == set()
        assert (await a.store.worker_roles())["b0"] == moved
        for p in (a, b):
            assert not p.members.workers["d0"].drained
            assert p.members.workers["b0"].role_state == moved
        # Capacities are back too (every replica's put-back writes them).
        usage = await a.store.decode_usage(["d0", "b0"])
        assert usage["d0"].capacity_blocks == usage["b0"].capacity_blocks == 100


async def test_a_put_back_cut_short_is_finished_at_the_next_check(redis_prefix: str) -> None:
    async with _two_pools(redis_prefix) as (a, _):
        await set_drained(a.store, a.members.workers.values(), "d0", True)
        assert await a.store.set_role("b0", "prefill", 0) is not None
        await a.registry.sync()
        await _lose_everything(redis_prefix)
        failed = fail_calls(a.store, "restore_registry")
        with pytest.raises(StoreError):
            await a.registry.sync()  # the marker is back already: the loss no longer shows
        assert failed == [1]
        await a.registry.sync()
        assert await a.store.drained_workers() == {"d0"}
        assert (await a.store.worker_roles())["b0"].role == "prefill"
        assert a.members.workers["d0"].drained and a.members.workers["b0"].current_role == "prefill"


async def test_a_role_read_before_the_loss_is_noticed_is_kept_and_put_back(
    redis_prefix: str,
) -> None:
    """The role manager reads the roles every tick with no marker check: right after a loss it
    reads none. The worker keeps its role (not back to no role: `both`, in decode), and the
    registry sync puts it back."""
    async with _two_pools(redis_prefix) as (a, _):
        forced = await a.store.set_role("b0", "prefill", 0)
        await a.registry.sync()
        assert a.members.workers["b0"].current_role == "prefill"
        await _lose_everything(redis_prefix)
        # The tick's read:
        assert a.members.apply_roles(await a.store.worker_roles()) == {"b0": forced}
        assert a.members.workers["b0"].current_role == "prefill"
        await a.registry.sync()
        assert (await a.store.worker_roles()) == {"b0": forced}
        assert a.members.workers["b0"].role_state == forced
        # Outside a loss too (one replica's sync finding the role gone while the worker stays),
        # the sync puts back what it kept.
        assert await a.store.forget_role("b0")
        await a.registry.sync()
        assert (await a.store.worker_roles()) == {"b0": forced}


async def test_a_worker_deleted_on_one_replica_leaves_no_key_behind_on_the_other(
    redis_prefix: str,
) -> None:
    """Until its next registry sync the other replica still has the worker: its state refresh
    must not write the deleted worker's capacity back (it took a capacity reading 0 for a
    shard that lost its keys)."""
    registration = orjson.dumps(
        {"id": "d9", "url": "http://127.0.0.1:9", "role": "decode", "adapter": "vllm",
         "kv_blocks": 50}
    ).decode()  # fmt: skip
    async with _two_pools(redis_prefix) as (a, b):
        await a.store.register_worker("d9", registration)
        for p in (a, b):
            await p.registry.sync()
            assert "d9" in p.members.workers
        await a.store.set_drained("d9", True)
        await b.refresher.refresh(check_marker=False)
        assert await _redis_traces(a.store, "d9")  # type: ignore[arg-type]
        # The admin API's delete on a: the store forgets it, a's pools drop it.
        assert await a.store.unregister_worker("d9")
        a.members.remove("d9")
        await b.refresher.refresh(check_marker=False)  # before b's registry sync
        await b.registry.sync()
        assert "d9" not in b.members.workers
        await b.refresher.refresh()
        assert await _redis_traces(a.store, "d9") == set()  # type: ignore[arg-type]
