"""A worker whose SGLang role switch failed ("restart required"), issue 31 item 5: two router
replicas sharing the real Redis in front of three simulated SGLang PD engines started with
`--enable-pd-role-switch` (b0 prefill, b1 and b2 decode, each registered `both`); b1's engine
fails every switch (the sim's `role_switch_fail` fault: torn down, never rebuilt, "restart
required", as SGLang's failed rebuild).

- The failure is a mark in b1's role record: the other replica's `/admin/roles` shows it too.
- The guard rails do not count b1: draining b0, the only prefill worker serving, is refused
  without `force`.
- Forced, a request gets a 503 at once (not a 429 after its admission deadline), with a
  Retry-After, whose message names each cause: b0 drained, b1's failed switch.
- Switched back to decode, b1 stays out of both pools while its engine refuses the check (a
  switch to the role it reports, which a broken engine refuses); restarted, it proves itself
  and is back in the decode pool on both replicas.
- Both stores keep the mark with the role (compare-and-set, read with the registry, put back
  after a loss).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import pytest
import redis.asyncio as aioredis
from aiohttp import web
from openai import APIStatusError, AsyncOpenAI

from disagg_tools.sim.faults import FaultConfig
from router.control.role_manager import ROLES
from state import Keys, MemoryStore, RedisStore, StateStore
from state.base import WorkerRole
from tests.app_parts import parts
from tests.conftest import MODEL, REDIS_URL, running_router
from tests.router.control.test_roles_live import (
    AUTH,
    WORKERS,
    Traffic,
    _placements,
    _sample,
    _until,
    _until_role,
)
from tests.router.control.test_roles_sglang_live import (
    START_ROLES,
    SWITCHES,
    Engines,
    _engine,
    _stop_traffic,
)
from tests.router.edge.test_admin import _settings

CHAT = "/v1/chat/completions"
BODY = {"model": MODEL, "messages": [{"role": "user", "content": "broken"}], "max_tokens": 4}
# A request that waited for room would be refused (429) after this long: long enough that the
# old behaviour (wait, then 429) is unmistakable, short enough that a test of it ends.
MAX_WAIT_S = 5.0
Replicas = list[tuple[str, web.Application]]


@contextlib.asynccontextmanager
async def _cluster(prefix: str) -> AsyncIterator[tuple[Engines, Replicas]]:
    async with contextlib.AsyncExitStack() as stack:
        engines = Engines(stack)
        stack.push_async_callback(engines.close)
        workers = []
        for wid in WORKERS:
            faults = FaultConfig(role_switch_fail=1.0 if wid == "b1" else 0.0)
            url = await engines.start(_engine(wid, faults=faults))
            workers.append({"id": wid, "url": url, "role": "both", "adapter": "sglang",
                            "kv_blocks": 4096})  # fmt: skip
        settings = _settings(
            prefix,
            workers,
            roles={"interval_s": 0.1, "settle_s": 0.3, "drain_deadline_s": 2.0},
            admission={"max_wait_s": MAX_WAIT_S},
            loops={"health_interval_s": 0.2},
        )
        replicas = [await stack.enter_async_context(running_router(settings)) for _ in "ab"]
        yield engines, replicas


async def _eventually(
    probe: Callable[[], Awaitable[Any]], ok: Callable[[Any], bool], what: str
) -> Any:
    """`probe()` until `ok` holds of its result (generous bound: the machine is shared)."""
    seen = None
    for _ in range(600):
        seen = await probe()
        if ok(seen):
            return seen
        await asyncio.sleep(0.05)
    raise AssertionError(f"never: {what}; last seen {seen!r}")


async def _b1(s: aiohttp.ClientSession, urls: list[str]) -> list[dict[str, Any]]:
    """b1 as each replica's /admin/roles reports it."""
    out = []
    for url in urls:
        async with s.get(url + "/admin/roles") as r:
            assert r.status == 200, await r.text()
            out.append(next(w for w in (await r.json())["workers"] if w["id"] == "b1"))
    return out


def _shows_broken(report: dict[str, Any]) -> bool:
    return "restart required" in (report.get("broken") or "") and "restart required" in (
        report["engine"]["broken"] or ""
    )


async def _post(
    s: aiohttp.ClientSession, url: str, body: dict[str, Any]
) -> tuple[int, dict[str, Any]]:
    async with s.post(url, json=body, headers=AUTH) as r:
        return r.status, dict(await r.json())


async def _broken_b1(s: aiohttp.ClientSession, replicas: Replicas) -> list[str]:
    """Every engine serving its start-up role, then b1 asked to prefill: its switch fails, as
    the leader reports (the other replica's view is the first test's matter). The replicas'
    URLs, the leader's first."""
    urls = [u for u, _ in replicas]
    for wid, role in START_ROLES.items():
        await _until_role(s, urls, wid, role)
    status, body = await _post(s, f"{urls[0]}/admin/workers/b1/role", {"role": "prefill"})
    assert status == 200 and body["current_role"] == "draining-to-prefill", body
    apps = [app for _, app in replicas]
    await _until(
        lambda: _sample(apps, SWITCHES, worker="b1", to_role="prefill", outcome="broken") >= 1,
        "b1's engine switch fails",
    )
    leader = next(u for u, app in replicas if app[ROLES].leader)
    (report,) = await _eventually(
        lambda: _b1(s, [leader]),
        lambda rs: "restart required" in (rs[0]["engine"]["broken"] or ""),
        "the leader reports b1 broken",
    )
    assert report["role"] == "draining-to-prefill", report
    return [leader, *(u for u in urls if u != leader)]


async def test_the_other_replica_shows_the_failed_switch(redis_prefix: str) -> None:
    async with _cluster(redis_prefix) as (_, replicas), aiohttp.ClientSession() as s:
        _, other = await _broken_b1(s, replicas)
        (report,) = await _eventually(
            lambda: _b1(s, [other]),
            lambda rs: _shows_broken(rs[0]),
            "the other replica shows b1 broken",
        )
        assert report["role"] == "draining-to-prefill", report
        other_app = next(app for u, app in replicas if u == other)
        assert other_app[ROLES].leader is False  # not this replica's own failure: the store's


async def test_the_only_serving_prefill_is_guarded_and_clients_get_a_503_naming_the_cause(
    redis_prefix: str,
) -> None:
    async with _cluster(redis_prefix) as (_, replicas), aiohttp.ClientSession() as s:
        leader, other = await _broken_b1(s, replicas)
        # b1 was on its way to prefill when its switch failed: it does not count.
        status, body = await _post(s, f"{other}/admin/workers/b0/drain", {})
        assert status == 409, body
        message = body["error"]["message"]
        assert body["error"]["code"] == "last_worker_in_rotation", body
        assert f"the prefill pool of {MODEL}" in message, message
        assert "b1 broken by a failed role switch to prefill" in message, message
        assert "restart required" in message, message

        status, body = await _post(s, f"{other}/admin/workers/b0/drain", {"force": True})
        assert status == 200, body
        apps = [app for _, app in replicas]
        await _until(
            lambda: all(parts(app).pools.workers["b0"].drained for app in apps),
            "both replicas see b0 drained",
        )
        for url in (leader, other):
            async with s.post(url + CHAT, json=BODY) as r:
                status, body = r.status, await r.json()
                retry_after = r.headers.get("Retry-After")
            # Not a 429 after MAX_WAIT_S: no prefill worker is coming, so nothing to wait for.
            assert status == 503, body
            assert retry_after is not None and int(retry_after) >= 1
            error = body["error"]
            assert error["code"] == "no_worker_in_rotation", error
            assert error["message"].startswith("no prefill worker is in rotation: "), error
            assert "b0 drained by the operator" in error["message"], error
            assert "b1 broken by a failed role switch to prefill" in error["message"], error
            assert "restart required" in error["message"], error

        # What an OpenAI client sees: the same 503 and message, with nothing to retry into.
        client = AsyncOpenAI(base_url=other + "/v1", api_key="k", max_retries=0, timeout=60)
        try:
            with pytest.raises(APIStatusError) as caught:
                await client.chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": "broken"}], max_tokens=4
                )
        finally:
            await client.close()
        assert caught.value.status_code == 503
        assert "b1 broken by a failed role switch" in str(caught.value)


async def test_switched_back_it_stays_out_until_restarted_and_proven(redis_prefix: str) -> None:
    async with _cluster(redis_prefix) as (engines, replicas), aiohttp.ClientSession() as s:
        urls = await _broken_b1(s, replicas)
        apps = [app for _, app in replicas]
        traffic = Traffic(urls)
        flow = asyncio.create_task(traffic.flow())
        try:
            await _until(lambda: traffic.done >= 8, "traffic flows")
            on_b1 = _placements(apps, prefill="b1") + _placements(apps, decode="b1")

            # Back to decode, the role its engine still reports: accepted (b1 empties nothing),
            # but it enters no pool while the engine refuses the check.
            status, body = await _post(s, f"{urls[1]}/admin/workers/b1/role", {"role": "decode"})
            assert status == 200 and body["current_role"] == "draining-to-decode", body

            async def checked_or_in() -> tuple[float, list[dict[str, Any]]]:
                refused = _sample(apps, SWITCHES, worker="b1", to_role="decode", outcome="broken")
                return refused, await _b1(s, urls)

            # The leader's check (a switch to decode) refused, or (the bug) b1 back in decode.
            refused, reports = await _eventually(
                checked_or_in,
                lambda seen: seen[0] >= 1 or any(r["role"] == "decode" for r in seen[1]),
                "the leader checks b1's engine",
            )
            assert [r["role"] for r in reports] == ["draining-to-decode"] * 2, reports
            assert all(_shows_broken(r) for r in reports), reports
            done = traffic.done
            await _until(lambda: traffic.done >= done + 12, "more traffic")
            assert _placements(apps, prefill="b1") + _placements(apps, decode="b1") == on_b1
            reports = await _b1(s, urls)
            assert [r["role"] for r in reports] == ["draining-to-decode"] * 2, reports

            # Restarted (the fault gone, in its start-up role, decode): it answers the check,
            # and every replica takes it back into the decode pool.
            port = int(engines.urls["b1"].rsplit(":", 1)[1])
            await engines.stop("b1")
            await engines.start(_engine("b1", port=port))
            reports = await _eventually(
                lambda: _b1(s, urls),
                lambda rs: all(r["role"] == "decode" and r["broken"] is None for r in rs),
                "b1 proves it serves decode",
            )
            assert all(r["engine"]["broken"] is None for r in reports), reports
            assert _sample(apps, SWITCHES, worker="b1", to_role="decode", outcome="ok") >= 1
            decodes = _placements(apps, decode="b1")
            await _until(lambda: _placements(apps, decode="b1") > decodes, "decodes on b1")
            await _stop_traffic(traffic, flow)
            assert traffic.failures == []
        finally:
            await _stop_traffic(traffic, flow)


# -- the stores ----------------------------------------------------------------------------


@pytest.fixture(params=["memory", "redis"])
async def store(request: pytest.FixtureRequest, redis_prefix: str) -> AsyncIterator[StateStore]:
    if request.param == "memory":
        yield MemoryStore()
        return
    client = aioredis.Redis.from_url(REDIS_URL)
    try:
        yield RedisStore(client, Keys(redis_prefix))  # its keys deleted by `redis_prefix`
    finally:
        await client.aclose()


async def test_both_stores_keep_the_broken_mark_with_the_role(store: StateStore) -> None:
    why = "role switch failed; instance unhealthy | restart required"  # a '|' of its own
    assert await store.set_role("b1", "draining-to-prefill", 0) is not None
    marked = await store.set_role("b1", "draining-to-prefill", 1, broken=why)
    assert marked is not None and (marked.version, marked.broken) == (2, why)
    assert (await store.worker_roles())["b1"] == marked
    assert (await store.registry_view(30.0))[3]["b1"] == marked
    # A compare-and-set like any role change: a stale writer cannot mark or clear it.
    assert await store.set_role("b1", "prefill", 1) is None
    # Kept only when written again: the role manager carries it (router/control/role_manager.py).
    back = await store.set_role("b1", "draining-to-decode", 2, broken=why)
    assert back is not None and back.broken == why
    healed = await store.set_role("b1", "decode", 3)
    assert healed is not None and healed.broken == ""
    assert (await store.worker_roles())["b1"] == healed
    # Put back after a loss with its mark, where fresher than the store's.
    lost = WorkerRole("draining-to-prefill", 9, 1.0, why)
    await store.restore_registry({}, {"b2": lost})
    assert (await store.worker_roles())["b2"] == lost
