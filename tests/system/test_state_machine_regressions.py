"""Focused regressions of what the reservation state machine (tests/system/test_state_machine.py)
found, one test per finding (docs/reliability.md, the bug table), each on a real Redis, real
sockets and simulated workers."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import redis.asyncio as aioredis
import redis.exceptions
from redis.asyncio.cluster import RedisCluster

from disagg_tools.sim.textgen import expected_answer
from disagg_tools.sim.worker import WorkerConfig, running_worker
from router.config import merged_settings, settings_from_mapping
from state import Keys
from tests.app_parts import parts
from tests.conftest import MODEL, running_router, sim_cluster
from tests.redis_cluster import PrivateRedisCluster, redis_cluster
from tests.redis_server import PrivateRedis
from tests.router.request.test_faults import set_faults, sse_text

__all__ = ["redis_cluster"]  # the session fixture, imported so the cluster test finds it

CHAT = "/v1/chat/completions"
TOKEN = "sm-regression-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


async def test_a_decode_worker_deleted_during_the_prefill_still_serves_its_request(
    redis_prefix: str,
) -> None:
    """Found by the state machine: DELETE /admin/workers/r0 while a request placed on r0 was
    in its prefill; the client got `500 internal router error`. The pools' contract
    (router/workers/membership.py `remove`) is that requests already on a removed worker finish."""
    async with (
        sim_cluster(
            redis_prefix=redis_prefix,
            decode=1,
            auth={"admin_token": TOKEN},
            loops={"registry_refresh_s": 0.1},
            time_scale=50.0,
        ) as c,
        running_worker(
            WorkerConfig(
                role="decode",
                worker_id="r0",
                model=MODEL,
                time_scale=50.0,
                kv_blocks=4096,
                kv_lease_s=30.0 * 50,
            )
        ) as r0_url,
        aiohttp.ClientSession() as s,
    ):
        entry = {"id": "r0", "url": r0_url, "role": "decode", "adapter": "sim", "kv_blocks": 4096}
        async with s.post(c.router_url + "/admin/workers", json=entry, headers=AUTH) as r:
            assert r.status == 201, await r.text()
        async with s.post(c.router_url + "/admin/workers/d0/drain", headers=AUTH) as r:
            assert r.status == 200, await r.text()  # placement has r0 alone
        await set_faults(c, "p0", slow_factor=200.0)  # a prefill of a second or so
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": "deleted under me " * 20}],
            "max_tokens": 16,
            "ignore_eos": True,
            "stream": True,
        }
        answer = asyncio.create_task(_post(s, c.router_url, body))
        leases = c.parts.leases
        for _ in range(200):
            if "r0" in leases.live.values():
                break
            await asyncio.sleep(0.01)
        assert "r0" in leases.live.values()  # reserved on r0; its prefill runs
        force = {"force": True}  # the last decode worker in rotation: the guard rail asks
        async with s.delete(c.router_url + "/admin/workers/r0", json=force, headers=AUTH) as r:
            assert r.status == 200, await r.text()
        status, raw = await answer
        assert status == 200, raw[:300]
        text, _, errors = sse_text(raw)
        assert errors == [] and text == expected_answer(CHAT, body)[0]


async def _post(s: aiohttp.ClientSession, url: str, body: dict[str, object]) -> tuple[int, bytes]:
    async with s.post(url + CHAT, json=body) as r:
        return r.status, await r.read()


# Row 16 (issue 31), fixed: after a store reset the capacity written back holds new reservations
# back on the worker for the slowest replica's renewal round, agreed in the store
# (state/holdback.py), so every live reservation's put-back lands before new room is given out.
async def test_after_a_redis_restart_put_backs_and_new_reservations_stay_within_capacity() -> None:
    """Found by the state machine (`r0: 503 blocks reserved > capacity 400`): replica A holds a
    long stream when Redis restarts empty; replica B sees the reset first, restores the
    capacities and would fill the worker; A's renewal puts its stream's reservation back on top.
    The replicas run different lease settings (issue 31): A renews every 3 s (a round at most
    4 s apart), B every second; B must hold back for A's round, which it only knows from the
    store. B's requests wait out the hold-back in admission and are all answered."""
    with PrivateRedis() as server:
        client = aioredis.Redis.from_url(server.url)

        def restart() -> Awaitable[None]:
            server.kill()
            server.start()  # empty
            return asyncio.sleep(0)

        try:
            await _two_replicas_through_a_reset(
                {"store": {"url": server.url}}, restart, client, KEYS
            )
        finally:
            await client.aclose()


async def test_after_a_redis_cluster_lost_its_data_put_backs_and_new_reservations_fit(
    redis_cluster: PrivateRedisCluster,
) -> None:
    """Row 16 on Redis Cluster: the cluster loses every key of the deployment (each shard
    restarted empty alike); the hold-back and what it is agreed on are keys of the workers' and
    the registry's own hash tags, so they work there as on one server."""
    prefix = f"test:{uuid.uuid4().hex[:12]}:"
    host, port = redis_cluster.seed
    client = RedisCluster(host=host, port=port)

    async def lose_everything() -> None:
        await _delete_prefix(client, prefix)

    settings = {"store": {"url": redis_cluster.url, "key_prefix": prefix}}
    try:
        await _two_replicas_through_a_reset(settings, lose_everything, client, Keys(prefix))
    finally:
        await _delete_prefix(client, prefix)
        await client.aclose()


async def _two_replicas_through_a_reset(
    store_settings: dict[str, Any],
    reset: Callable[[], Awaitable[None]],
    client: aioredis.Redis | RedisCluster,
    keys: Keys,
) -> None:
    async with contextlib.AsyncExitStack() as stack:
        workers = await _workers(stack, [("prefill", "p0", 4096), ("decode", "d0", CAP)])
        base = merged_settings(_settings("", workers), store_settings)
        # A notices the reset only by its renewal tick or its busy refresher, B within 0.1 s.
        a_url, a_app = await stack.enter_async_context(
            running_router(
                settings_from_mapping(
                    merged_settings(
                        base,
                        {"loops": {"registry_refresh_s": 30.0}, "leases": {"reservation_s": 9.0}},
                    )
                )
            )
        )
        b_url, _ = await stack.enter_async_context(
            running_router(
                settings_from_mapping(
                    merged_settings(
                        base,
                        {"loops": {"registry_refresh_s": 0.1}, "leases": {"reservation_s": 3.0}},
                    )
                )
            )
        )
        session = await stack.enter_async_context(aiohttp.ClientSession())
        held = asyncio.create_task(_post(session, a_url, _long(0, 600)))
        await _until(lambda: bool(parts(a_app).leases.live))  # ~40 of the 100 blocks
        # A's renewals after the reset land 1.5 s after it at the earliest (a busy replica, a
        # slow link): later than B's new reservations, as in the state machine's run, and
        # within A's round, which the hold-back must cover.
        reset_at = _gate_renewals(a_app, delay_s=1.5)
        await reset()
        reset_at.append(asyncio.get_running_loop().time())
        crowd = [asyncio.create_task(_post(session, b_url, _long(i, 450))) for i in (1, 2, 3)]
        worst = await _worst_reserved(client, keys.decode_sum("d0"), [held, *crowd])
        answers = await asyncio.gather(held, *crowd)
        assert worst <= CAP, f"{worst} blocks reserved on a worker of {CAP}"
        assert [status for status, _ in answers] == [200] * 4, [r[:200] for _, r in answers]


async def test_a_worker_deleted_and_registered_again_under_live_streams_stays_within_capacity() -> (
    None
):
    """Row 16's other race, on the memory store (one router): a dynamic decode worker with a
    live stream is deleted and registered again; the capacity written back holds new
    reservations back until the stream's renewal has put its reservation back, so the requests
    sent meanwhile wait instead of over-committing the worker."""
    async with contextlib.AsyncExitStack() as stack:
        workers = await _workers(stack, [("prefill", "p0", 4096), ("decode", "d0", 4096)])
        r0 = (await _workers(stack, [("decode", "r0", CAP)]))[0]
        settings = merged_settings(_settings("", workers), {"auth": {"admin_token": TOKEN}})
        settings["store"].pop("url")
        url, app = await stack.enter_async_context(
            running_router(
                settings_from_mapping(
                    merged_settings(
                        settings,
                        {"loops": {"registry_refresh_s": 0.1}, "leases": {"reservation_s": 3.0}},
                    )
                )
            )
        )
        session = await stack.enter_async_context(aiohttp.ClientSession())
        gw = parts(app)
        async with session.post(url + "/admin/workers", json=r0, headers=AUTH) as r:
            assert r.status == 201, await r.text()
        async with session.post(url + "/admin/workers/d0/drain", headers=AUTH) as r:
            assert r.status == 200, await r.text()  # placement has r0 alone
        await _until(lambda: gw.pools.members.workers["r0"].available)
        held = asyncio.create_task(_post(session, url, _long(0, 600)))
        await _until(lambda: "r0" in gw.leases.live.values())
        registered_at = _gate_renewals(app, delay_s=1.0)
        force = {"force": True}  # the last decode worker in rotation: the guard rail asks
        async with session.delete(url + "/admin/workers/r0", json=force, headers=AUTH) as r:
            assert r.status == 200, await r.text()
        async with session.post(url + "/admin/workers", json=r0, headers=AUTH) as r:
            assert r.status == 201, await r.text()
        registered_at.append(asyncio.get_running_loop().time())
        await _until(
            lambda: "r0" in gw.pools.members.workers and gw.pools.members.workers["r0"].available
        )
        crowd = [asyncio.create_task(_post(session, url, _long(i, 450))) for i in (1, 2, 3)]
        worst = 0
        while not all(t.done() for t in [held, *crowd]):
            usage = (await gw.store.decode_usage(["r0"]))["r0"]
            worst = max(worst, usage.reserved_blocks)
            await asyncio.sleep(0.02)
        answers = await asyncio.gather(held, *crowd)
        assert worst <= CAP, f"{worst} blocks reserved on a worker of {CAP}"
        assert [status for status, _ in answers] == [200] * 4, [r[:200] for _, r in answers]


async def _workers(
    stack: contextlib.AsyncExitStack, cfgs: list[tuple[str, str, int]]
) -> list[dict[str, Any]]:
    workers = []
    for role, wid, blocks in cfgs:
        cfg = WorkerConfig(
            role=role,
            worker_id=wid,
            model=MODEL,
            kv_blocks=blocks,
            # Streams of a few seconds: each still runs when the put-back lands.
            time_scale=2.0,
            kv_lease_s=150.0,
        )
        url = await stack.enter_async_context(running_worker(cfg))
        entry: dict[str, Any] = {"id": wid, "url": url, "role": role, "adapter": "sim"}
        if role == "decode":
            entry["kv_blocks"] = blocks
        workers.append(entry)
    return workers


def _settings(redis_url: str, workers: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "model": MODEL,
        "perf": {"model": MODEL, "gpu": "h100"},
        "store": {"url": redis_url},
        "estimates": {"estimator": "max_tokens"},  # no growth: every excess is a put-back's
        "loops": {"state_refresh_s": 0.05, "health_interval_s": 0.5},
        "workers": workers,
        # Long enough to wait out the hold-back and the streams before them: the hold-back
        # is "no room now", never an error.
        "admission": {"max_wait_s": 60.0},
    }


def _gate_renewals(app: Any, delay_s: float) -> list[float]:
    """From when the returned list gets a loop time, the router's lease renewals reach the
    store `delay_s` after it at the earliest: its put-backs come after the other requests."""
    store = parts(app).store
    real_renew = store.renew_many
    since: list[float] = []

    async def gated_renew(*args: Any, **kwargs: Any) -> list[str]:
        if since:
            await asyncio.sleep(max(0.0, since[0] + delay_s - asyncio.get_running_loop().time()))
        return list(await real_renew(*args, **kwargs))

    store.renew_many = gated_renew
    return since


async def _until(condition: Any, attempts: int = 1000) -> None:
    for _ in range(attempts):  # up to ~10 s, generous under load
        if condition():
            return
        await asyncio.sleep(0.01)
    assert condition()


async def _delete_prefix(client: RedisCluster, prefix: str) -> None:
    # SCAN visits every primary; DEL is split by slot.
    keys = [key async for key in client.scan_iter(match=f"{prefix}*", count=1000)]
    if keys:
        await client.delete(*keys)


async def _worst_reserved(
    client: aioredis.Redis | RedisCluster, sum_key: str, tasks: list[asyncio.Task[Any]]
) -> int:
    """The most blocks the store showed reserved while `tasks` ran (read every 20 ms)."""
    worst = 0
    while not all(t.done() for t in tasks):
        with contextlib.suppress(redis.exceptions.ConnectionError):
            worst = max(worst, int(await client.get(sum_key) or 0))
        await asyncio.sleep(0.02)
    return worst


CAP = 100
KEYS = Keys("dr:")


def _long(i: int, tokens: int) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": f"long stream {i}"}],
        "max_tokens": tokens,
        "ignore_eos": True,
        "stream": True,
    }
