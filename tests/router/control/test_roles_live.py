"""Elastic roles live (docs/elastic-roles.md, "Live"): two router replicas sharing Redis in front
of three simulated `both` workers; an operator (the admin API) moves a worker from decode to
prefill and back while streaming traffic flows through the official openai client. No stream is
cut, no token lost or repeated (the simulated workers' answers are deterministic), a stream still
running on the worker past the drain deadline resumes elsewhere with the exact text, and Redis
holds no reservation and no stranded KV afterwards."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
from aiohttp import web
from openai import AsyncOpenAI

from disagg_tools.sim.textgen import expected_answer
from disagg_tools.sim.worker import WorkerConfig, running_worker
from policies.role_policies import ElasticRoles
from router.control.role_manager import ROLES
from tests.app_parts import parts
from tests.conftest import MODEL, running_router
from tests.router.edge.test_admin import TOKEN, _settings

CHAT = "/v1/chat/completions"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
WORKERS = ("b0", "b1", "b2")
DEADLINE_S = 2.0
LONG_TOKENS = 1200  # a stream that outlives the drain deadline


@contextlib.asynccontextmanager
async def _cluster(prefix: str) -> AsyncIterator[list[tuple[str, web.Application]]]:
    async with contextlib.AsyncExitStack() as stack:
        workers: list[dict[str, Any]] = []
        for wid in WORKERS:
            config = WorkerConfig(
                role="both", worker_id=wid, model=MODEL, time_scale=1.0, kv_blocks=4096
            )
            url = await stack.enter_async_context(running_worker(config))
            workers.append(
                {"id": wid, "url": url, "role": "both", "adapter": "sim", "kv_blocks": 4096}
            )
        roles = {"interval_s": 0.1, "settle_s": 0.3, "drain_deadline_s": DEADLINE_S}
        settings = _settings(prefix, workers, roles=roles)
        replicas = [await stack.enter_async_context(running_router(settings)) for _ in "ab"]
        yield replicas


async def _roles(s: aiohttp.ClientSession, url: str) -> dict[str, str]:
    async with s.get(url + "/admin/roles") as r:
        assert r.status == 200, await r.text()
        return {w["id"]: w["role"] for w in (await r.json())["workers"]}


async def _force(s: aiohttp.ClientSession, url: str, wid: str, role: str) -> dict[str, Any]:
    async with s.post(f"{url}/admin/workers/{wid}/role", json={"role": role}, headers=AUTH) as r:
        assert r.status == 200, await r.text()
        return dict(await r.json())


async def _until_role(s: aiohttp.ClientSession, urls: list[str], wid: str, role: str) -> None:
    seen: list[dict[str, str]] = []
    for _ in range(400):
        seen = [await _roles(s, u) for u in urls]
        if all(r.get(wid) == role for r in seen):
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"{wid} never became {role}: {seen}")


async def _until(cond: Callable[[], bool], what: str, timeout_s: float = 60.0) -> None:
    for _ in range(int(timeout_s / 0.02)):
        if cond():
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"never: {what}")


def _placements(apps: list[web.Application], *, prefill: str = "", decode: str = "") -> float:
    total = 0.0
    for app in apps:
        for metric in parts(app).metrics.registry.collect():
            if metric.name != "disagg_router_placements":
                continue
            for sample in metric.samples:
                if not sample.name.endswith("_total"):
                    continue
                labels = sample.labels
                if prefill and labels["prefill"] != prefill:
                    continue
                if decode and labels["decode"] != decode:
                    continue
                total += sample.value
    return total


def _sample(apps: list[web.Application], name: str, **labels: str) -> float:
    return sum(parts(app).metrics.registry.get_sample_value(name, labels) or 0.0 for app in apps)


def _b2_drained(apps: list[web.Application]) -> list[bool]:
    return [parts(app).pools.workers["b2"].drained for app in apps]


class Traffic:
    """Streams of chat completions through the openai client, round-robin over the replicas,
    each checked against the worker's deterministic answer."""

    def __init__(self, urls: list[str]) -> None:
        self.clients = [
            AsyncOpenAI(base_url=u + "/v1", api_key="k", max_retries=0, timeout=60) for u in urls
        ]
        self.done = 0
        self.failures: list[str] = []
        self._stop = asyncio.Event()
        self._go = asyncio.Event()
        self._go.set()
        self.idle = asyncio.Event()  # set while paused between two batches

    async def one(self, i: int, tag: str, tokens: int) -> None:
        body: dict[str, Any] = {
            "model": MODEL,
            "messages": [{"role": "user", "content": f"{tag} {i}"}],
            "max_tokens": tokens,
            "stream": True,
        }
        headers = {"X-Sim-Output-Tokens": str(tokens)}
        client = self.clients[i % len(self.clients)]
        text: list[str] = []
        try:
            stream = await client.chat.completions.create(
                model=MODEL,
                messages=body["messages"],
                max_tokens=tokens,
                stream=True,
                extra_headers=headers,
            )
            async for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    text.append(chunk.choices[0].delta.content)
        except Exception as exc:  # recorded, asserted on by the test
            self.failures.append(f"{tag} {i}: {exc!r}")
            return
        want = expected_answer(CHAT, body, headers)[0]
        if "".join(text) != want:
            self.failures.append(f"{tag} {i}: {''.join(text)!r} != {want!r}")
        self.done += 1

    async def flow(self, concurrency: int = 4) -> None:
        i = 0
        while not self._stop.is_set():
            if not self._go.is_set():
                self.idle.set()
                await self._go.wait()
                self.idle.clear()
            await asyncio.gather(*(self.one(i + k, "flow", 12) for k in range(concurrency)))
            i += concurrency

    async def pause(self) -> None:
        self._go.clear()
        await self.idle.wait()

    def resume(self) -> None:
        self._go.set()

    def stop(self) -> None:
        self._stop.set()
        self._go.set()

    async def close(self) -> None:
        for client in self.clients:
            await client.close()


async def _clean(apps: list[web.Application]) -> None:
    """No reservation and no stranded KV left in Redis (every worker, every ledger)."""
    store = parts(apps[0]).store
    for _ in range(100):
        usage = await store.decode_usage(WORKERS)
        stranded = await store.stranded_bytes(WORKERS)
        if all(u.reservations == 0 and u.reserved_blocks == 0 for u in usage.values()) and not any(
            stranded.values()
        ):
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"Redis not clean: {usage} {stranded}")


async def _long_stream_on_b1(
    s: aiohttp.ClientSession, url: str, apps: list[web.Application], traffic: Traffic
) -> asyncio.Task[None]:
    """A long stream started on b1: the flow paused and b2 drained for a moment, so that the
    choice is not the policy's."""
    await traffic.pause()
    await s.post(url + "/admin/workers/b2/drain", headers=AUTH)
    await _until(lambda: _b2_drained(apps) == [True, True], "b2 drained")
    on_b1 = _placements(apps, decode="b1")
    long = asyncio.create_task(traffic.one(0, "long", LONG_TOKENS))
    await _until(lambda: _placements(apps, decode="b1") > on_b1, "the long stream on b1")
    await s.post(url + "/admin/workers/b2/undrain", headers=AUTH)
    await _until(lambda: _b2_drained(apps) == [False, False], "b2 back")
    traffic.resume()
    return long


async def test_a_worker_moves_decode_to_prefill_and_back_under_traffic(redis_prefix: str) -> None:
    async with _cluster(redis_prefix) as replicas, aiohttp.ClientSession() as s:
        urls = [u for u, _ in replicas]
        apps = [app for _, app in replicas]
        a, b = urls
        async with s.post(a + "/admin/workers/b0/role", json={"role": "prefill"}) as r:
            assert r.status == 401  # the admin token is required
        pre = {"role": "prefill"}
        async with s.post(a + "/admin/workers/nope/role", json=pre, headers=AUTH) as r:
            assert r.status == 404
        async with s.post(a + "/admin/workers/b0/role", json={"role": "up"}, headers=AUTH) as r:
            assert r.status == 400 and (await r.json())["error"]["param"] == "role"
        assert (await _roles(s, a)) == {w: "both" for w in WORKERS}

        # The starting split, 1P:2D (b0 serving prefill first: a worker on its way there does
        # not count for the guard rails, so b2 could not leave the prefill side before).
        assert (await _force(s, a, "b0", "prefill"))["current_role"] == "draining-to-prefill"
        await _until_role(s, urls, "b0", "prefill")
        await _force(s, b, "b1", "decode")
        await _force(s, b, "b2", "decode")
        await _until_role(s, urls, "b0", "prefill")
        await _until_role(s, urls, "b1", "decode")
        await _until_role(s, urls, "b2", "decode")

        traffic = Traffic(urls)
        flow = asyncio.create_task(traffic.flow())
        long: asyncio.Task[None] | None = None
        try:
            await _until(lambda: traffic.done >= 8, "traffic flows")
            assert _placements(apps, prefill="b1") == 0

            long = await _long_stream_on_b1(s, a, apps, traffic)

            # b1: decode -> prefill while the long stream runs on it and traffic flows.
            forced = await _force(s, b, "b1", "prefill")
            assert forced["current_role"] == "draining-to-prefill"
            again = await _force(s, a, "b1", "prefill")  # already on its way: no second flip
            assert again["role_version"] == forced["role_version"]
            await asyncio.sleep(0.5)  # every replica has seen the drain
            decodes_on_b1 = _placements(apps, decode="b1")
            await _until_role(s, urls, "b1", "prefill")  # past the deadline, the stream moved
            assert _placements(apps, decode="b1") == decodes_on_b1  # nothing new while draining
            events = await _events(s, urls)
            assert any(e["trigger"] == "drained" and e["worker"] == "b1" for e in events)
            assert _sample(apps, "disagg_router_role_migrations_total", worker="b1") == 1
            await long
            prefills_on_b1 = _placements(apps, prefill="b1")
            done = traffic.done
            await _until(lambda: traffic.done >= done + 12, "more traffic")
            assert _placements(apps, prefill="b1") > prefills_on_b1  # it serves prefill now
            assert _placements(apps, decode="b1") == decodes_on_b1

            # And back: b1 prefill -> decode.
            await _force(s, a, "b1", "decode")
            await _until_role(s, urls, "b1", "decode")
            decodes_on_b1 = _placements(apps, decode="b1")
            done = traffic.done
            await _until(lambda: _placements(apps, decode="b1") > decodes_on_b1, "decodes on b1")

            traffic.stop()
            await flow
            assert traffic.failures == []
            assert traffic.done > 30
            await _clean(apps)

            metrics = await (await s.get(a + "/metrics")).text()
            assert 'disagg_router_worker_role{role="decode",worker="b1"} 1.0' in metrics
            assert 'disagg_router_worker_role{role="prefill",worker="b0"} 1.0' in metrics
            switches = "disagg_router_role_switches_total"
            assert _sample(apps, switches, worker="b1", to_role="prefill", trigger="operator") == 1
            leaders = [app[ROLES].leader for app in apps]
            assert sorted(leaders) == [False, True]  # one replica decides at a time

        finally:
            traffic.stop()
            if long is not None and not long.done():
                long.cancel()
            await asyncio.gather(flow, *([long] if long else []), return_exceptions=True)
            await traffic.close()


async def _events(s: aiohttp.ClientSession, urls: list[str]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for u in urls:
        async with s.get(u + "/admin/roles") as r:
            out.extend((await r.json())["events"])
    return out


async def test_the_elastic_policy_moves_a_worker_to_an_overloaded_prefill_pool(
    redis_prefix: str,
) -> None:
    """The role manager's own decision, on the live signals: a deep prefill queue on a 1P:2D
    split makes the elastic policy move a decode worker to prefill (with its reason)."""
    async with _cluster(redis_prefix) as replicas, aiohttp.ClientSession() as s:
        urls = [u for u, _ in replicas]
        apps = [app for _, app in replicas]
        await _force(s, urls[0], "b0", "prefill")
        await _until_role(s, urls, "b0", "prefill")  # serving first: the guards count no other
        await _force(s, urls[0], "b1", "decode")
        await _force(s, urls[0], "b2", "decode")
        for wid, role in (("b0", "prefill"), ("b1", "decode"), ("b2", "decode")):
            await _until_role(s, urls, wid, role)
        leader = next(app for app in apps if app[ROLES].leader)
        manager = leader[ROLES]
        manager.policy = ElasticRoles(min_time_in_role_s=0.0, reverse_after_s=0.0)
        # Prompt tokens queued on the one prefill worker (as by a burst of long prompts): the
        # prefill pressure is far above decode's.
        parts(leader).pools.workers["b0"].queued_prompt_tokens = 2_000_000
        started = time.monotonic()
        while time.monotonic() - started < 10:
            roles = await _roles(s, urls[0])
            if sum(1 for r in roles.values() if r.endswith("prefill")) == 2:
                break
            await asyncio.sleep(0.05)
        parts(leader).pools.workers["b0"].queued_prompt_tokens = 0
        report = manager.report()
        moved = [e for e in report["events"] if e["trigger"] == "policy"]
        assert len(moved) == 1, report
        assert moved[0]["to"] == "draining-to-prefill"
        assert "prefill pressure" in moved[0]["reason"]
        await _until_role(s, urls, moved[0]["worker"], "prefill")
        assert report["prefill_pressure"] > report["decode_pressure"]
