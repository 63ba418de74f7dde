"""Dynamic pools through the token-protected admin API, shared by router replicas via Redis;
layout pairing reported; model listing merged from the pools."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import aiohttp

from disagg_tools.sim.textgen import expected_answer
from disagg_tools.sim.worker import WorkerConfig, running_worker
from router.config import merged_settings, settings_from_mapping
from tests.conftest import MODEL, REDIS_URL, free_port, running_router

CHAT = "/v1/chat/completions"
TOKEN = "s3cret-admin"


def _settings(prefix: str, workers: list[dict[str, Any]], **extra: Any) -> Any:
    base = {
        "model": MODEL,
        "perf": {"model": MODEL, "gpu": "h100"},
        "store": {"url": REDIS_URL, "key_prefix": prefix},
        "auth": {"admin_token": TOKEN},
        "loops": {"registry_refresh_s": 0.1, "health_interval_s": 0.5},
        "workers": workers,
    }
    return settings_from_mapping(merged_settings(base, extra))


@contextlib.asynccontextmanager
async def two_replicas_with_prefill_only(
    prefix: str, **extra: Any
) -> AsyncIterator[tuple[str, str, str]]:
    """Two router replicas on one key prefix with one prefill worker; `extra`: settings over
    the test's own (`_settings`)."""
    async with contextlib.AsyncExitStack() as stack:
        p_url = await stack.enter_async_context(
            running_worker(
                WorkerConfig(
                    role="prefill",
                    worker_id="p0",
                    model=MODEL,
                    time_scale=500.0,
                    kv_blocks=4096,
                    kv_lease_s=30.0 * 500,
                )
            )
        )
        workers = [{"id": "p0", "url": p_url, "role": "prefill", "adapter": "sim"}]
        a, _ = await stack.enter_async_context(running_router(_settings(prefix, workers, **extra)))
        b, _ = await stack.enter_async_context(running_router(_settings(prefix, workers, **extra)))
        yield a, b, p_url


async def _workers(s: aiohttp.ClientSession, url: str) -> dict[str, dict[str, Any]]:
    async with s.get(url + "/admin/workers") as r:
        return {w["id"]: w for w in (await r.json())["workers"]}


async def test_registration_needs_the_token(redis_prefix: str) -> None:
    async with (
        two_replicas_with_prefill_only(redis_prefix) as (a, _, _),
        aiohttp.ClientSession() as s,
    ):
        entry = {"id": "d9", "url": "http://127.0.0.1:9", "role": "decode", "kv_blocks": 10}
        async with s.post(a + "/admin/workers", json=entry) as r:
            assert r.status == 401 and (await r.json())["error"]["type"] == "authentication_error"
        async with s.post(
            a + "/admin/workers", json=entry, headers={"Authorization": "Bearer wrong"}
        ) as r:
            assert r.status == 401
        async with s.post(
            a + "/admin/workers",
            json={"id": "x", "role": "decode"},
            headers={"Authorization": f"Bearer {TOKEN}"},
        ) as r:
            assert r.status == 400 and "url" in (await r.json())["error"]["message"]
        async with s.post(
            a + "/admin/workers",
            json={"id": "p0", "url": "http://h", "role": "prefill"},
            headers={"Authorization": f"Bearer {TOKEN}"},
        ) as r:
            assert r.status == 400  # configured workers cannot be replaced


async def test_write_side_is_off_without_a_token(redis_prefix: str) -> None:
    settings = settings_from_mapping(
        {"model": MODEL, "workers": [], "store": {"url": REDIS_URL, "key_prefix": redis_prefix}}
    )
    async with running_router(settings) as (url, _), aiohttp.ClientSession() as s:
        async with s.delete(
            url + "/admin/workers/x", headers={"Authorization": "Bearer anything"}
        ) as r:
            assert r.status == 403


async def test_a_registered_decode_worker_serves_on_every_replica(redis_prefix: str) -> None:
    auth = {"Authorization": f"Bearer {TOKEN}"}
    async with (
        two_replicas_with_prefill_only(redis_prefix) as (a, b, _),
        running_worker(
            WorkerConfig(
                role="decode",
                worker_id="d-new",
                model=MODEL,
                time_scale=500.0,
                kv_blocks=4096,
                kv_lease_s=30.0 * 500,
            )
        ) as d_url,
        aiohttp.ClientSession() as s,
    ):
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": "new worker"}],
            "max_tokens": 12,
        }
        async with s.post(b + CHAT, json=body) as r:
            assert r.status == 503  # no decode worker at all yet: fail fast, clearly
        entry = {"id": "d-new", "url": d_url, "role": "decode", "adapter": "sim", "kv_blocks": 4096}
        async with s.post(a + "/admin/workers", json=entry, headers=auth) as r:
            assert r.status == 201, await r.text()

        # Replica b adopts it from the shared registry, and takes it into rotation on its
        # first passing probe (its health and KV layout read there): under a loaded CI the
        # probe can come a beat after the adoption, and a request before it is a clean 503.
        def in_rotation(w: dict[str, Any] | None) -> bool:
            return bool(w and w["healthy"] and w["layout"] and w["capacity_blocks"] > 0)

        for _ in range(200):
            if in_rotation((await _workers(s, b)).get("d-new")):
                break
            await asyncio.sleep(0.05)
        adopted = (await _workers(s, b))["d-new"]
        assert in_rotation(adopted) and adopted["paired"] is True, adopted
        async with s.post(b + CHAT, json=body) as r:
            assert r.status == 200, (await r.text(), await _workers(s, b))
            answer = await r.json()
        assert answer["choices"][0]["message"]["content"] == expected_answer(CHAT, body)[0]
        async with s.delete(a + "/admin/workers/d-new", headers=auth) as r:
            assert r.status == 409  # the only decode worker: refused unless forced
        async with s.delete(a + "/admin/workers/d-new", headers=auth, json={"force": True}) as r:
            assert r.status == 200
        for _ in range(100):
            if "d-new" not in await _workers(s, b):
                break
            await asyncio.sleep(0.05)
        assert "d-new" not in await _workers(s, b)
        async with s.delete(a + "/admin/workers/d-new", headers=auth) as r:
            assert r.status == 404


async def test_unpaired_layouts_are_reported_and_models_merged(redis_prefix: str) -> None:
    auth = {"Authorization": f"Bearer {TOKEN}"}
    async with (
        two_replicas_with_prefill_only(redis_prefix) as (a, _, _),
        aiohttp.ClientSession() as s,
    ):
        entry = {
            "id": "d-v2",
            "url": "http://127.0.0.1:9",
            "role": "decode",
            "kv_blocks": 64,
            "layout": {"engine": "vllm", "engine_version": "0.33.0", "model": "other-8b"},
        }
        async with s.post(a + "/admin/workers", json=entry, headers=auth) as r:
            assert r.status == 201
            assert (await r.json())["paired"] is False
        workers = await _workers(s, a)
        assert workers["p0"]["paired"] is False and workers["d-v2"]["paired"] is False
        async with s.get(a + "/metrics") as r:
            assert "disagg_router_unpaired_workers 2.0" in await r.text()
        async with s.get(a + "/v1/models") as r:
            ids = [m["id"] for m in (await r.json())["data"]]
        assert ids == [MODEL, "other-8b"]
        async with s.delete(a + "/admin/workers/d-v2", headers=auth) as r:
            assert r.status == 200


async def test_a_registration_can_read_the_layout_from_the_worker(redis_prefix: str) -> None:
    """`discover_layout: true`: the router reads the worker's own /version and /v1/models, pairs
    it by what the worker reports (configured fields win), and stores the result, so the other
    replica pairs it alike. A worker that does not answer is refused with a 400, not half-added."""
    auth = {"Authorization": f"Bearer {TOKEN}"}

    def sim(role: str, wid: str) -> Any:
        return running_worker(
            WorkerConfig(
                role=role,
                worker_id=wid,
                model=MODEL,
                time_scale=500.0,
                kv_blocks=4096,
                kv_lease_s=30.0 * 500,
            )
        )

    async with contextlib.AsyncExitStack() as stack:
        p_url = await stack.enter_async_context(sim("prefill", "p0"))
        d_url = await stack.enter_async_context(sim("decode", "d-new"))
        # The prefill worker's layout is configured as what a sim worker reports about itself.
        workers = [
            {
                "id": "p0",
                "url": p_url,
                "role": "prefill",
                "adapter": "sim",
                "layout": {"engine_version": "0.0.0-sim"},
            }
        ]
        a, _ = await stack.enter_async_context(running_router(_settings(redis_prefix, workers)))
        b, _ = await stack.enter_async_context(running_router(_settings(redis_prefix, workers)))
        s = await stack.enter_async_context(aiohttp.ClientSession())

        entry = {
            "id": "d-new",
            "url": d_url,
            "role": "decode",
            "adapter": "sim",
            "kv_blocks": 4096,
            "discover_layout": True,
        }
        async with s.post(a + "/admin/workers", json=entry, headers=auth) as r:
            assert r.status == 201, await r.text()
            added = await r.json()
        assert added["layout"].startswith(f"sim|0.0.0-sim|{MODEL}|")
        assert added["paired"] is True
        for _ in range(100):  # replica b adopts it, layout included, from the registry
            if "d-new" in await _workers(s, b):
                break
            await asyncio.sleep(0.05)
        assert (await _workers(s, b))["d-new"]["layout"] == added["layout"]
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": "discovered"}],
            "max_tokens": 8,
        }
        async with s.post(b + CHAT, json=body) as r:
            assert r.status == 200, await r.text()
            answer = await r.json()
        assert answer["choices"][0]["message"]["content"] == expected_answer(CHAT, body)[0]

        # Configured fields win over what the worker reports: another block size, unpaired.
        other = {**entry, "id": "d-32", "layout": {"block_size": 32}}
        async with s.post(a + "/admin/workers", json=other, headers=auth) as r:
            assert r.status == 201, await r.text()
            added32 = await r.json()
        assert "|32|" in added32["layout"] and added32["paired"] is False

        down = {**entry, "id": "d-down", "url": "http://127.0.0.1:9"}
        async with s.post(a + "/admin/workers", json=down, headers=auth) as r:
            assert r.status == 400
            err = (await r.json())["error"]
        assert err["param"] == "url" and "KV layout" in err["message"]
        async with s.post(
            a + "/admin/workers", json={**entry, "discover_layout": "yes"}, headers=auth
        ) as r:
            assert r.status == 400
            assert (await r.json())["error"]["param"] == "discover_layout"
        assert "d-down" not in await _workers(s, a)
        for wid in ("d-new", "d-32"):  # the last decode worker goes too: forced
            force = {"force": True}
            async with s.delete(a + f"/admin/workers/{wid}", headers=auth, json=force) as r:
                assert r.status == 200


async def test_configured_workers_can_discover_their_layout(redis_prefix: str) -> None:
    """`discover_layout: true` in the configuration file: the layout is read from each worker
    before the router serves; one that is not up yet stays out of rotation, and joins with its
    reported layout once its health probe answers."""

    def sim(role: str, wid: str, port: int = 0, served: str | None = None) -> Any:
        return running_worker(
            WorkerConfig(
                role=role,
                worker_id=wid,
                model=MODEL,
                time_scale=500.0,
                kv_blocks=4096,
                port=port,
                kv_lease_s=30.0 * 500,
                served_model_name=served,
            )
        )

    late_port = free_port()
    async with contextlib.AsyncExitStack() as stack:
        p_url = await stack.enter_async_context(sim("prefill", "p0"))
        d_url = await stack.enter_async_context(sim("decode", "d0"))
        workers = [
            {
                "id": "p0",
                "url": p_url,
                "role": "prefill",
                "adapter": "sim",
                "discover_layout": True,
            },
            {
                "id": "d0",
                "url": d_url,
                "role": "decode",
                "adapter": "sim",
                "discover_layout": True,
                "layout": {"connector_version": "7"},
            },
            {
                "id": "d1",
                "url": f"http://127.0.0.1:{late_port}",
                "role": "decode",
                "adapter": "sim",
                "discover_layout": True,
            },
        ]
        a, _ = await stack.enter_async_context(running_router(_settings(redis_prefix, workers)))
        s = await stack.enter_async_context(aiohttp.ClientSession())
        seen = await _workers(s, a)
        assert seen["p0"]["layout"].startswith(f"sim|0.0.0-sim|{MODEL}|")
        assert seen["d0"]["layout"].endswith("|7")  # its configured field won
        assert seen["d0"]["paired"] is False  # p0 reports connector version 0
        assert seen["d1"]["layout"] is None  # not up: out of rotation, never paired on a guess

        late = contextlib.AsyncExitStack()
        await late.enter_async_context(sim("decode", "d1", port=late_port))
        for _ in range(100):
            seen = await _workers(s, a)
            if seen["d1"]["layout"] is not None:
                break
            await asyncio.sleep(0.05)
        assert seen["d1"]["layout"] == seen["p0"]["layout"] and seen["d1"]["paired"] is True
        body = {"model": MODEL, "messages": [{"role": "user", "content": "late"}], "max_tokens": 6}
        async with s.post(a + CHAT, json=body) as r:
            assert r.status == 200, await r.text()
        async with s.get(a + "/metrics") as r:
            text = await r.text()
        assert 'disagg_router_placements_total{decode="d1",prefill="p0"} 1.0' in text

        # d1 goes down and comes back upgraded (another served model): read again, not reused.
        await late.aclose()
        for _ in range(100):
            if (await _workers(s, a))["d1"]["layout"] is None:
                break
            await asyncio.sleep(0.05)
        assert (await _workers(s, a))["d1"]["layout"] is None
        async with sim("decode", "d1", port=late_port, served="llama-3-8b-v2"):
            for _ in range(100):
                seen = await _workers(s, a)
                if seen["d1"]["layout"] is not None:
                    break
                await asyncio.sleep(0.05)
            assert "|llama-3-8b-v2|" in seen["d1"]["layout"] and seen["d1"]["paired"] is False
