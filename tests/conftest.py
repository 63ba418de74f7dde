"""Shared fixtures: a real Redis with a key prefix per test, real routers and simulated workers
on ephemeral loopback ports."""

from __future__ import annotations

import contextlib
import os
import random
import socket
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest
import redis.asyncio as aioredis
from aiohttp import web

from disagg_tools.sim.worker import WorkerConfig, running_worker
from router.app import GATEWAY, create_app
from router.config import Settings, settings_from_mapping
from router.server import serving

REDIS_URL = os.environ.get("DISAGG_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")


def free_port() -> int:
    """A free loopback port below the kernel's ephemeral range (32768+ by default), for a
    server started later: vLLM binds some of its own ZMQ sockets to port 0, and a port we
    picked there could be handed to another engine before ours binds it ("Address already
    in use", and that engine never starts)."""
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(20000, 32000)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port in 20000-31999")


MODEL = "llama-3-8b"


@pytest.fixture
async def redis_prefix() -> AsyncIterator[str]:
    """A key prefix of this test's own; every key under it is deleted afterwards."""
    prefix = f"test:{uuid.uuid4().hex[:12]}:"
    yield prefix
    client = aioredis.from_url(REDIS_URL)
    try:
        keys = [k async for k in client.scan_iter(match=prefix + "*", count=1000)]
        if keys:
            await client.delete(*keys)
    finally:
        await client.aclose()


@contextlib.asynccontextmanager
async def running_router(settings: Settings) -> AsyncIterator[tuple[str, web.Application]]:
    """The router as the CLI serves it (router/server.py: client-side bounds included)."""
    app = create_app(settings)
    async with serving(
        app, "127.0.0.1", 0, settings.timeouts, backlog=settings.listen_backlog
    ) as runner:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}", app


@dataclass
class SimCluster:
    router_url: str
    app: web.Application
    workers: dict[str, str] = field(default_factory=dict)  # id -> base URL
    configs: dict[str, WorkerConfig] = field(default_factory=dict)

    @property
    def gateway(self) -> Any:
        return self.app[GATEWAY]

    async def reserved_blocks(self) -> dict[str, int]:
        gw = self.gateway
        ids = [w.spec.id for w in gw.pools.decode_workers]
        usage = await gw.store.decode_usage(ids)
        return {wid: u.reserved_blocks for wid, u in usage.items()}

    async def stranded(self) -> dict[str, int]:
        gw = self.gateway
        return await gw.store.stranded_bytes([w.spec.id for w in gw.pools.prefill_workers])

    async def worker_requests(self, wid: str) -> list[dict[str, Any]]:
        async with aiohttp.ClientSession() as s, s.get(self.workers[wid] + "/sim/requests") as r:
            return list(await r.json())

    async def worker_state(self, wid: str) -> dict[str, Any]:
        async with aiohttp.ClientSession() as s, s.get(self.workers[wid] + "/sim/state") as r:
            return dict(await r.json())


@contextlib.asynccontextmanager
async def sim_cluster(
    *,
    prefill: int = 1,
    decode: int = 1,
    both: int = 0,
    redis_prefix: str | None,
    kv_blocks: int = 4096,
    time_scale: float = 500.0,
    worker_overrides: dict[str, dict[str, Any]] | None = None,
    **settings: Any,
) -> AsyncIterator[SimCluster]:
    """Simulated workers plus a router in front of them, all in this process on loopback."""
    roles = (
        [("prefill", f"p{i}") for i in range(prefill)]
        + [("decode", f"d{i}") for i in range(decode)]
        + [("both", f"b{i}") for i in range(both)]
    )
    async with contextlib.AsyncExitStack() as stack:
        workers: dict[str, str] = {}
        configs: dict[str, WorkerConfig] = {}
        entries = []
        for role, wid in roles:
            extra = (worker_overrides or {}).get(wid, {})
            # The worker's KV lease is in simulated seconds: at high time scales the real
            # vLLM default (30 s) would last milliseconds, and a loaded machine would see KV
            # expire between the two legs. Keep it 30 s of real time.
            fields = {
                "role": role,
                "worker_id": wid,
                "model": MODEL,
                "kv_blocks": kv_blocks,
                "time_scale": time_scale,
                "kv_lease_s": 30.0 * time_scale,
                **extra,
            }
            cfg = WorkerConfig(**fields)
            url = await stack.enter_async_context(running_worker(cfg))
            workers[wid], configs[wid] = url, cfg
            entry: dict[str, Any] = {"id": wid, "url": url, "role": role, "adapter": "sim"}
            if role != "prefill":
                entry["kv_blocks"] = extra.get("kv_blocks", kv_blocks)
            entries.append(entry)
        raw: dict[str, Any] = {
            "model": MODEL,
            "perf": {"model": MODEL, "gpu": "h100"},
            "redis_url": REDIS_URL if redis_prefix is not None else None,
            "key_prefix": redis_prefix or "dr:",
            "workers": entries,
            "health_interval_s": 0.5,
            "state_refresh_s": 0.05,
        }
        # DR_TEST_RELAY=aiohttp|splice: the decode-leg transport of every cluster whose test
        # does not choose one itself.
        if os.environ.get("DR_TEST_RELAY"):
            raw["relay"] = os.environ["DR_TEST_RELAY"]
        raw.update(settings)
        url, app = await stack.enter_async_context(running_router(settings_from_mapping(raw)))
        yield SimCluster(router_url=url, app=app, workers=workers, configs=configs)
