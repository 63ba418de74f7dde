"""The simulated worker's KV-event hooks: the publisher's sockets bound while the app runs, vLLM's
`POST /reset_prefix_cache` (AllBlocksCleared), and the test endpoints:

    GET  /sim/kv_events        the prefix cache's blocks by router hash, the next sequence number,
                               the bound endpoints
    POST /sim/kv_events/drop   {"batches": N, "replay": bool}: the next N batches are not sent on
                               the PUB; with replay false, not kept for replay either

The cache and the publisher are sim.kv_events'.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import orjson
import zmq
from aiohttp import web

from .kv_events import SimPrefixCache
from .worker_state import WORKER

__all__ = ["add_kv_event_routes", "kv_events_context"]


def _cache(request: web.Request) -> SimPrefixCache:
    cache = request.app[WORKER].kv_events
    if cache is None:
        raise web.HTTPNotFound(text="this worker publishes no KV events (--kv-events-endpoint)")
    return cache


async def _handle_state(request: web.Request) -> web.Response:
    cache = _cache(request)
    body = {
        "blocks": cache.router_hashes(),
        "seq": cache.publisher.seq,
        "block_size": cache.block_size,
        "capacity_blocks": cache.capacity,
        **cache.publisher.bound,
    }
    return web.Response(body=orjson.dumps(body), content_type="application/json")


async def _handle_drop(request: web.Request) -> web.Response:
    cache = _cache(request)
    raw = orjson.loads(await request.read() or b"{}")
    batches, replay = raw.get("batches", 1), raw.get("replay", True)
    if not isinstance(batches, int) or batches < 0 or not isinstance(replay, bool):
        raise web.HTTPBadRequest(text='expected {"batches": N, "replay": true|false}')
    cache.publisher.drop_batches = batches
    cache.publisher.drop_from_replay = not replay
    return web.Response(status=204)


async def _handle_reset(request: web.Request) -> web.Response:
    _cache(request).clear()
    return web.Response(status=200)


def add_kv_event_routes(app: web.Application) -> None:
    app.router.add_get("/sim/kv_events", _handle_state)
    app.router.add_post("/sim/kv_events/drop", _handle_drop)
    app.router.add_post("/reset_prefix_cache", _handle_reset)


async def kv_events_context(app: web.Application) -> AsyncIterator[None]:
    """The publisher's sockets, bound while the app runs (an aiohttp cleanup context)."""
    cache = app[WORKER].kv_events
    if cache is None:
        yield
        return
    cache.publisher.start()
    try:
        yield
    finally:
        with contextlib.suppress(zmq.ZMQError):
            await cache.publisher.close()
