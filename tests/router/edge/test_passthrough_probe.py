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
from tests.app_parts import parts
from tests.conftest import MODEL, REDIS_URL, running_router

COOLDOWN_S = 0.3


class Gate:
    """A reverse proxy in front of one worker that holds requests to `path` while closed:
    before they reach the worker, or (`mid_stream`) after the answer's first event."""

    def __init__(self, upstream: str, path: str, mid_stream: bool = False) -> None:
        self.upstream, self.path, self.mid_stream = upstream, path, mid_stream
        self.arrived = asyncio.Event()  # a held request reached the gate
        self.opened = asyncio.Event()

    def __repr__(self) -> str:
        return f"Gate({self.path}, open={self.opened.is_set()})"

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        held = request.path == self.path and not self.opened.is_set()
        if held and not self.mid_stream:
            self.arrived.set()
            await self.opened.wait()  # the slow worker: cancelled if the router hangs up
        headers = {k: v for k, v in request.headers.items() if k.lower() != "host"}
        async with (
            aiohttp.ClientSession() as s,
            s.request(
                request.method, self.upstream + request.path_qs, data=body, headers=headers
            ) as r,
        ):
            out = web.StreamResponse(
                status=r.status,
                headers={"Content-Type": r.headers.get("Content-Type", "application/json")},
            )
            await out.prepare(request)
            pending = b""
            async for chunk in r.content.iter_any():
                if held and self.mid_stream:
                    pending += chunk
                    first, sep, pending = pending.partition(b"\n\n")
                    if not sep:
                        pending = first
                        continue
                    await out.write(first + sep)
                    self.arrived.set()
                    await self.opened.wait()  # the stream stalls after its first event
                    held = False
                    chunk, pending = pending, b""
                await out.write(chunk)
            await out.write_eof()
            return out


@contextlib.asynccontextmanager
async def gated_cluster(
    path: str, redis_prefix: str, mid_stream: bool = False
) -> AsyncIterator[tuple[str, str, Gate, Any]]:
    """(router URL, the worker's own URL, its gate, the router's parts): one `both` worker
    reached through the gate; its breaker opens at the first failure and cools down fast."""
    cfg = WorkerConfig(role="both", worker_id="b0", model=MODEL, time_scale=500.0)
    async with running_worker(cfg) as worker_url:
        gate = Gate(worker_url, path, mid_stream)
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
            "store": {"url": REDIS_URL, "key_prefix": redis_prefix},
            "loops": {"health_interval_s": 0.5, "state_refresh_s": 0.05},
            "workers": [
                {"id": "b0", "url": gate_url, "role": "both", "adapter": "sim", "kv_blocks": 4096}
            ],
            "breaker": {"failures_to_open": 1, "cooldown_s": COOLDOWN_S},
        }
        try:
            async with running_router(settings_from_mapping(raw)) as (router_url, router_app):
                yield router_url, worker_url, gate, parts(router_app)
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
_CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


async def _half_open(
    s: aiohttp.ClientSession, router_url: str, worker_url: str, gate: Gate, breaker: Any
) -> None:
    """Open the worker's breaker by a failure (its next answer is a 500), then wait out the
    cooldown: the next request to it is its one probe."""
    fault = {"error_rate": 1.0, "error_status": 500, "count": 1}
    async with s.post(worker_url + "/sim/faults", json=fault) as r:
        assert r.status == 200
    gate.opened.set()
    async with s.post(router_url + "/tokenize", json=_BODIES["/tokenize"]) as r:
        assert r.status == 503  # its only worker failed, and is out of rotation now
    assert breaker.state == "open"
    gate.opened.clear()
    assert await _until(lambda: breaker.state == "half_open", 5 * COOLDOWN_S)


async def _leave_mid_probe(router_url: str, path: str, body: Any, gate: Gate) -> None:
    """A client sends the probe, which the gate holds; the client disconnects (the router
    cancels the request's handler)."""

    async def client_request() -> None:
        async with aiohttp.ClientSession() as c, c.post(router_url + path, json=body) as r:
            await r.read()

    client = asyncio.create_task(client_request())
    await asyncio.wait_for(gate.arrived.wait(), 10)
    client.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await client


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
        await _half_open(s, router_url, worker_url, gate, breaker)
        # The probe: held at the gate (a slow worker) until the client leaves.
        gate.arrived.clear()
        await _leave_mid_probe(router_url, path, body, gate)
        given_back = await _until(lambda: breaker.probes_in_flight == 0, 3.0)
        assert given_back, f"the probe's slot leaked: {breaker!r}, {breaker.probes_in_flight=}"
        assert breaker.state == "half_open" and breaker.allows()  # no verdict on the worker

        # The worker is back in rotation: the next request is its probe and closes the breaker,
        # and the main path serves chat from it too.
        gate.opened.set()
        async with s.post(router_url + path, json=body) as r:
            assert r.status == 200, await r.text()
        assert breaker.state == "closed" and breaker.probes_in_flight == 0
        async with s.post(router_url + "/v1/chat/completions", json=_CHAT) as r:
            assert r.status == 200, await r.text()
            assert (await r.json())["choices"][0]["message"]["content"]


async def test_a_stream_is_judged_by_its_end_and_a_client_leaving_mid_stream_owes_nothing(
    redis_prefix: str,
) -> None:
    """A streamed probe (a Responses stream on one worker) keeps its slot until the stream
    ends, not until its headers: a client that leaves mid-stream gives it back, no verdict."""
    path, body = "/v1/responses", {**_BODIES["/v1/responses"], "stream": True}
    async with (
        gated_cluster(path, redis_prefix, mid_stream=True) as (router_url, worker_url, gate, gw),
        aiohttp.ClientSession() as s,
    ):
        breaker = gw.pools.workers["b0"].breaker
        await _half_open(s, router_url, worker_url, gate, breaker)
        gate.arrived.clear()

        async def client_request() -> None:
            async with aiohttp.ClientSession() as c, c.post(router_url + path, json=body) as r:
                await r.read()

        client = asyncio.create_task(client_request())
        await asyncio.wait_for(gate.arrived.wait(), 10)
        # The worker answered 200 and its first event: the probe is still out.
        assert breaker.probes_in_flight == 1 and breaker.state == "half_open"
        client.cancel()  # the client disconnects mid-stream
        with contextlib.suppress(asyncio.CancelledError):
            await client
        assert await _until(lambda: breaker.probes_in_flight == 0, 3.0), repr(breaker)
        assert breaker.state == "half_open" and breaker.failures == 1  # nothing charged

        gate.opened.set()
        async with s.post(router_url + path, json=body) as r:
            assert r.status == 200
            events = (await r.read()).decode().split("\n\n")
        assert events[0].startswith("event: response.created")
        assert any(e.startswith("event: response.completed") for e in events)
        assert breaker.state == "closed" and breaker.probes_in_flight == 0
