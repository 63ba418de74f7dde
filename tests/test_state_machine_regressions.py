"""Focused regressions of what the reservation state machine (tests/test_state_machine.py)
found, one test per finding (docs/reliability.md, the bug table), each on a real Redis, real
sockets and simulated workers."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import aiohttp
import pytest
import redis.asyncio as aioredis

from disagg_tools.sim.textgen import expected_answer
from disagg_tools.sim.worker import WorkerConfig, running_worker
from router.app import GATEWAY
from router.config import settings_from_mapping
from state import Keys
from tests.conftest import MODEL, running_router, sim_cluster
from tests.redis_server import PrivateRedis
from tests.test_faults import set_faults, sse_text

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
            admin_token=TOKEN,
            time_scale=50.0,
            registry_refresh_s=0.1,
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
        leases = c.gateway.leases
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


# Not strict: whether a run shows the excess depends on which lands first after the reset, A's
# put-back or B's new reservations, and that order follows the replicas' refresh and renewal
# timings (a busy replica alone on its workers now reads the store at most once a second,
# issue 24): the clean-clone CI saw both outcomes. The bug stands until the store holds new
# reservations back after a reset (docs/reliability.md row 16).
@pytest.mark.xfail(
    strict=False,
    reason="after a store reset, a replica that restored the capacities admits new "
    "reservations into the room of another replica's live ones before that replica's renewal "
    "puts them back (router/leases.py renew_all, state renew_many: over capacity by design): "
    "reserved exceeds capacity until those streams end; a fix needs the store to hold new "
    "reservations back for a renewal period after a reset "
    "(state/ and router/workers/store_loss.py)",
)
async def test_after_a_redis_restart_put_backs_and_new_reservations_stay_within_capacity() -> None:
    """Found by the state machine (`r0: 503 blocks reserved > capacity 400`): replica A holds a
    long stream when Redis restarts empty; replica B sees the reset first, restores the
    capacities and fills the worker; A's renewal puts its stream's reservation back on top."""
    with PrivateRedis() as server:
        async with contextlib.AsyncExitStack() as stack:
            cfgs = [("prefill", "p0", 4096), ("decode", "d0", CAP)]
            workers = []
            for role, wid, blocks in cfgs:
                cfg = WorkerConfig(
                    role=role,
                    worker_id=wid,
                    model=MODEL,
                    kv_blocks=blocks,
                    time_scale=5.0,
                    kv_lease_s=150.0,
                )
                url = await stack.enter_async_context(running_worker(cfg))
                entry: dict[str, Any] = {"id": wid, "url": url, "role": role, "adapter": "sim"}
                if role == "decode":
                    entry["kv_blocks"] = blocks
                workers.append(entry)
            base = {
                "model": MODEL,
                "perf": {"model": MODEL, "gpu": "h100"},
                "redis_url": server.url,
                "workers": workers,
                "estimator": "max_tokens",  # no growth: every excess is a put-back's
                "state_refresh_s": 0.05,
                "health_interval_s": 0.5,
                "admission": {"max_wait_s": 5.0},
            }
            # A notices the reset only by its renewal tick (every 3 s), B within 0.1 s.
            a_url, a_app = await stack.enter_async_context(
                running_router(
                    settings_from_mapping(
                        {**base, "registry_refresh_s": 30.0, "reservation_lease_s": 9.0}
                    )
                )
            )
            b_url, _ = await stack.enter_async_context(
                running_router(
                    settings_from_mapping(
                        {**base, "registry_refresh_s": 0.1, "reservation_lease_s": 3.0}
                    )
                )
            )
            session = await stack.enter_async_context(aiohttp.ClientSession())
            held = asyncio.create_task(_post(session, a_url, _long(0, 600)))
            for _ in range(300):
                if a_app[GATEWAY].leases.live:
                    break
                await asyncio.sleep(0.01)
            assert a_app[GATEWAY].leases.live  # A's stream holds ~40 of the 100 blocks
            # A's renewals take a second from here (a busy replica, a slow link): its put-back
            # lands after B's new reservations, as it did in the state machine's run.
            store = a_app[GATEWAY].store
            real_renew = store.renew_many

            async def slow_renew(*args: Any, **kwargs: Any) -> list[str]:
                await asyncio.sleep(1.0)
                return list(await real_renew(*args, **kwargs))

            store.renew_many = slow_renew
            server.kill()
            server.start()  # empty
            crowd = [asyncio.create_task(_post(session, b_url, _long(i, 450))) for i in (1, 2, 3)]
            client = aioredis.Redis.from_url(server.url)
            stack.push_async_callback(client.aclose)
            worst = 0
            for _ in range(200):  # 4 s: past A's renewal tick
                worst = max(worst, int(await client.get(KEYS.decode_sum("d0")) or 0))
                await asyncio.sleep(0.02)
            await asyncio.gather(held, *crowd)
            assert worst <= CAP, f"{worst} blocks reserved on a worker of {CAP}"


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
