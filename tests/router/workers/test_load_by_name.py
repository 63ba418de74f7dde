"""The load poll asks vLLM's /metrics for its four gauges by name, and never reads idleness from
a filter that dropped them.

vLLM serves /metrics with prometheus_client, which answers a request naming families with
`name[]` with those families only. Served here by prometheus_client itself (its own HTTP
server, on an ephemeral port), beside servers that ignore the names or drop the gauges.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any
from urllib.parse import unquote

import aiohttp
import pytest
from aiohttp import web
from prometheus_client import CollectorRegistry, Gauge, Histogram, start_http_server

from router.workers.discovery import (
    LOAD_METRICS_PATH,
    fetch_vllm_load,
    fetch_vllm_load_text,
    parse_vllm_metrics,
)
from router.workers.dp_loads import fetch_rank_loads
from tests.ports import free_port

# Two engines (data-parallel ranks), as vLLM labels them, and a histogram family with many
# buckets: the bulk of a real /metrics text, which the poll should not be sent.
_ENGINES = (("0", 3, 1, 0.25), ("1", 2, 4, 0.5))


def _vllm_like_registry() -> CollectorRegistry:
    registry = CollectorRegistry()
    labels = ["engine", "model_name"]
    running = Gauge("vllm:num_requests_running", "running", labels, registry=registry)
    waiting = Gauge("vllm:num_requests_waiting", "waiting", labels, registry=registry)
    usage = Gauge("vllm:kv_cache_usage_perc", "usage", labels, registry=registry)
    info = Gauge(
        "vllm:cache_config_info",
        "cache config",
        ["block_size", "engine", "num_gpu_blocks"],
        registry=registry,
    )
    latency = Histogram(
        "vllm:e2e_request_latency_seconds",
        "latency",
        labels,
        buckets=[0.001 * 2**i for i in range(30)],
        registry=registry,
    )
    for engine, run, wait, use in _ENGINES:
        running.labels(engine, "m").set(run)
        waiting.labels(engine, "m").set(wait)
        usage.labels(engine, "m").set(use)
        info.labels("16", engine, "1000").set(1)
        latency.labels(engine, "m").observe(0.5)
    return registry


@pytest.fixture
def prometheus_url() -> Iterator[str]:
    """A vLLM-shaped registry served by prometheus_client's own HTTP server."""
    port = free_port()
    server, thread = start_http_server(port, addr="127.0.0.1", registry=_vllm_like_registry())
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


async def test_the_poll_is_answered_with_the_gauges_only(prometheus_url: str) -> None:
    async with aiohttp.ClientSession() as session:
        async with session.get(prometheus_url + "/metrics") as resp:
            whole = await resp.text()
        text = await fetch_vllm_load_text(session, prometheus_url)
        snap = await fetch_vllm_load(session, prometheus_url, clock=lambda: 7.0)
    assert "vllm:e2e_request_latency_seconds" in whole
    assert "vllm:e2e_request_latency_seconds" not in text  # the names were asked for and kept
    assert len(text) * 5 < len(whole)
    # The same reading as from the whole text.
    assert parse_vllm_metrics(text, 7.0) == parse_vllm_metrics(whole, 7.0) == snap
    assert (snap.running, snap.waiting, snap.kv_usage, snap.num_gpu_blocks) == (5, 5, 0.5, 2000)


async def test_data_parallel_ranks_split_from_the_answer_by_name(prometheus_url: str) -> None:
    async with aiohttp.ClientSession() as session:
        ranks = await fetch_rank_loads(session, prometheus_url, "vllm", clock=lambda: 1.0)
    assert {rank: (s.running, s.waiting, s.kv_usage) for rank, s in ranks.items()} == {
        0: (3, 1, 0.25),
        1: (2, 4, 0.5),
    }


_WHOLE = (
    'vllm:num_requests_running{model_name="m"} 6\n'
    'vllm:num_requests_waiting{model_name="m"} 2\n'
    'vllm:kv_cache_usage_perc{model_name="m"} 0.75\n'
)


class _Stub:
    """A /metrics server whose answer to `name[]` is chosen by the test; every query seen."""

    def __init__(self, by_name: Any, slash: bool = True) -> None:
        self.by_name = by_name  # str: that text; int: that status; None: ignore the names
        self.slash = slash  # False: no `/metrics/` route (404), as a server that is not vLLM
        self.queries: list[str] = []

    async def handle(self, request: web.Request) -> web.Response:
        self.queries.append(request.query_string)
        if "name[]" not in request.query or self.by_name is None:
            return web.Response(text=_WHOLE)
        if isinstance(self.by_name, int):
            return web.Response(status=self.by_name, text="no")
        return web.Response(text=self.by_name)


async def _poll(stub: _Stub) -> tuple[Any, list[str]]:
    app = web.Application()
    app.router.add_get("/metrics", stub.handle)
    if stub.slash:
        app.router.add_get("/metrics/", stub.handle)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    try:
        async with aiohttp.ClientSession() as session:
            try:
                snap: Any = await fetch_vllm_load(session, f"http://127.0.0.1:{port}")
            except aiohttp.ClientResponseError as exc:
                snap = exc
    finally:
        await runner.cleanup()
    return snap, stub.queries


@pytest.mark.parametrize(
    "by_name",
    [
        "",  # an older prometheus_client in multiprocess mode: the names match no collector
        "# HELP vllm:num_requests_waiting w\n",  # a proxy's or a buggy engine's partial answer
        'vllm:num_requests_waiting{model_name="m"} 0\n',
    ],
)
async def test_an_answer_without_the_running_gauge_is_not_read_as_idle(by_name: str) -> None:
    snap, queries = await _poll(_Stub(by_name))
    assert (snap.running, snap.waiting, snap.kv_usage) == (6, 2, 0.75)  # the whole text's
    assert len(queries) == 2
    assert unquote(queries[0]) == LOAD_METRICS_PATH.partition("?")[2]  # by name first
    assert queries[1] == ""  # then the whole text


async def test_a_server_without_the_path_by_name_is_read_whole() -> None:
    snap, queries = await _poll(_Stub("", slash=False))
    assert (snap.running, snap.waiting) == (6, 2)
    assert queries == [""]  # the 404 is not logged by the handler: only the whole text's


async def test_a_server_that_ignores_the_names_is_read_in_one_request() -> None:
    snap, queries = await _poll(_Stub(None))
    assert (snap.running, snap.waiting) == (6, 2)
    assert len(queries) == 1


async def test_a_refused_poll_by_name_fails_the_poll() -> None:
    """A 5xx is the engine's answer, not a missing filter: the poll fails (the router's own
    accounting stands, router/workers/load_poller.py) rather than asking again."""
    snap, queries = await _poll(_Stub(503))
    assert isinstance(snap, aiohttp.ClientResponseError) and snap.status == 503
    assert len(queries) == 1


def test_the_path_names_every_gauge_the_parser_reads() -> None:
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:gpu_cache_usage_perc",
        "vllm:cache_config_info",
    ):
        assert f"name[]={name}" in LOAD_METRICS_PATH
