"""Kubernetes discovery end to end: the stand-in API server (disagg_tools/kubeapi), simulated
workers as the pods' engines, real routers on a real Redis, loopback only.

Each pod is a simulated worker's address (127.0.0.1 and a named port `http`); its labels pick
its role, its `disagg-router.io/kv-layout` annotation a KV layout the engine cannot tell. What
a test checks it reads from the outside: the routers' /admin/workers, the workers' request
logs, the answers' texts, the store's reservations. Every wait is bounded.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest

from disagg_tools.kubeapi.kubeconfig import write_kubeconfig
from disagg_tools.kubeapi.server import KubeApiServer, KubeApiSettings, running_kubeapi
from disagg_tools.kubeapi.watch import WatchSettings
from disagg_tools.sim.textgen import expected_answer
from disagg_tools.sim.worker import WorkerConfig, running_worker
from router.config import merged_settings, settings_from_mapping
from tests.conftest import MODEL, REDIS_URL, running_router
from tests.router.request.test_faults import sse_text

CHAT = "/v1/chat/completions"
FAST = WatchSettings(bookmark_interval_s=0.2, too_large_wait_s=0.3)
LAYOUT = "disagg-router.io/kv-layout"


@dataclass
class Engine:
    """One simulated worker, the engine of one pod."""

    name: str
    role: str
    url: str
    config: WorkerConfig

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    async def requests(self) -> list[dict[str, Any]]:
        async with aiohttp.ClientSession() as s, s.get(self.url + "/sim/requests") as r:
            return list(await r.json())


@dataclass
class Fleet:
    """The stand-in API server, the engines, and a way to start more of them."""

    kube: KubeApiServer
    kubeconfig: Path
    stack: contextlib.AsyncExitStack
    time_scale: float
    engines: dict[str, Engine] = field(default_factory=dict)

    async def engine(self, name: str, role: str) -> Engine:
        cfg = WorkerConfig(
            role=role,
            worker_id=name,
            model=MODEL,
            kv_blocks=4096,
            time_scale=self.time_scale,
            kv_lease_s=30.0 * self.time_scale,
        )
        url = await self.stack.enter_async_context(running_worker(cfg))
        self.engines[name] = Engine(name, role, url, cfg)
        return self.engines[name]

    async def pod(
        self, name: str, role: str, *, ready: bool = True, layout: str = "a", rev: str = "r1"
    ) -> Engine:
        """An engine and its pod (labels app=sim, role, pod-template-hash)."""
        engine = self.engines.get(name) or await self.engine(name, role)
        self.kube.add_pod(
            name,
            labels={"app": "sim", "role": role, "pod-template-hash": rev},
            annotations={LAYOUT: orjson.dumps({"engine_version": layout}).decode()},
            ports={"http": engine.port},
            ready=ready,
            pod_ip="127.0.0.1",
        )
        return engine


@contextlib.asynccontextmanager
async def fleet(
    tmp_path: Path, time_scale: float = 500.0, history: int = 1000
) -> AsyncIterator[Fleet]:
    async with contextlib.AsyncExitStack() as stack:
        kube = await stack.enter_async_context(
            running_kubeapi(KubeApiSettings(history_size=history, watch=FAST))
        )
        config = write_kubeconfig(tmp_path / "kubeconfig", kube.url)
        yield Fleet(kube, config, stack, time_scale)


def router_settings(f: Fleet, redis_prefix: str, **over: Any) -> Any:
    raw: dict[str, Any] = {
        "model": MODEL,
        "perf": {"model": MODEL, "gpu": "h100"},
        "store": {"url": REDIS_URL, "key_prefix": redis_prefix},
        "loops": {"health_interval_s": 0.5, "state_refresh_s": 0.05, "registry_refresh_s": 0.5},
        "discovery": {
            "kind": "kubernetes",
            "kubeconfig": str(f.kubeconfig),
            "namespace": "default",
            "prefill_selector": "app=sim,role=prefill",
            "decode_selector": "app=sim,role=decode",
            "adapter": "sim",
            "kv_blocks": 4096,
            "backoff_s": 0.05,
            "backoff_max_s": 0.4,
        },
    }
    return settings_from_mapping(merged_settings(raw, over))


async def admin_workers(router: str) -> dict[str, dict[str, Any]]:
    async with aiohttp.ClientSession() as s, s.get(router + "/admin/workers") as r:
        assert r.status == 200
        return {w["id"]: w for w in (await r.json())["workers"]}


def serving(workers: dict[str, dict[str, Any]]) -> set[str]:
    """The workers in rotation as /admin/workers shows them."""
    return {wid for wid, w in workers.items() if w["healthy"] and not w["drained"] and w["layout"]}


async def until(check: Callable[[], Awaitable[bool]], within_s: float, what: str) -> float:
    """Poll `check` every 20 ms; the seconds it took (fails after `within_s`)."""
    start = time.monotonic()
    while not await check():
        if time.monotonic() - start > within_s:
            raise AssertionError(f"not within {within_s} s: {what}")
        await asyncio.sleep(0.02)
    return time.monotonic() - start


async def serving_exactly(router: str, ids: set[str], within_s: float = 10.0) -> float:
    async def check() -> bool:
        return serving(await admin_workers(router)) == ids

    return await until(check, within_s, f"{router} serving {sorted(ids)}")


def body(text: str, n: int = 24, stream: bool = True) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": n,
        "ignore_eos": True,
        "stream": stream,
    }


async def chat(session: aiohttp.ClientSession, router: str, b: dict[str, Any]) -> tuple[int, str]:
    """(status, text) of one streamed chat request; a stream's error frame fails it."""
    async with session.post(router + CHAT, json=b) as r:
        raw = await r.read()
        if r.status != 200:
            return r.status, raw.decode(errors="replace")
    text, _, errors = sse_text(raw)
    assert not errors, errors
    return 200, text


# --- adoption ---------------------------------------------------------------------------------


async def test_ready_pods_are_adopted_and_served(tmp_path: Path, redis_prefix: str) -> None:
    async with asyncio.timeout(30), fleet(tmp_path) as f:
        await f.pod("p0", "prefill")
        await f.pod("d0", "decode")
        await f.pod("d1", "decode", ready=False)  # not adopted while NotReady
        f.kube.add_pod("other", labels={"app": "else", "role": "decode"}, pod_ip="127.0.0.1")
        async with running_router(router_settings(f, redis_prefix)) as (url, _):
            await serving_exactly(url, {"p0", "d0"})
            w = (await admin_workers(url))["d0"]
            assert w["pod"] == "default/d0" and w["revision"] == "r1" and w["dynamic"]
            assert w["url"] == f.engines["d0"].url and w["layout"].split("|")[1] == "a"
            b = body("adopted")
            async with aiohttp.ClientSession() as s:
                assert await chat(s, url, b) == (200, expected_answer(CHAT, b)[0])
            assert len(await f.engines["d0"].requests()) == 1
            f.kube.set_ready("d1", True)
            await serving_exactly(url, {"p0", "d0", "d1"})


# --- leaving rotation -------------------------------------------------------------------------


async def _stream_on(
    session: aiohttp.ClientSession, router: str, f: Fleet, b: dict[str, Any]
) -> tuple[asyncio.Task[tuple[int, str]], str]:
    """A long stream started; the decode pod it runs on (found from the engines' logs)."""
    task = asyncio.create_task(chat(session, router, b))
    decodes = [e for e in f.engines.values() if e.role == "decode"]

    async def placed() -> bool:
        return any([await e.requests() for e in decodes])

    await until(placed, 10, "the stream placed")
    (on,) = [e.name for e in decodes if await e.requests()]
    return task, on


@pytest.mark.parametrize("how", ["not_ready", "terminating"])
async def test_a_pod_leaving_is_drained_its_stream_finishes_then_it_goes(
    tmp_path: Path, redis_prefix: str, how: str
) -> None:
    """NotReady (or Terminating): no new request reaches it, the stream on it ends exactly;
    deleted: it leaves the pools."""
    async with asyncio.timeout(60), fleet(tmp_path, time_scale=4.0) as f:
        await f.pod("p0", "prefill")
        await f.pod("d0", "decode")
        await f.pod("d1", "decode")
        async with (
            running_router(router_settings(f, redis_prefix)) as (url, _),
            aiohttp.ClientSession() as s,
        ):
            await serving_exactly(url, {"p0", "d0", "d1"})
            long = body("a long answer", n=400)
            stream, on = await _stream_on(s, url, f, long)
            other = "d1" if on == "d0" else "d0"
            if how == "not_ready":
                f.kube.set_ready(on, False)
            else:
                f.kube.terminate_pod(on)
            await serving_exactly(url, {"p0", other}, within_s=5)
            assert (await admin_workers(url))[on]["drained"]
            assert not stream.done()  # still streaming while drained
            before = len(await f.engines[on].requests())
            for i in range(8):
                b = body(f"after {i}")
                assert await chat(s, url, b) == (200, expected_answer(CHAT, b)[0])
            assert len(await f.engines[on].requests()) == before  # none reached it
            assert await stream == (200, expected_answer(CHAT, long)[0])
            f.kube.delete_pod(on)

            async def gone() -> bool:
                return on not in await admin_workers(url)

            await until(gone, 5, f"{on} removed")
