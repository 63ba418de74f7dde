"""Shared fixtures: a real Redis with a key prefix per test, real routers and simulated workers
on ephemeral loopback ports.

The Redis is chosen when the session starts (tests/session_redis.py): the configured one when
it answers, else a private `redis-server` for this session, else the session stops at once.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from disagg_tools.sim.dp_front import running_dp_worker
from disagg_tools.sim.worker import WorkerConfig, running_worker
from router.config import Settings, merged_settings, settings_from_mapping
from router.edge.app import create_app
from router.edge.server import serving
from tests.app_parts import AppParts
from tests.ports import free_port as free_port
from tests.redis_dump import delete_prefix  # re-exported: test modules import it from here
from tests.session_redis import Plan, SessionRedis, configured

# The session's Redis URL. Until pytest_configure has run it is the configured one; there it
# becomes the private server's when one is started. Test modules bind it by
# `from tests.conftest import REDIS_URL` when they are collected, which is after that.
REDIS_URL = configured(os.environ).url
_SESSION_REDIS = SessionRedis(os.environ)


def pytest_configure(config: pytest.Config) -> None:
    """Runs before the terminal reporter exists, so a pytest.exit here prints its one line
    (`Exit: ...` on stderr) and nothing else; the line about a private server is written in
    pytest_sessionstart, where the reporter is there to show it also under -q."""
    global REDIS_URL
    if config.option.help:
        return
    try:
        chosen = _SESSION_REDIS.start()
    except RuntimeError as exc:  # the binary is there but the server did not come up
        pytest.exit(f"could not start a private redis-server: {exc}", returncode=4)
    if chosen is Plan.STOP:
        pytest.exit(_SESSION_REDIS.stop_line(), returncode=4)
    REDIS_URL = _SESSION_REDIS.url


@pytest.hookimpl(trylast=True)
def pytest_sessionstart(session: pytest.Session) -> None:
    if _SESSION_REDIS.private is None:
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line(_SESSION_REDIS.private_line())


def pytest_unconfigure(config: pytest.Config) -> None:
    """Also after a failure or Ctrl-C: pytest unconfigures on every way out."""
    _SESSION_REDIS.stop()


MODEL = "llama-3-8b"


@pytest.fixture
async def redis_prefix() -> AsyncIterator[str]:
    """A key prefix of this test's own; every key under it is deleted afterwards."""
    prefix = f"test:{uuid.uuid4().hex[:12]}:"
    yield prefix
    await delete_prefix(REDIS_URL, prefix)


@contextlib.asynccontextmanager
async def running_router(settings: Settings) -> AsyncIterator[tuple[str, web.Application]]:
    """The router as the CLI serves it (router/edge/server.py: client-side bounds included)."""
    app = create_app(settings)
    async with serving(
        app, "127.0.0.1", 0, settings.timeouts, backlog=settings.server.listen_backlog
    ) as runner:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}", app


@dataclass
class SimCluster:
    router_url: str
    app: web.Application
    workers: dict[str, str] = field(default_factory=dict)  # id -> base URL
    configs: dict[str, WorkerConfig] = field(default_factory=dict)

    @property
    def parts(self) -> AppParts:
        return AppParts(self.app)

    async def reserved_blocks(self) -> dict[str, int]:
        gw = self.parts
        ids = [w.spec.id for w in gw.pools.decode_workers]
        usage = await gw.store.decode_usage(ids)
        return {wid: u.reserved_blocks for wid, u in usage.items()}

    async def stranded(self) -> dict[str, int]:
        gw = self.parts
        ids = [w.spec.id for w in gw.pools.prefill_workers]
        return dict(await gw.store.stranded_bytes(ids))

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
    entry_overrides: dict[str, dict[str, Any]] | None = None,  # the router's entry, by id
    dp: dict[str, int] | None = None,
    redis_url: str = REDIS_URL,
    **settings: Any,
) -> AsyncIterator[SimCluster]:
    """Simulated workers plus a router in front of them, all in this process on loopback.
    `dp`: data-parallel ranks by worker id (disagg_tools/sim/dp_front.py), each entry's
    `dp_size` and `kv_blocks` per rank. `redis_url`: the store, when `redis_prefix` is given
    (the session's Redis by default; a private one for tests that restart it)."""
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
            ranks = (dp or {}).get(wid, 1)
            serving = running_dp_worker(cfg, ranks) if ranks > 1 else running_worker(cfg)
            url = await stack.enter_async_context(serving)
            workers[wid], configs[wid] = url, cfg
            entry: dict[str, Any] = {"id": wid, "url": url, "role": role, "adapter": "sim"}
            if ranks > 1:
                entry["dp_size"] = ranks
            if role != "prefill":
                entry["kv_blocks"] = extra.get("kv_blocks", kv_blocks)
            entry.update((entry_overrides or {}).get(wid, {}))
            entries.append(entry)
        raw: dict[str, Any] = {
            "model": MODEL,
            "perf": {"model": MODEL, "gpu": "h100"},
            "store": {
                "url": redis_url if redis_prefix is not None else None,
                "key_prefix": redis_prefix or "dr:",
            },
            "workers": entries,
            "loops": {"health_interval_s": 0.5, "state_refresh_s": 0.05},
        }
        # DR_TEST_RELAY=aiohttp|splice: the decode-leg transport of every cluster whose test
        # does not choose one itself.
        if os.environ.get("DR_TEST_RELAY"):
            raw["upstream"] = {"relay": os.environ["DR_TEST_RELAY"]}
        # DR_TEST_FRONT_DOOR=lean|aiohttp: the front door of every cluster whose test does not
        # choose one itself (router/edge/lean_door.py).
        if os.environ.get("DR_TEST_FRONT_DOOR"):
            raw["server"] = {"front_door": os.environ["DR_TEST_FRONT_DOOR"]}
        # A test's settings over these: a group's given settings replace only their own.
        raw = merged_settings(raw, settings)
        url, app = await stack.enter_async_context(running_router(settings_from_mapping(raw)))
        yield SimCluster(router_url=url, app=app, workers=workers, configs=configs)
