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
import os
import random
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
from state import open_store
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
    return {
        wid
        for wid, w in workers.items()
        if w["healthy"] and not w["drained"] and w["layout"] and w["pod_ready"] is not False
    }


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


async def drained_mark(router: str, wid: str) -> None:
    """Until `wid` shows the shared drain mark (written after it left rotation here)."""

    async def check() -> bool:
        return bool((await admin_workers(router))[wid]["drained"])

    await until(check, 5, f"{wid} drained as {router} sees it")


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
            await serving_exactly(url, {"p0", other}, within_s=5)  # out of rotation here
            await drained_mark(url, on)  # and drained for every replica
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


# --- the watch's troubles ---------------------------------------------------------------------


def _pod_requests(kube: KubeApiServer, role: str) -> tuple[list[str], list[str]]:
    """(lists, watches) of one role's pods as the stand-in received them."""
    mine = [r for r in kube.requests if "/pods" in r and f"role%3D{role}" in r.replace("=", "%3D")]
    watches = [r for r in mine if "watch=true" in r.lower()]
    return [r for r in mine if r not in watches], watches


async def test_a_410_after_compaction_lists_again_and_loses_nothing(
    tmp_path: Path, redis_prefix: str
) -> None:
    """The watch's version falls out of the server's history while it is away (dropped, then
    failing): 410 Gone, a fresh list, and what changed meanwhile is all there."""
    async with asyncio.timeout(30), fleet(tmp_path) as f:
        await f.pod("p0", "prefill")
        await f.pod("d0", "decode")
        d1 = await f.engine("d1", "decode")
        async with running_router(router_settings(f, redis_prefix)) as (url, _):
            await serving_exactly(url, {"p0", "d0"})
            lists_before, _ = _pod_requests(f.kube, "decode")
            # No await between these: the router sees none of it until it comes back.
            f.kube.fail_next(2, 500)
            f.kube.drop_watches(abrupt=False)
            f.kube.add_pod("d1", labels={"app": "sim", "role": "decode"},
                           ports={"http": d1.port}, pod_ip="127.0.0.1")  # fmt: skip
            f.kube.delete_pod("d0")
            f.kube.compact()
            await serving_exactly(url, {"p0", "d1"})
            lists_after, _ = _pod_requests(f.kube, "decode")
            assert len(lists_after) == len(lists_before) + 1  # one re-list, after the 410
            assert "d0" not in await admin_workers(url)


@pytest.mark.parametrize("abrupt", [True, False], ids=["cut", "ended"])
async def test_a_dropped_watch_resumes_from_its_version(
    tmp_path: Path, redis_prefix: str, abrupt: bool
) -> None:
    """A watch cut mid-stream (or ended by the server) is resumed from the last version seen:
    no new list, and a pod added meanwhile arrives."""
    async with asyncio.timeout(30), fleet(tmp_path) as f:
        await f.pod("p0", "prefill")
        await f.pod("d0", "decode")
        d1 = await f.engine("d1", "decode")
        async with running_router(router_settings(f, redis_prefix)) as (url, _):
            await serving_exactly(url, {"p0", "d0"})
            lists, watches = _pod_requests(f.kube, "decode")
            f.kube.drop_watches(abrupt=abrupt)
            f.kube.add_pod("d1", labels={"app": "sim", "role": "decode"},
                           ports={"http": d1.port}, pod_ip="127.0.0.1")  # fmt: skip
            await serving_exactly(url, {"p0", "d0", "d1"})
            lists_now, watches_now = _pod_requests(f.kube, "decode")
            assert lists_now == lists and len(watches_now) == len(watches) + 1
            resumed = watches_now[-1].lower()
            assert "allowwatchbookmarks=true" in resumed
            version = resumed.split("resourceversion=")[1].split("&")[0]
            assert int(version) > 100  # from where it was, not 0 (a synthetic replay of all)


@pytest.mark.parametrize("status", [500, 429])
async def test_api_errors_back_off_then_recover(
    tmp_path: Path, redis_prefix: str, status: int
) -> None:
    """The API failing (500, or 429 with Retry-After): the watch waits, longer each time (with
    jitter), then comes back and catches up."""
    async with asyncio.timeout(30), fleet(tmp_path) as f:
        await f.pod("p0", "prefill")
        await f.pod("d0", "decode")
        d1 = await f.engine("d1", "decode")
        settings = router_settings(f, redis_prefix, discovery={"backoff_s": 0.1,
                                                               "backoff_max_s": 0.4})  # fmt: skip
        async with running_router(settings) as (url, _):
            await serving_exactly(url, {"p0", "d0"})
            failures = 6
            f.kube.fail_next(failures, status)
            start = time.monotonic()
            f.kube.drop_watches(abrupt=False)
            f.kube.add_pod("d1", labels={"app": "sim", "role": "decode"},
                           ports={"http": d1.port}, pod_ip="127.0.0.1")  # fmt: skip
            await serving_exactly(url, {"p0", "d0", "d1"})
            took = time.monotonic() - start
            # Two watches (prefill, decode) share the failures; each waited at least half of
            # 0.1, 0.2, ... after each of its own: never a tight loop of retries.
            assert took >= 0.05 + 0.1, took
            assert f.kube.state.faults.fail_next == 0  # every failure was met


# --- replicas ---------------------------------------------------------------------------------


async def registered(redis_prefix: str) -> set[str]:
    """The ids in the shared registry, as the store has them."""
    store = await open_store(REDIS_URL, redis_prefix)
    try:
        return set(await store.registered_workers())
    finally:
        await store.close()


async def test_two_replicas_on_one_redis_see_one_registry(
    tmp_path: Path, redis_prefix: str
) -> None:
    async with asyncio.timeout(30), fleet(tmp_path) as f:
        await f.pod("p0", "prefill")
        await f.pod("d0", "decode")
        settings = router_settings(f, redis_prefix)
        async with running_router(settings) as (a, _), running_router(settings) as (b, _):
            for url in (a, b):
                await serving_exactly(url, {"p0", "d0"})
            await f.pod("d1", "decode")
            f.kube.set_ready("d0", False)
            for url in (a, b):
                await serving_exactly(url, {"p0", "d1"})
                await drained_mark(url, "d0")
            assert await registered(redis_prefix) == {"p0", "d0", "d1"}
            f.kube.delete_pod("d0")
            for url in (a, b):
                await serving_exactly(url, {"p0", "d1"})

            async def unregistered() -> bool:
                return await registered(redis_prefix) == {"p0", "d1"}

            await until(unregistered, 5, "d0 out of the shared registry")
        # A replica started later adopts the registry as it is, and its own watch agrees.
        async with running_router(settings) as (c, _):
            await serving_exactly(c, {"p0", "d1"})


async def test_churn_converges_on_every_replica_within_2_s(
    tmp_path: Path, redis_prefix: str
) -> None:
    """Pods added and removed at 10 per second for 10 s (DR_KUBE_CHURN_S=60 runs the minute
    of docs/kubernetes.md): after the last change, every replica's pools and the shared
    registry match the pods within 2 s."""
    churn_s = float(os.environ.get("DR_KUBE_CHURN_S", "10"))
    async with asyncio.timeout(churn_s + 80), fleet(tmp_path) as f:
        await f.pod("p0", "prefill")
        engines = [await f.engine(f"c{i}", "decode") for i in range(12)]
        settings = router_settings(f, redis_prefix)
        async with running_router(settings) as (a, _), running_router(settings) as (b, _):
            for url in (a, b):
                await serving_exactly(url, {"p0"})
            live: set[str] = set()
            rng = random.Random(34)
            end = time.monotonic() + churn_s
            changes = 0
            while time.monotonic() < end:
                if changes:
                    await asyncio.sleep(0.1)  # between changes: the last is measured from
                engine = rng.choice(engines)
                if engine.name in live:
                    f.kube.delete_pod(engine.name)
                    live.discard(engine.name)
                else:
                    f.kube.add_pod(engine.name, labels={"app": "sim", "role": "decode"},
                                   ports={"http": engine.port}, pod_ip="127.0.0.1")  # fmt: skip
                    live.add(engine.name)
                changes += 1
                last_change = time.monotonic()
            assert changes >= 8 * churn_s  # about ten a second, even on a loaded machine
            want = {"p0", *live}
            took = []  # seconds from the last change until each view matches the pods
            for url in (a, b):
                await serving_exactly(url, want, within_s=2.0)
                took.append(time.monotonic() - last_change)

            async def shared() -> bool:
                return await registered(redis_prefix) == want

            await until(shared, 2.0, "the shared registry")
            took.append(time.monotonic() - last_change)
            assert max(took) <= 2.0, took
            print(f"churn: {changes} changes in {churn_s:g} s, {len(want)} workers at the end; "
                  f"converged after the last change in {', '.join(f'{t:.2f}' for t in took)} s "
                  "(replica a, replica b, store)")  # fmt: skip


# --- a rollout to a new KV layout -------------------------------------------------------------


@dataclass
class Load:
    """Streams sent round-robin to the replicas until stopped; each answer checked exactly."""

    routers: list[str]
    sent: int = 0
    bad: list[str] = field(default_factory=list)
    stop: asyncio.Event = field(default_factory=asyncio.Event)

    async def client(self, session: aiohttp.ClientSession, k: int) -> None:
        i = 0
        while not self.stop.is_set():
            b = body(f"client {k} request {i}", n=16)
            router = self.routers[(k + i) % len(self.routers)]
            status, text = await chat(session, router, b)
            self.sent += 1
            if status != 200:
                self.bad.append(f"{status}: {text[:200]}")
            elif text != expected_answer(CHAT, b)[0]:
                self.bad.append(f"inexact answer to {b['messages'][0]['content']!r}")
            i += 1


async def rollout_decode_pool(f: Fleet, routers: list[str]) -> None:
    """As a Deployment rollout with maxSurge 1, maxUnavailable 0, after the new prefill pods
    are up (docs/kubernetes.md): a new decode pod, Ready on every replica, then an old one
    Terminating (drained), then deleted; and so on; then the old prefill pod goes."""
    await f.pod("pb0", "prefill", layout="b", rev="r2")
    for url in routers:
        await until(lambda u=url: _has(u, "pb0"), 10, f"pb0 on {url}")  # type: ignore[misc]
    for old, new in (("da0", "db0"), ("da1", "db1")):
        await f.pod(new, "decode", layout="b", rev="r2")
        for url in routers:
            await until(lambda u=url, n=new: _has(u, n), 10, f"{new} on {url}")  # type: ignore[misc]
        f.kube.terminate_pod(old)
        await asyncio.sleep(0.3)  # the streams on it finish (the grace period)
        f.kube.delete_pod(old)
    f.kube.terminate_pod("pa0")
    await asyncio.sleep(0.3)
    f.kube.delete_pod("pa0")


async def _has(router: str, wid: str) -> bool:
    return wid in serving(await admin_workers(router))


async def test_a_decode_rollout_to_a_new_layout_under_load(
    tmp_path: Path, redis_prefix: str
) -> None:
    """Two replicas, load all along, the decode pool rolled to layout b (the prefill pool
    surged first): no prefill of one layout handed to a decode of the other, no 5xx (no error
    at all), every answer exact, nothing left reserved."""
    async with asyncio.timeout(90), fleet(tmp_path, time_scale=25.0) as f:
        await f.pod("pa0", "prefill", layout="a")
        await f.pod("da0", "decode", layout="a")
        await f.pod("da1", "decode", layout="a")
        settings = router_settings(f, redis_prefix)
        async with (
            running_router(settings) as (a, _),
            running_router(settings) as (b, _),
            aiohttp.ClientSession() as session,
        ):
            for url in (a, b):
                await serving_exactly(url, {"pa0", "da0", "da1"})
            load = Load([a, b])
            # The decode engines keep their last 256 requests: read them all along.
            legs: dict[tuple[str, str], dict[str, Any]] = {}
            stop_reading = asyncio.Event()
            decodes = [f.engines[n] for n in ("da0", "da1")]

            async def read_legs() -> None:
                while True:
                    last = stop_reading.is_set()  # a pass begun after the load ended: the last
                    for e in [*decodes, *(f.engines[n] for n in ("db0", "db1") if n in f.engines)]:
                        for r in await e.requests():
                            legs.setdefault((e.name, r["body"]["messages"][0]["content"]), r)
                    if last:
                        return
                    await asyncio.sleep(0.05)

            reader = asyncio.create_task(read_legs())
            clients = [asyncio.create_task(load.client(session, k)) for k in range(6)]
            await asyncio.sleep(0.5)
            await rollout_decode_pool(f, [a, b])
            for url in (a, b):
                await serving_exactly(url, {"pb0", "db0", "db1"})
            await asyncio.sleep(0.5)
            load.stop.set()
            await asyncio.gather(*clients)
            assert load.sent >= 50 and not load.bad, (load.sent, load.bad[:5])
            print(f"rollout: {load.sent} streams through 2 replicas, none failed or inexact")
            # Every decode leg's KV came from a prefill of its own layout.
            layout_of = {"pa0": "a", "da0": "a", "da1": "a", "pb0": "b", "db0": "b", "db1": "b"}
            by_port = {e.port: e.name for e in f.engines.values()}
            pairs: dict[tuple[str, str], int] = {}
            stop_reading.set()
            await reader
            for (name, _), r in legs.items():
                prefill = by_port[r["body"]["kv_transfer_params"]["remote_port"]]
                key = (layout_of[prefill], layout_of[name])
                pairs[key] = pairs.get(key, 0) + 1
            # every request's decode leg looked at (each prompt is one request's)
            assert len({prompt for _, prompt in legs}) == load.sent
            assert set(pairs) == {("a", "a"), ("b", "b")}, pairs  # both served, never crossed
            print(f"rollout: decode legs by (prefill layout, decode layout): {pairs}")
            # Nothing left reserved, on any decode worker old or new.
            store = await open_store(REDIS_URL, redis_prefix)
            try:

                async def released() -> bool:
                    usage = await store.decode_usage(["da0", "da1", "db0", "db1"])
                    return all(u.reserved_blocks == 0 for u in usage.values())

                await until(released, 5, "every reservation released")
            finally:
                await store.close()


# --- readiness from EndpointSlices ----------------------------------------------------------------


def _endpoint(name: str, ready: bool, terminating: bool = False) -> dict[str, Any]:
    return {
        "addresses": ["127.0.0.1"],
        "conditions": {"ready": ready, "serving": ready, "terminating": terminating},
        "targetRef": {"kind": "Pod", "name": name, "namespace": "default"},
    }


async def test_endpointslices_decide_readiness(tmp_path: Path, redis_prefix: str) -> None:
    """source endpointslices: a pod is in rotation when its Service's EndpointSlice says its
    endpoint is ready (and not terminating), whatever its own condition says."""
    async with asyncio.timeout(30), fleet(tmp_path) as f:
        await f.pod("p0", "prefill")
        await f.pod("d0", "decode")
        await f.pod("d1", "decode")

        def slice_(**ready: bool) -> None:
            f.kube.put_endpoint_slice(
                "engines-abc",
                service="engines",
                endpoints=[_endpoint(n, r) for n, r in ready.items()],
                ports={"http": 8000},
            )

        slice_(p0=True, d0=True, d1=False)
        settings = router_settings(f, redis_prefix, discovery={"source": "endpointslices"})
        async with running_router(settings) as (url, _):
            await serving_exactly(url, {"p0", "d0"})
            slice_(p0=True, d0=True, d1=True)
            await serving_exactly(url, {"p0", "d0", "d1"})
            f.kube.put_endpoint_slice(
                "engines-abc",
                service="engines",
                endpoints=[
                    _endpoint("p0", True),
                    _endpoint("d0", False, terminating=True),
                    _endpoint("d1", True),
                ],  # fmt: skip
                ports={"http": 8000},
            )
            await serving_exactly(url, {"p0", "d1"})
            await drained_mark(url, "d0")


async def test_pods_of_the_both_selector_serve_whole_requests(
    tmp_path: Path, redis_prefix: str
) -> None:
    """`both_selector` (elastic roles, or sglang-router's plain `--selector`): the pods join as
    `both` workers and serve requests alone; the role manager, not a label, moves them."""
    async with asyncio.timeout(30), fleet(tmp_path) as f:
        for name in ("b0", "b1"):
            engine = await f.engine(name, "both")
            f.kube.add_pod(name, labels={"app": "sim", "role": "both"},
                           ports={"http": engine.port}, pod_ip="127.0.0.1")  # fmt: skip
        settings = router_settings(
            f, redis_prefix,
            discovery={"prefill_selector": "", "decode_selector": "", "both_selector": "app=sim"},
        )  # fmt: skip
        async with running_router(settings) as (url, _), aiohttp.ClientSession() as s:
            await serving_exactly(url, {"b0", "b1"})
            assert {w["role"] for w in (await admin_workers(url)).values()} == {"both"}
            b = body("served whole")
            assert await chat(s, url, b) == (200, expected_answer(CHAT, b)[0])


async def test_a_replica_starting_while_the_api_is_down_serves_the_shared_registry(
    tmp_path: Path, redis_prefix: str
) -> None:
    """Until its own watch has listed, a replica trusts the registry the others keep (and its
    drain marks): an API server down at its start-up does not empty its pools."""
    async with asyncio.timeout(30), fleet(tmp_path) as f:
        await f.pod("p0", "prefill")
        await f.pod("d0", "decode")
        await f.pod("d1", "decode")
        settings = router_settings(f, redis_prefix)
        async with running_router(settings) as (a, _):
            await serving_exactly(a, {"p0", "d0", "d1"})
            f.kube.set_ready("d1", False)
            await serving_exactly(a, {"p0", "d0"})
            f.kube.fail_next(10_000, 500)  # the API answers nothing from now on
            async with running_router(settings) as (b, _), aiohttp.ClientSession() as s:
                await serving_exactly(b, {"p0", "d0"})  # d1 drained by the shared mark
                bd = body("while the API is down")
                assert await chat(s, b, bd) == (200, expected_answer(CHAT, bd)[0])
                f.kube.fail_next(0)
                f.kube.set_ready("d1", True)
                for url in (a, b):
                    await serving_exactly(url, {"p0", "d0", "d1"})
