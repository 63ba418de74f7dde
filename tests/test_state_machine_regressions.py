"""Focused regressions of what the reservation state machine (tests/test_state_machine.py)
found, one test per finding (docs/reliability.md, the bug table), each on a real Redis, real
sockets and simulated workers."""

from __future__ import annotations

import asyncio

import aiohttp

from sim.textgen import expected_answer
from sim.worker import WorkerConfig, running_worker
from tests.conftest import MODEL, sim_cluster
from tests.test_faults import set_faults, sse_text

CHAT = "/v1/chat/completions"
TOKEN = "sm-regression-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


async def test_a_decode_worker_deleted_during_the_prefill_still_serves_its_request(
    redis_prefix: str,
) -> None:
    """Found by the state machine: DELETE /admin/workers/r0 while a request placed on r0 was
    in its prefill; the client got `500 internal router error`. The pools' contract
    (router/pools.py `remove`) is that requests already on a removed worker finish."""
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
