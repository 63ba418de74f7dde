"""LoRA adapters through a live router (issue 35; docs/lora.md), the official `openai` client in
front, simulated workers speaking vLLM's adapter API behind (disagg_tools/sim/lora.py).

Where adapter requests went is read from the simulated workers' own counters (each counts the
requests it ran under each adapter), never from the router: 0 requests on a worker whose pair
lacks the adapter on one side."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import openai
import pytest
from openai import AsyncOpenAI

from disagg_tools.sim.lora import LoraConfig
from tests.conftest import MODEL, SimCluster, sim_cluster

HELD = LoraConfig(enabled=True, max_loras=4, modules=(("sql", "/loras/sql"),), load_s=0.5)
EMPTY = LoraConfig(enabled=True, max_loras=4, load_s=0.5)
RUNTIME = LoraConfig(enabled=True, max_loras=4, runtime_loading=True, load_s=0.5)


def _client(c: SimCluster) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=c.router_url + "/v1", api_key="x", max_retries=0, timeout=60)


async def _ask(c: SimCluster, model: str, content: str = "hello there", **kw: Any) -> Any:
    async with _client(c) as client:
        return await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": content}], max_tokens=8, **kw
        )


async def _lora(c: SimCluster, wid: str) -> dict[str, Any]:
    async with aiohttp.ClientSession() as s, s.get(c.workers[wid] + "/sim/lora") as r:
        return dict(await r.json())


def _lora_workers(cfgs: dict[str, LoraConfig], runtime: bool = False) -> dict[str, Any]:
    """sim_cluster's arguments: each worker's adapters, and its router entry saying so."""
    return {
        "worker_overrides": {wid: {"lora": cfg} for wid, cfg in cfgs.items()},
        "entry_overrides": {
            wid: {"max_loras": cfg.max_loras, "lora_runtime_loading": runtime}
            for wid, cfg in cfgs.items()
        },
    }


async def test_an_adapter_missing_on_one_side_is_never_placed_on_that_pair() -> None:
    """p0 lacks `sql`, d1 lacks it; p1 and d0 hold it. Every `sql` request runs on (p1, d0):
    the pairs (p0, *) and (*, d1) lack it on one side and get none, though p0 and d1 are idle."""
    cfgs = {"p0": EMPTY, "p1": HELD, "d0": HELD, "d1": EMPTY}
    async with sim_cluster(prefill=2, decode=2, redis_prefix=None, **_lora_workers(cfgs)) as c:
        for i in range(12):
            answer = await _ask(c, "sql", content=f"question {i}")
            assert answer.model == "sql" and answer.choices[0].message.content
        assert (await _lora(c, "p1"))["requests"] == {"sql": 12}
        assert (await _lora(c, "d0"))["requests"] == {"sql": 12}
        assert (await _lora(c, "p0"))["requests"] == {}
        assert (await _lora(c, "d1"))["requests"] == {}
        # The base model still goes everywhere it is in rotation.
        for i in range(8):
            await _ask(c, MODEL, content=f"base {i}")


async def test_an_adapter_on_decode_only_is_a_503_naming_it_and_reaches_no_worker() -> None:
    cfgs = {"p0": EMPTY, "d0": HELD}
    async with sim_cluster(redis_prefix=None, **_lora_workers(cfgs)) as c:
        with pytest.raises(openai.APIStatusError) as info:
            await _ask(c, "sql")
        assert info.value.status_code == 503
        assert info.value.response.headers.get("Retry-After")
        assert "'sql'" in str(info.value.body)
        assert (await _lora(c, "d0"))["requests"] == {}
        assert (await _lora(c, "p0"))["requests"] == {}
        assert (await _ask(c, MODEL)).choices[0].message.content  # the base model is fine


async def test_an_adapter_of_the_catalog_is_loaded_on_both_sides_once() -> None:
    cfgs = {"p0": RUNTIME, "d0": RUNTIME}
    catalog = {"fr": {"path": "/loras/fr", "base_model": MODEL}}
    async with sim_cluster(
        redis_prefix=None, lora={"catalog": catalog}, **_lora_workers(cfgs, runtime=True)
    ) as c:
        for i in range(5):
            assert (await _ask(c, "fr", content=f"bonjour {i}")).model == "fr"
        for wid in ("p0", "d0"):
            state = await _lora(c, wid)
            assert state["registered"] == ["fr"] and state["requests"] == {"fr": 5}
            assert state["loads"] == 1  # loaded once, by the router, before the first prefill
        assert c.parts.pools.placement.loras.loads == 2


async def test_pairs_that_hold_the_adapter_are_preferred_to_loading_it() -> None:
    """Every worker may load `sql`; (p1, d1) hold it already: no load is made."""
    cfgs = {"p0": RUNTIME, "p1": HELD, "d0": RUNTIME, "d1": HELD}
    catalog = {"sql": "/loras/sql"}
    async with sim_cluster(
        prefill=2,
        decode=2,
        redis_prefix=None,
        lora={"catalog": catalog},
        **_lora_workers(cfgs, runtime=True),
    ) as c:
        for i in range(8):
            await _ask(c, "sql", content=f"select {i}")
        assert (await _lora(c, "p1"))["requests"] == {"sql": 8}
        assert (await _lora(c, "d1"))["requests"] == {"sql": 8}
        assert c.parts.pools.placement.loras.loads == 0


async def test_a_failed_load_is_a_503_for_that_request_and_the_breaker_stays_closed() -> None:
    cfgs = {"p0": RUNTIME, "d0": RUNTIME}
    catalog = {"broken": "/loras/missing-weights"}
    async with sim_cluster(
        redis_prefix=None, lora={"catalog": catalog}, **_lora_workers(cfgs, runtime=True)
    ) as c:
        for _ in range(5):  # more than breaker.failures_to_open
            with pytest.raises(openai.APIStatusError) as info:
                await _ask(c, "broken")
            assert info.value.status_code == 503
            assert info.value.response.headers.get("Retry-After")
            body = info.value.body
            assert isinstance(body, dict) and "'broken'" in body["message"], body
            assert "missing-weights" not in body["message"]  # the engine's words stay in the log
        for wid in ("p0", "d0"):
            worker = c.parts.pools.workers[wid]
            assert worker.breaker.state == "closed" and worker.breaker.failures == 0
            assert (await _lora(c, wid))["requests"] == {}
        assert (await _ask(c, MODEL)).choices[0].message.content
        assert sum((await c.reserved_blocks()).values()) == 0


async def test_unknown_adapters_are_404s_and_keep_nothing() -> None:
    """Unknown names, path-traversal-looking ones and a thousand distinct ones: each a 404
    naming it (param `model`, code `model_not_found`), no load asked of any worker, nothing
    kept for them."""
    cfgs = {"p0": RUNTIME, "d0": HELD}
    catalog = {"sql": "/loras/sql"}
    async with sim_cluster(
        redis_prefix=None, lora={"catalog": catalog}, **_lora_workers(cfgs, runtime=True)
    ) as c:
        loras = c.parts.pools.placement.loras
        before = dict(loras.adapters())
        names = ["no-such-adapter", "../../etc/passwd", "..%2F..%2Fetc", "/loras/sql"]
        names += [f"unknown-{i}" for i in range(1000)]
        async with _client(c) as client:
            for name in names:
                with pytest.raises(openai.NotFoundError) as info:
                    await client.chat.completions.create(
                        model=name, messages=[{"role": "user", "content": "x"}], max_tokens=2
                    )
                body = info.value.body
                assert isinstance(body, dict), body
                assert body["code"] == "model_not_found" and body["param"] == "model"
                assert name in body["message"]
        assert loras.adapters() == before and loras.loads == 0 and loras.load_failures == 0
        for wid in ("p0", "d0"):
            assert not await c.worker_requests(wid)  # no generation reached a worker
            assert (await _lora(c, wid))["loads"] == 0  # nor a load


async def test_models_lists_adapters_with_their_base_model() -> None:
    cfgs = {"p0": HELD, "d0": HELD}
    catalog = {"fr": {"path": "/loras/fr"}}
    async with sim_cluster(
        redis_prefix=None, lora={"catalog": catalog}, **_lora_workers(cfgs)
    ) as c:
        async with _client(c) as client:
            models = {m.id: m for m in (await client.models.list()).data}
        assert set(models) == {MODEL, "sql", "fr"}
        assert models["sql"].model_extra and models["sql"].model_extra["parent"] == MODEL
        assert models["fr"].model_extra and models["fr"].model_extra["parent"] == MODEL


async def test_concurrent_requests_for_one_adapter_load_it_once_per_worker() -> None:
    """Twelve requests at once for a catalog adapter no worker holds: one load per worker (the
    others wait behind it and find it held), every answer served under the adapter."""
    slow = LoraConfig(enabled=True, max_loras=4, runtime_loading=True, load_s=50.0)  # 0.1 s real
    cfgs = {"p0": slow, "d0": slow}
    async with sim_cluster(
        redis_prefix=None, lora={"catalog": {"fr": "/loras/fr"}}, **_lora_workers(cfgs, True)
    ) as c:
        answers = await asyncio.gather(*(_ask(c, "fr", content=f"q{i}") for i in range(12)))
        assert all(a.model == "fr" for a in answers)
        for wid in ("p0", "d0"):
            state = await _lora(c, wid)
            assert state["loads"] == 1 and state["requests"] == {"fr": 12}
        assert c.parts.pools.placement.loras.loads == 2


async def test_a_load_past_its_timeout_is_a_503_and_the_worker_stays_in_rotation() -> None:
    stuck = LoraConfig(enabled=True, max_loras=4, runtime_loading=True, load_s=1e6)
    cfgs = {"p0": stuck, "d0": RUNTIME}
    settings = {"lora": {"catalog": {"fr": "/loras/fr"}, "load_timeout_s": 0.3}}
    async with sim_cluster(redis_prefix=None, **settings, **_lora_workers(cfgs, True)) as c:
        with pytest.raises(openai.APIStatusError) as info:
            await _ask(c, "fr")
        assert info.value.status_code == 503
        assert info.value.response.headers.get("Retry-After")
        assert "not loaded within 0.3 s" in str(info.value.body)
        worker = c.parts.pools.workers["p0"]
        assert worker.breaker.state == "closed" and worker.available
        assert (await _ask(c, MODEL)).choices[0].message.content
        assert sum((await c.reserved_blocks()).values()) == 0
