"""SGLang's runtime role switch driven by the role manager (docs/real-workers.md, "SGLang's
runtime role switch"): two router replicas sharing Redis in front of three simulated SGLang PD
engines started with `--enable-pd-role-switch` (b0 prefill, b1 and b2 decode), each registered as
`both`. An operator moves b1 from decode to prefill and back under streaming traffic: the router
drains it, asks the engine to switch (`POST /pd_role_switch`), and only then places the new
role's work on it; no stream is cut or wrong, a stream still on b1 past the drain deadline resumes
on b2 with the exact text. An engine whose switch fails stays out of both pools until restarted;
one restarted in its start-up role is switched back to its recorded role."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
from aiohttp import web

from disagg_tools.sim.faults import FaultConfig
from disagg_tools.sim.worker import WorkerConfig, running_worker
from router.control.role_manager import ROLES
from tests.conftest import MODEL, running_router
from tests.router.control.test_roles_live import (
    AUTH,
    WORKERS,
    Traffic,
    _clean,
    _force,
    _long_stream_on_b1,
    _placements,
    _sample,
    _until,
    _until_role,
)
from tests.router.edge.test_admin import _settings

START_ROLES = {"b0": "prefill", "b1": "decode", "b2": "decode"}
DEADLINE_S = 2.0
SWITCHES = "disagg_router_role_engine_switches_total"


def _engine(wid: str, *, port: int = 0, role: str | None = None, **kw: Any) -> WorkerConfig:
    return WorkerConfig(
        role=role or START_ROLES[wid],
        worker_id=wid,
        model=MODEL,
        time_scale=1.0,
        kv_blocks=4096,
        port=port,
        bootstrap_port=0,
        kv_lease_s=30.0,
        role_switch=kw.pop("role_switch", True),
        role_switch_s=0.3,
        **kw,
    )


class Engines:
    """The simulated engines, each of which a test may restart on its port."""

    def __init__(self, stack: contextlib.AsyncExitStack) -> None:
        self._stack = stack
        self.urls: dict[str, str] = {}
        self._stops: dict[str, contextlib.AsyncExitStack] = {}

    async def start(self, config: WorkerConfig) -> str:
        own = contextlib.AsyncExitStack()
        url = await own.enter_async_context(running_worker(config))
        self._stops[config.worker_id] = own
        self.urls[config.worker_id] = url
        return url

    async def stop(self, wid: str) -> None:
        await self._stops.pop(wid).aclose()

    async def close(self) -> None:
        for own in self._stops.values():
            await own.aclose()


@contextlib.asynccontextmanager
async def _cluster(
    prefix: str, **engine_kw: dict[str, Any]
) -> AsyncIterator[tuple[Engines, list[tuple[str, web.Application]]]]:
    async with contextlib.AsyncExitStack() as stack:
        engines = Engines(stack)
        stack.push_async_callback(engines.close)
        workers = []
        for wid in WORKERS:
            url = await engines.start(_engine(wid, **engine_kw.get(wid, {})))
            # No bootstrap_port: read from each engine's /server_info, as its role is.
            workers.append({"id": wid, "url": url, "role": "both", "adapter": "sglang",
                            "kv_blocks": 4096})  # fmt: skip
        roles = {"interval_s": 0.1, "settle_s": 0.3, "drain_deadline_s": DEADLINE_S}
        settings = _settings(prefix, workers, roles=roles, loops={"health_interval_s": 0.2})
        replicas = [await stack.enter_async_context(running_router(settings)) for _ in "ab"]
        yield engines, replicas


async def _serves(s: aiohttp.ClientSession, url: str) -> tuple[str, bool]:
    async with s.get(url + "/server_info") as r:
        info = await r.json()
    return info["internal_states"][0]["disaggregation_mode"], info["enable_pd_role_switch"]


async def _report(s: aiohttp.ClientSession, url: str, wid: str) -> dict[str, Any]:
    async with s.get(url + "/admin/roles") as r:
        return next(w for w in (await r.json())["workers"] if w["id"] == wid)


async def _stop_traffic(traffic: Traffic, flow: asyncio.Task[None], *others: Any) -> None:
    traffic.stop()
    for t in others:
        if t is not None and not t.done():
            t.cancel()
    await asyncio.gather(flow, *(t for t in others if t is not None), return_exceptions=True)
    await traffic.close()


async def test_an_sglang_engine_is_switched_decode_to_prefill_and_back_under_traffic(
    redis_prefix: str,
) -> None:
    async with _cluster(redis_prefix) as (engines, replicas), aiohttp.ClientSession() as s:
        urls = [u for u, _ in replicas]
        apps = [app for _, app in replicas]
        a, b = urls
        # With no role record, each serves the role its engine was started in.
        for wid, role in START_ROLES.items():
            await _until_role(s, urls, wid, role)
        assert (await _report(s, a, "b1"))["engine"] == {
            "serves": "decode", "can_switch": True, "switching_to": None, "broken": None,
        }  # fmt: skip

        traffic = Traffic(urls)
        flow = asyncio.create_task(traffic.flow())
        long: asyncio.Task[None] | None = None
        try:
            await _until(lambda: traffic.done >= 8, "traffic flows")
            assert _placements(apps, prefill="b1") == 0
            assert _placements(apps, prefill="b0") > 0

            long = await _long_stream_on_b1(s, a, apps, traffic)

            # b1: decode -> prefill. The engine is asked only once it is idle: after the
            # deadline moved the long stream to b2.
            forced = await _force(s, b, "b1", "prefill")
            assert forced["current_role"] == "draining-to-prefill"
            await asyncio.sleep(0.5)
            decodes_on_b1 = _placements(apps, decode="b1")
            assert (await _serves(s, engines.urls["b1"]))[0] == "decode"  # still streaming
            await _until_role(s, urls, "b1", "prefill")
            assert (await _serves(s, engines.urls["b1"]))[0] == "prefill"
            assert _sample(apps, SWITCHES, worker="b1", to_role="prefill", outcome="ok") == 1
            assert _sample(apps, "disagg_router_role_migrations_total", worker="b1") == 1
            await long
            prefills_on_b1 = _placements(apps, prefill="b1")
            done = traffic.done
            await _until(lambda: _placements(apps, prefill="b1") > prefills_on_b1, "b1 prefills")
            await _until(lambda: traffic.done >= done + 12, "more traffic")
            assert _placements(apps, decode="b1") == decodes_on_b1

            # And back: b1 prefill -> decode, its stranded KV pulled first.
            await _force(s, a, "b1", "decode")
            await _until_role(s, urls, "b1", "decode")
            assert (await _serves(s, engines.urls["b1"]))[0] == "decode"
            decodes_on_b1 = _placements(apps, decode="b1")
            await _until(lambda: _placements(apps, decode="b1") > decodes_on_b1, "decodes on b1")

            await _stop_traffic(traffic, flow, long)
            assert traffic.failures == []
            assert traffic.done > 30
            await _clean(apps)
            assert _sample(apps, SWITCHES, worker="b1", to_role="decode", outcome="ok") == 1
            leaders = [app[ROLES].leader for app in apps]
            assert sorted(leaders) == [False, True]
        finally:
            await _stop_traffic(traffic, flow, long)


async def test_a_failed_switch_keeps_the_engine_out_until_restarted_and_a_restart_is_mended(
    redis_prefix: str,
) -> None:
    broken = {"b1": {"faults": FaultConfig(role_switch_fail=1.0)}}
    cluster = _cluster(redis_prefix, **broken)
    async with cluster as (engines, replicas), aiohttp.ClientSession() as s:
        urls = [u for u, _ in replicas]
        apps = [app for _, app in replicas]
        for wid, role in START_ROLES.items():
            await _until_role(s, urls, wid, role)
        traffic = Traffic(urls)
        flow = asyncio.create_task(traffic.flow())
        try:
            await _until(lambda: traffic.done >= 8, "traffic flows")
            await _force(s, urls[0], "b1", "prefill")
            await _until(
                lambda: (
                    _sample(apps, SWITCHES, worker="b1", to_role="prefill", outcome="broken") >= 1
                ),
                "the engine's switch fails",
            )
            leader = next(u for u, app in replicas if app[ROLES].leader)
            report = await _report(s, leader, "b1")
            assert report["role"] == "draining-to-prefill", report
            assert "restart required" in report["engine"]["broken"]
            before = _placements(apps, prefill="b1") + _placements(apps, decode="b1")
            done = traffic.done
            await _until(lambda: traffic.done >= done + 12, "traffic around the broken engine")
            assert _placements(apps, prefill="b1") + _placements(apps, decode="b1") == before

            # Restarted (in its start-up role, decode, the fault gone): asked again, it switches.
            port = int(engines.urls["b1"].rsplit(":", 1)[1])
            await engines.stop("b1")
            await engines.start(_engine("b1", port=port))
            await _until_role(s, urls, "b1", "prefill")
            assert (await _report(s, leader, "b1"))["engine"]["broken"] is None
            decodes_on_b1 = _placements(apps, decode="b1")
            prefills_on_b1 = _placements(apps, prefill="b1")
            await _until(lambda: _placements(apps, prefill="b1") > prefills_on_b1, "b1 prefills")

            # Restarted again, in decode though its record says prefill (and on another
            # bootstrap port): the leader switches it back to prefill. Between two batches, and
            # traffic again once every replica's prober has read the restarted engine: in the
            # gap between a restart and the next probe, a replica would still send prefills to
            # the old bootstrap port (what a crash costs is test_failures' matter).
            await traffic.pause()
            await engines.stop("b1")
            await engines.start(_engine("b1", port=port))
            await _until(
                lambda: _sample(apps, SWITCHES, worker="b1", to_role="prefill", outcome="ok") >= 2,
                "the restarted engine switched back",
            )
            await _until_role(s, urls, "b1", "prefill")
            await asyncio.sleep(0.5)  # > 2 probe intervals
            traffic.resume()
            prefills_on_b1 = _placements(apps, prefill="b1")
            await _until(lambda: _placements(apps, prefill="b1") > prefills_on_b1, "b1 prefills")
            assert _placements(apps, decode="b1") == decodes_on_b1  # never as a decode

            await _stop_traffic(traffic, flow)
            assert traffic.failures == []
            await _clean(apps)
        finally:
            await _stop_traffic(traffic, flow)


async def test_a_switch_answered_after_a_probe_saw_the_new_role_is_still_read(
    redis_prefix: str,
) -> None:
    """The race a loaded machine hit: SGLang's scheduler reports the new role before the
    switch's answer is back, the prober reads it first, and a manager that asked again only
    while the engine was behind never read the answer (no "ok" counted, the backoff kept).
    Here every answer of b1 comes 1.5 s after its flip, far more than a probe interval."""
    lag = {"b1": {"role_switch_reply_s": 1.5}}
    async with _cluster(redis_prefix, **lag) as (engines, replicas), aiohttp.ClientSession() as s:
        urls = [u for u, _ in replicas]
        apps = [app for _, app in replicas]
        await _until_role(s, urls, "b1", "decode")
        await _force(s, urls[0], "b1", "prefill")
        await _until_role(s, urls, "b1", "prefill")
        assert _sample(apps, SWITCHES, worker="b1", to_role="prefill", outcome="ok") == 1

        # Restarted in decode though its record says prefill: asked to switch back (outside a
        # drain), the new role is probed ~1.3 s before the answer comes.
        port = int(engines.urls["b1"].rsplit(":", 1)[1])
        await engines.stop("b1")
        await engines.start(_engine("b1", port=port, role_switch_reply_s=1.5))
        await _until(
            lambda: _sample(apps, SWITCHES, worker="b1", to_role="prefill", outcome="ok") >= 2,
            "the late answer is read",
        )
        leader = next(u for u, app in replicas if app[ROLES].leader)
        report = await _report(s, leader, "b1")
        assert report["engine"]["serves"] == "prefill", report
        assert report["engine"]["switching_to"] is None, report
        assert _sample(apps, SWITCHES, worker="b1", to_role="prefill", outcome="busy") == 0


async def test_an_engine_without_the_switch_flag_is_never_asked(redis_prefix: str) -> None:
    fixed = {"b2": {"role_switch": False}}
    cluster = _cluster(redis_prefix, **fixed)
    async with cluster as (engines, replicas), aiohttp.ClientSession() as s:
        urls = [u for u, _ in replicas]
        await _until_role(s, urls, "b2", "decode")
        async with s.post(
            f"{urls[0]}/admin/workers/b2/role", json={"role": "prefill"}, headers=AUTH
        ) as r:
            assert r.status == 409, await r.text()
            message = (await r.json())["error"]["message"]
        assert "--enable-pd-role-switch" in message
        assert (await _report(s, urls[0], "b2"))["engine"]["can_switch"] is False
        assert await _serves(s, engines.urls["b2"]) == ("decode", False)
