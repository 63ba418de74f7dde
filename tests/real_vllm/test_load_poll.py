"""The load poll against real vLLM servers: asked by name (`/metrics?name[]=...`), vLLM's
prometheus_client answers the four gauges the router reads, a small part of its whole text,
and they read as the whole text reads."""

from __future__ import annotations

import aiohttp
import pytest

from router.workers.discovery import fetch_vllm_load_text, parse_vllm_metrics
from tests.real_vllm.conftest import VllmCluster

pytestmark = pytest.mark.real_vllm


async def test_the_load_gauges_come_by_name(vllm_cluster: VllmCluster) -> None:
    async with aiohttp.ClientSession() as session:
        for server in vllm_cluster.servers:
            async with session.get(server.url + "/metrics") as resp:
                assert resp.status == 200
                whole = await resp.text()
            text = await fetch_vllm_load_text(session, server.url)
            assert "vllm:num_requests_running" in text, server.name
            assert "vllm:cache_config_info" in text, server.name
            assert "_bucket" not in text, server.name  # the histograms were not sent
            assert len(text) * 10 < len(whole), (server.name, len(text), len(whole))
            by_name, full = parse_vllm_metrics(text, 0.0), parse_vllm_metrics(whole, 0.0)
            assert by_name.num_gpu_blocks == full.num_gpu_blocks is not None, server.name
            assert by_name.num_gpu_blocks > 0
            assert (by_name.kv_usage is None) == (full.kv_usage is None), server.name
