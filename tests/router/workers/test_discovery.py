"""Discovery: load records and KV layouts, parsed from real simulated workers and known texts."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest

from disagg_tools.sim.worker import WorkerConfig, running_worker
from policies.base import KVLayout
from router.workers.discovery import (
    LoadSnapshot,
    fetch_layout,
    fetch_sglang_load,
    fetch_vllm_load,
    layout_facts_sglang,
    merge_layout,
    parse_sglang_load,
    parse_vllm_metrics,
)

REAL_VLLM_METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 2.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 4.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.5
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",cache_dtype="auto",engine="0",num_gpu_blocks="27000"} 1.0
"""


def test_parse_real_vllm_metrics_text() -> None:
    snap = parse_vllm_metrics(REAL_VLLM_METRICS, at=10.0)
    assert (snap.running, snap.waiting, snap.kv_usage, snap.num_gpu_blocks) == (5, 4, 0.5, 27000)


def test_parse_vllm_metrics_without_cache_info_or_usage() -> None:
    snap = parse_vllm_metrics("vllm:num_requests_running 1\n", at=0.0)
    assert (snap.running, snap.waiting, snap.kv_usage, snap.num_gpu_blocks) == (1, 0, None, None)


def test_old_vllm_gpu_cache_usage_name() -> None:
    snap = parse_vllm_metrics('vllm:gpu_cache_usage_perc{model_name="m"} 0.75\n', at=0.0)
    assert snap.kv_usage == 0.75


def test_stale_is_never_idle() -> None:
    snap = LoadSnapshot(0, 0, 0.0, None, at=100.0)
    assert snap.idle(now=100.5, max_age_s=1.0)
    assert snap.stale(now=102.0, max_age_s=1.0)
    assert not snap.idle(now=102.0, max_age_s=1.0)
    assert not LoadSnapshot(1, 0, 0.0, None, at=100.0).idle(now=100.0, max_age_s=1.0)
    assert "run=0" in repr(snap)


@pytest.mark.parametrize(
    ("load", "want"),
    [
        (
            [
                {"dp_rank": 0, "num_reqs": 5, "num_waiting_reqs": 2, "num_tokens": 800},
                {"dp_rank": 1, "num_reqs": 1, "num_waiting_reqs": 0, "num_tokens": 200},
            ],
            (4, 2),
        ),
        ({"load": 7}, (7, 0)),
        # /v1/loads (SGLang 0.5.23, as its server answers): running and waiting apart
        (
            {
                "version": "0.5.23",
                "loads": [
                    {
                        "dp_rank": 0,
                        "num_running_reqs": 3,
                        "num_waiting_reqs": 2,
                        "num_used_tokens": 800,
                        "max_total_num_tokens": 10_000,
                    },
                    {
                        "dp_rank": 1,
                        "num_running_reqs": 1,
                        "num_waiting_reqs": 0,
                        "num_used_tokens": 200,
                    },
                ],
            },
            (4, 2),
        ),
        ([], (0, 0)),
        ("garbage", (0, 0)),
    ],
)
def test_parse_sglang_load(load: Any, want: tuple[int, int]) -> None:
    info = {"max_total_num_tokens": 10_000, "page_size": 16}
    snap = parse_sglang_load(load, info, at=1.0)
    assert (snap.running, snap.waiting) == want
    assert snap.num_gpu_blocks == 625


def test_sglang_v1_loads_gives_its_own_capacity_and_usage() -> None:
    load = {
        "loads": [{"num_running_reqs": 1, "num_used_tokens": 2048, "max_total_num_tokens": 8192}]
    }
    snap = parse_sglang_load(load, {"page_size": 1}, at=0.0)
    assert (snap.kv_usage, snap.num_gpu_blocks) == (0.25, 8192)


def test_sglang_usage_from_tokens() -> None:
    load = [{"dp_rank": 0, "num_reqs": 1, "num_waiting_reqs": 0, "num_tokens": 2500}]
    snap = parse_sglang_load(load, {"max_total_num_tokens": 10_000, "page_size": 1}, at=0.0)
    assert snap.kv_usage == 0.25


async def _busy(url: str, n: int) -> list[asyncio.Task[Any]]:
    """n long streaming requests in flight on a worker (ignore_eos, many tokens)."""
    session = aiohttp.ClientSession()
    body = {
        "model": "llama-3-8b",
        "prompt": "x " * 50,
        "max_tokens": 5000,
        "ignore_eos": True,
        "stream": True,
    }

    async def one() -> None:
        async with session.post(url + "/v1/completions", json=body) as r:
            await r.content.readany()  # first token: now it is in the batch
            await asyncio.Event().wait()

    tasks = [asyncio.create_task(one()) for _ in range(n)]
    tasks.append(asyncio.create_task(_close_later(session)))
    return tasks


async def _close_later(session: aiohttp.ClientSession) -> None:
    try:
        await asyncio.Event().wait()
    finally:
        await session.close()


async def _wait_running(fetch: Any, want: int) -> LoadSnapshot:
    for _ in range(500):
        snap: LoadSnapshot = await fetch()
        if snap.running == want:
            return snap
        await asyncio.sleep(0.01)
    pytest.fail(f"never saw {want} running: {snap!r}")


@pytest.mark.parametrize("protocol", ["vllm", "sglang"])
async def test_load_from_a_real_sim_worker(protocol: str) -> None:
    cfg = WorkerConfig(role="both", kv_blocks=1024, time_scale=1.0)
    async with running_worker(cfg) as url, aiohttp.ClientSession() as s:
        fetch = (
            (lambda: fetch_vllm_load(s, url))
            if protocol == "vllm"
            else (lambda: fetch_sglang_load(s, url))
        )
        idle = await fetch()
        assert (idle.running, idle.waiting) == (0, 0)
        assert idle.kv_usage == 0.0
        tasks = await _busy(url, 2)
        try:
            busy = await _wait_running(fetch, 2)
            assert busy.kv_usage is not None and busy.kv_usage > 0
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        if protocol == "sglang":
            assert busy.num_gpu_blocks == 1024


async def test_layout_from_sim_over_vllm_endpoints() -> None:
    cfg = WorkerConfig(role="decode", model="llama-3-8b", served_model_name="alias")
    async with running_worker(cfg) as url, aiohttp.ClientSession() as s:
        layout = await fetch_layout(s, url, "sim", KVLayout(), {"kv_heads": 8, "head_dim": 128})
    # The served name: what clients ask for and the router routes on.
    assert layout == KVLayout(
        engine="sim", engine_version="0.0.0-sim", model="alias", kv_heads=8, head_dim=128
    )


async def test_layout_from_sim_over_sglang_server_info() -> None:
    cfg = WorkerConfig(role="prefill", model="llama-3-70b", block_size=32, bootstrap_port=0)
    async with running_worker(cfg) as url, aiohttp.ClientSession() as s:
        layout = await fetch_layout(s, url, "sglang", KVLayout(), {"connector_version": "2"})
    assert layout.engine == "sglang"
    assert layout.model == "llama-3-70b"
    assert layout.tp_size == 4
    assert layout.block_size == 32
    assert layout.connector == "mooncake"
    assert layout.connector_version == "2"


def test_configuration_wins_and_typos_are_refused() -> None:
    facts = layout_facts_sglang({"model_path": "a", "tp_size": 2, "kv_cache_dtype": "fp8_e5m2"})
    assert facts["dtype"] == "fp8_e5m2"
    merged = merge_layout(KVLayout(), facts, {"tp_size": 4})
    assert (merged.model, merged.tp_size, merged.dtype) == ("a", 4, "fp8_e5m2")
    with pytest.raises(ValueError, match="unknown KV layout fields"):
        merge_layout(KVLayout(), {}, {"tp": 4})


def test_mixed_versions_give_different_keys() -> None:
    old = merge_layout(KVLayout(), {"engine": "vllm", "engine_version": "0.10.1"}, {})
    new = merge_layout(KVLayout(), {"engine": "vllm", "engine_version": "0.11.0"}, {})
    assert old.key != new.key
