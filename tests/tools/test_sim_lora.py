"""The simulated worker's LoRA adapters (disagg_tools/sim/lora.py) speak vLLM's API: /v1/models
lists adapters with their `parent`, the runtime load/unload routes answer as vLLM's do, a request
under an adapter that is not registered is vLLM's 404, and residency is an LRU of `max_loras`."""

from __future__ import annotations

from typing import Any

import aiohttp
import pytest

from disagg_tools.sim.lora import LoraConfig
from disagg_tools.sim.worker import WorkerConfig, running_worker

BASE = "llama-3-8b"


def cfg(**lora: Any) -> WorkerConfig:
    return WorkerConfig(
        role="both", time_scale=1000.0, mean_output_tokens=8, lora=LoraConfig(**lora)
    )


async def _post(s: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> tuple[int, Any]:
    async with s.post(url, json=body) as r:
        ctype = r.headers.get("Content-Type", "")
        return r.status, (await r.json() if "json" in ctype else await r.text())


async def _chat(s: aiohttp.ClientSession, url: str, model: str) -> tuple[int, Any]:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    return await _post(s, url + "/v1/chat/completions", body)


@pytest.mark.asyncio
async def test_models_lists_preloaded_adapters_with_their_parent() -> None:
    config = cfg(enabled=True, max_loras=2, modules=(("sql", "/loras/sql"),))
    async with running_worker(config) as url, aiohttp.ClientSession() as s:
        async with s.get(url + "/v1/models") as r:
            data = (await r.json())["data"]
        assert [c["id"] for c in data] == [BASE, "sql"]
        assert data[0]["parent"] is None
        assert data[1]["parent"] == BASE and data[1]["root"] == "/loras/sql"
        status, answer = await _chat(s, url, "sql")
        assert status == 200 and answer["model"] == "sql"
        status, err = await _chat(s, url, "nope")
        assert status == 404
        assert err["error"]["message"] == "The model `nope` does not exist."
        assert err["error"]["param"] == "model"
        state = await (await s.get(url + "/sim/lora")).json()
        assert state["requests"] == {"sql": 1}


@pytest.mark.asyncio
async def test_runtime_routes_are_absent_without_runtime_loading() -> None:
    async with running_worker(cfg(enabled=True)) as url, aiohttp.ClientSession() as s:
        status, body = await _post(
            s, url + "/v1/load_lora_adapter", {"lora_name": "a", "lora_path": "/a"}
        )
        assert (status, body) == (404, {"detail": "Not Found"})


@pytest.mark.asyncio
async def test_load_unload_errors_and_lru_residency() -> None:
    config = cfg(enabled=True, max_loras=2, runtime_loading=True, load_s=0.0)
    async with running_worker(config) as url, aiohttp.ClientSession() as s:
        load, unload = url + "/v1/load_lora_adapter", url + "/v1/unload_lora_adapter"
        assert await _post(s, load, {"lora_name": "a", "lora_path": "/a"}) == (
            200,
            "Success: LoRA adapter 'a' added successfully.",
        )
        status, err = await _post(s, load, {"lora_name": "a", "lora_path": "/a"})
        assert status == 400
        assert err["error"]["message"] == "The lora adapter 'a' has already been loaded."
        status, err = await _post(s, load, {"lora_name": "b"})
        assert status == 400 and "Both 'lora_name' and 'lora_path'" in err["error"]["message"]
        status, err = await _post(s, load, {"lora_name": "b", "lora_path": "/missing/b"})
        assert status == 404 and err["error"]["type"] == "NotFoundError"
        for name in ("b", "c"):
            assert (await _post(s, load, {"lora_name": name, "lora_path": f"/{name}"}))[0] == 200
        state = await (await s.get(url + "/sim/lora")).json()
        assert state["registered"] == ["a", "b", "c"]
        assert state["resident"] == ["b", "c"] and state["evictions"] == 1
        assert (await _chat(s, url, "a"))[0] == 200  # swapped back in: b evicted
        state = await (await s.get(url + "/sim/lora")).json()
        assert state["resident"] == ["c", "a"] and state["loads"] == 4
        status, err = await _post(s, unload, {"lora_name": "zz"})
        assert status == 404
        assert err["error"]["message"] == "The lora adapter 'zz' cannot be found."
        assert (await _post(s, unload, {"lora_name": "a"}))[0] == 200
        assert (await _chat(s, url, "a"))[0] == 404
        await _post(s, url + "/sim/lora", {"fail_loads": True})
        assert (await _post(s, load, {"lora_name": "d", "lora_path": "/d"}))[0] == 404


@pytest.mark.asyncio
async def test_base_model_requests_are_unchanged() -> None:
    async with running_worker(cfg()) as url, aiohttp.ClientSession() as s:
        async with s.get(url + "/v1/models") as r:
            assert [c["id"] for c in (await r.json())["data"]] == [BASE]
        assert (await _chat(s, url, BASE))[0] == 200
