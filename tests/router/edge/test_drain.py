"""Draining a worker through the admin API: shared by every replica through the store; a
drained worker gets no new placements while its running stream finishes exactly."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from disagg_tools.sim.textgen import expected_answer
from disagg_tools.sim.worker import WorkerConfig, running_worker
from tests.app_parts import parts
from tests.conftest import MODEL, running_router
from tests.router.edge.test_admin import TOKEN, _settings

CHAT = "/v1/chat/completions"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@contextlib.asynccontextmanager
async def _two_replicas(prefix: str) -> AsyncIterator[tuple[str, str, web.Application]]:
    """Replicas a and b on one Redis prefix, in front of p0 and decode workers d0, d1."""
    async with contextlib.AsyncExitStack() as stack:
        workers: list[dict[str, Any]] = []
        for role, wid, scale in (
            ("prefill", "p0", 500.0),
            ("decode", "d0", 1.0),
            ("decode", "d1", 1.0),
        ):
            url = await stack.enter_async_context(
                running_worker(
                    WorkerConfig(
                        role=role,
                        worker_id=wid,
                        model=MODEL,
                        time_scale=scale,
                        kv_blocks=4096,
                        kv_lease_s=30.0 * scale,
                    )
                )
            )
            entry: dict[str, Any] = {"id": wid, "url": url, "role": role, "adapter": "sim"}
            if role == "decode":
                entry["kv_blocks"] = 4096
            workers.append(entry)
        settings = _settings(prefix, workers)  # the admin tests' replicas, same token
        a, _ = await stack.enter_async_context(running_router(settings))
        b, app_b = await stack.enter_async_context(running_router(settings))
        yield a, b, app_b


async def _drained(s: aiohttp.ClientSession, url: str) -> set[str]:
    async with s.get(url + "/admin/workers") as r:
        return {w["id"] for w in (await r.json())["workers"] if w["drained"]}


async def _until_drained(s: aiohttp.ClientSession, url: str, want: set[str]) -> None:
    for _ in range(200):  # b picks the change up within its registry refresh
        if await _drained(s, url) == want:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"{url} never showed {want} drained: {await _drained(s, url)}")


def _placed_on(app: web.Application, decode: str) -> float:
    value = parts(app).metrics.registry.get_sample_value(
        "disagg_router_placements_total", {"prefill": "p0", "decode": decode}
    )
    return value or 0.0


async def _admin(s: aiohttp.ClientSession, url: str, wid: str, verb: str) -> dict[str, Any]:
    async with s.post(f"{url}/admin/workers/{wid}/{verb}", headers=AUTH) as r:
        assert r.status == 200, await r.text()
        return dict(await r.json())


async def _ask(s: aiohttp.ClientSession, url: str, n: int, tag: str) -> None:
    async def one(i: int) -> None:
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": f"{tag} {i}"}],
            "max_tokens": 6,
        }
        async with s.post(url + CHAT, json=body) as r:
            assert r.status == 200, await r.text()
            answer = await r.json()
        assert answer["choices"][0]["message"]["content"] == expected_answer(CHAT, body)[0]

    await asyncio.gather(*(one(i) for i in range(n)))


async def test_drain_is_shared_and_lets_the_running_stream_finish(redis_prefix: str) -> None:
    async with _two_replicas(redis_prefix) as (a, b, app_b), aiohttp.ClientSession() as s:
        async with s.post(a + "/admin/workers/d0/drain") as r:
            assert r.status == 401  # the admin token is required
        async with s.post(a + "/admin/workers/nope/drain", headers=AUTH) as r:
            assert r.status == 404

        # d1 drained: b's long stream can only go to d0.
        assert (await _admin(s, a, "d1", "drain"))["drained"] is True
        await _until_drained(s, b, {"d1"})
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": "a long one"}],
            "max_tokens": 240,
            "stream": True,
        }
        headers = {"X-Sim-Output-Tokens": "240"}
        async with s.post(b + CHAT, json=body, headers=headers) as stream:
            assert stream.status == 200
            first = await stream.content.readline()
            assert first.startswith(b"data: ")
            assert _placed_on(app_b, "d0") == 1

            # Now the other way round, while the stream runs on d0.
            assert (await _admin(s, a, "d1", "undrain"))["drained"] is False
            assert (await _admin(s, a, "d0", "drain"))["changed"] is True
            assert (await _admin(s, a, "d0", "drain"))["changed"] is False
            await _until_drained(s, b, {"d0"})
            await _ask(s, b, 6, "while d0 drains")
            assert _placed_on(app_b, "d0") == 1  # nothing new on the drained worker
            assert _placed_on(app_b, "d1") == 6

            lines = [first, *[line async for line in stream.content]]
        data = [line.strip() for line in lines if line.startswith(b"data: ")]
        assert data[-1] == b"data: [DONE]"
        text = []
        for line in data[:-1]:
            event = orjson.loads(line[6:])
            assert "error" not in event, event
            text.append(event["choices"][0]["delta"].get("content") or "")
        assert "".join(text) == expected_answer(CHAT, body, headers)[0]  # finished exactly

        metrics = await (await s.get(b + "/metrics")).text()
        assert 'disagg_router_worker_drained{role="decode",worker="d0"} 1.0' in metrics
        assert 'disagg_router_worker_drained{role="decode",worker="d1"} 0.0' in metrics

        # Undrained, it is used again (d1 drained so that the choice is not the policy's).
        await _admin(s, a, "d0", "undrain")
        await _admin(s, a, "d1", "drain")
        await _until_drained(s, b, {"d1"})
        await _ask(s, b, 3, "d0 is back")
        assert _placed_on(app_b, "d0") == 4
        assert _placed_on(app_b, "d1") == 6
