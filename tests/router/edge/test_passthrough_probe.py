"""A half-open worker's probe slot, taken by a passthrough request (router/edge/passthrough.py),
is given back when the client leaves while the probe is in flight.

Before, the passthrough leg took the slot with `on_dispatch()` and gave it back only on the
paths it caught: a client that disconnected mid-probe (a CancelledError in the handler) kept
the slot taken, the breaker stayed half-open with no probe to close it, and the worker was out
of rotation on that replica for every route, chat included, until the process restarted.

Real parts: a simulated worker (role `both`) behind a real gate that holds one route's
requests until it is opened (the slow worker), a real router and Redis.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from disagg_tools.sim.worker import WorkerConfig, running_worker
from router.config import settings_from_mapping
from router.edge.app import GATEWAY
from tests.conftest import MODEL, REDIS_URL, running_router

COOLDOWN_S = 0.3


class Gate:
    """A reverse proxy in front of one worker that holds requests to `path` while closed."""

    def __init__(self, upstream: str, path: str) -> None:
        self.upstream, self.path = upstream, path
        self.arrived = asyncio.Event()  # a held request reached the gate
        self.opened = asyncio.Event()

    def __repr__(self) -> str:
        return f"Gate({self.path}, open={self.opened.is_set()})"

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        if request.path == self.path and not self.opened.is_set():
            self.arrived.set()
            await self.opened.wait()  # the slow worker: cancelled if the router hangs up
        headers = {k: v for k, v in request.headers.items() if k.lower() != "host"}
        async with (
            aiohttp.ClientSession() as s,
            s.request(request.method, self.upstream + request.path_qs, data=body, headers=headers)
            as r,
        ):
            out = web.StreamResponse(
                status=r.status,
                headers={"Content-Type": r.headers.get("Content-Type", "application/json")},
            )
            await out.prepare(request)
            async for chunk in r.content.iter_any():
                await out.write(chunk)
            await out.write_eof()
            return out


@contextlib.asynccontextmanager
async def gated_cluster(path: str, redis_prefix: str) -> AsyncIterator[tuple[str, str, Gate, Any]]:
    """(router URL, the worker's own URL, its gate, the router's gateway): one `both` worker
    reached through the gate; its breaker opens at the first failure and cools down fast."""
    cfg = WorkerConfig(role="both", worker_id="b0", model=MODEL, time_scale=500.0)
    async with running_worker(cfg) as worker_url:
        gate = Gate(worker_url, path)
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", gate.handle)
        runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=1.0)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        gate_url = f"http://127.0.0.1:{runner.addresses[0][1]}"
        raw = {
            "model": MODEL,
            "perf": {"model": MODEL, "gpu": "h100"},
            "redis_url": REDIS_URL,
            "key_prefix": redis_prefix,
            "workers": [
                {"id": "b0", "url": gate_url, "role": "both", "adapter": "sim", "kv_blocks": 4096}
            ],
            "health_interval_s": 0.5,
            "state_refresh_s": 0.05,
            "breaker": {"failures_to_open": 1, "cooldown_s": COOLDOWN_S},
        }
        try:
            async with running_router(settings_from_mapping(raw)) as (router_url, router_app):
                yield router_url, worker_url, gate, router_app[GATEWAY]
        finally:
            gate.opened.set()
            await runner.cleanup()


async def _until(check: Any, within_s: float) -> bool:
    loop = asyncio.get_running_loop()
    end = loop.time() + within_s
    while not check():
        if loop.time() > end:
            return False
        await asyncio.sleep(0.02)
    return True


_BODIES: dict[str, dict[str, Any]] = {
    "/tokenize": {"model": MODEL, "prompt": "count these"},
    "/v1/embeddings": {"model": MODEL, "input": "embed this"},
    "/v1/responses": {"model": MODEL, "input": "tell me", "max_output_tokens": 3},
}


@pytest.mark.parametrize("path", list(_BODIES))
async def test_a_client_leaving_mid_probe_gives_the_probe_slot_back(
    redis_prefix: str, path: str
) -> None:
    body = _BODIES[path]
    async with (
        gated_cluster(path, redis_prefix) as (router_url, worker_url, gate, gw),
        aiohttp.ClientSession() as s,
    ):
        breaker = gw.pools.workers["b0"].breaker
        # Open the breaker by a failure (the worker's next answer is a 500).
        fault = {"error_rate": 1.0, "error_status": 500, "count": 1}
        async with s.post(worker_url + "/sim/faults", json=fault) as r:
            assert r.status == 200
        gate.opened.set()
        async with s.post(router_url + path, json=body) as r:
            assert r.status == 503  # its only worker failed, and is out of rotation now
        assert breaker.state == "open"
        gate.opened.clear()
        assert await _until(lambda: breaker.state == "half_open", 5 * COOLDOWN_S)

        # The probe: held at the gate (a slow worker) until the client leaves.
        async def client_request() -> None:
            async with aiohttp.ClientSession() as c, c.post(router_url + path, json=body) as r:
                await r.read()

        client = asyncio.create_task(client_request())
        await asyncio.wait_for(gate.arrived.wait(), 10)
        assert breaker.probes_in_flight == 1 and not breaker.allows()
        client.cancel()  # the client disconnects: the router cancels the request's handler
        with contextlib.suppress(asyncio.CancelledError):
            await client
        given_back = await _until(lambda: breaker.probes_in_flight == 0, 3.0)
        assert given_back, f"the probe's slot leaked: {breaker!r}, {breaker.probes_in_flight=}"
        assert breaker.state == "half_open" and breaker.allows()  # no verdict on the worker

        # The worker is back in rotation: the next request is its probe and closes the breaker,
        # and the main path serves chat from it too.
        gate.opened.set()
        async with s.post(router_url + path, json=body) as r:
            assert r.status == 200, await r.text()
        assert breaker.state == "closed" and breaker.probes_in_flight == 0
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
        async with s.post(router_url + "/v1/chat/completions", json=chat) as r:
            assert r.status == 200, await r.text()
            assert (await r.json())["choices"][0]["message"]["content"]
