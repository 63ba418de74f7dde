"""The Grafana dashboard, proven against a real Prometheus (issue 13).

The compose cluster runs as local processes (tests/compose_services.py): Redis, both router
replicas, the four simulated workers, and the `prometheus` service as the local `prometheus`
binary with the mounted deploy/prometheus.yml (its targets rewritten to the loopback ports,
scraped every second instead of five). Two edits to the mounted files make the traffic show
every panel's signal: the routers believe the decode workers hold 256 KV blocks (so a long
prompt with a long cap is refused with 429 `no_room`), and a prefill worker fails its next
request (so one is retried). After the traffic, every PromQL expression of every dashboard in
deploy/grafana/ is evaluated through Prometheus's HTTP API (`/api/v1/query`) and must return
data.

Without the `prometheus` binary (Debian: `apt-get install prometheus`; .ci/run installs it) the
live test skips; the static check that every query names an exported metric always runs.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import shutil
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from disagg_tools.sim.sim_metrics import SimMetrics
from disagg_tools.sim.textgen import expected_answer
from router.metrics import RouterMetrics
from tests.compose_services import ROOT, ComposeCluster, load_compose

CHAT = "/v1/chat/completions"
DASHBOARDS = sorted((ROOT / "deploy" / "grafana" / "dashboards").glob("*.json"))
ROUTERS = ("router-a", "router-b")
WORKERS = ("prefill-0", "prefill-1", "decode-0", "decode-1")
DECODE_BLOCKS = 256  # as the routers see it: 4,096 tokens


def _panels(panels: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for panel in panels:
        out.append(panel)
        out.extend(_panels(panel.get("panels", [])))  # a collapsed row holds its panels
    return out


def dashboard_queries() -> list[tuple[str, str, str]]:
    """(dashboard file, panel title, PromQL) for every target of every panel."""
    out = []
    for path in DASHBOARDS:
        for panel in _panels(json.loads(path.read_text())["panels"]):
            for target in panel.get("targets", []):
                out.append((path.name, panel["title"], target["expr"]))
    return out


def _metric_names(expr: str) -> set[str]:
    return set(re.findall(r"\b(?:disagg_router_|vllm:|sim:)[A-Za-z0-9_:]+", expr))


def _exported_names() -> set[str]:
    """Every sample name the router and a simulated worker expose (labelled or not)."""
    names: set[str] = set()
    suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"], "gauge": [""]}
    for text in (
        RouterMetrics().render(),
        SimMetrics("m", lambda: 0.0, lambda: 0.0, lambda: 0.0).render(),
    ):
        for family in text_string_to_metric_families(text.decode()):
            names.update(family.name + s for s in suffixes[family.type])
    return names


def test_every_dashboard_query_names_exported_metrics() -> None:
    queries = dashboard_queries()
    assert len(queries) >= 30, len(queries)
    exported = _exported_names()
    for _, title, expr in queries:
        used = _metric_names(expr)
        assert used, (title, expr)
        assert used <= exported, (title, sorted(used - exported))
        assert "$" not in expr, (title, "Grafana variables would not evaluate here")


def test_the_dashboard_covers_the_issue() -> None:
    exprs = " ".join(e for _, _, e in dashboard_queries())
    for metric in (
        "ttft_seconds_bucket",
        "admission_waiting",
        "rejections_total",
        "reserved_blocks",
        "stranded_kv_bytes",
        "retries_total",
        "retry_budget_exhausted_total",
        "estimate_relative_error_bucket",
        "breaker_open",
        "worker_healthy",
        "store_up",
        "owed_store_steps",
        "store_resets_total",
    ):
        assert "disagg_router_" + metric in exprs, metric


def test_the_dashboard_shows_each_tenants_share_waits_and_preemptions() -> None:
    """Issue 33: per tenant, the blocks held against the share, the waiters, the admission
    waits and the preemptions by reason."""
    exprs = " ".join(e for _, _, e in dashboard_queries())
    for metric in (
        "tenant_decode_blocks_held",
        "tenant_decode_share_blocks",
        "tenant_waiting",
        "tenant_admission_wait_seconds_bucket",
        "tenant_preemptions_total",
    ):
        assert "disagg_router_" + metric in exprs, metric


def _edit_cluster(text: str) -> str:
    config = yaml.safe_load(text)
    for w in config["workers"]:
        if w["role"] == "decode":
            w["kv_blocks"] = DECODE_BLOCKS
    # The fair share's order, so that its per-tenant gauges (issue 33) are exported too.
    config.setdefault("admission", {})["fairness"] = "vtc"
    return yaml.safe_dump(config, sort_keys=False)


def _edit_prometheus(text: str) -> str:
    config = yaml.safe_load(text)
    config.setdefault("global", {}).update(scrape_interval="1s", evaluation_interval="1s")
    return yaml.safe_dump(config, sort_keys=False)


async def _query(session: aiohttp.ClientSession, base: str, expr: str) -> list[dict[str, Any]]:
    async with session.get(base + "/api/v1/query", params={"query": expr}) as resp:
        doc = await resp.json()
        assert resp.status == 200 and doc["status"] == "success", (expr, resp.status, doc)
        assert doc["data"]["resultType"] == "vector", (expr, doc["data"]["resultType"])
        return list(doc["data"]["result"])


async def _stream(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> int:
    async with session.post(url + CHAT, json=body) as resp:
        raw = await resp.read()
        if resp.status != 200:
            return resp.status
    pieces: list[str] = []
    for line in raw.decode().splitlines():
        if line.startswith("data: {"):
            event = json.loads(line[6:])
            assert "error" not in event, event
            pieces.extend(c["delta"].get("content") or "" for c in event["choices"])
    assert "".join(pieces) == expected_answer(CHAT, body)[0]
    return 200


async def _answers(session: aiohttp.ClientSession, url: str) -> bool:
    try:
        async with session.get(url) as resp:
            return resp.status == 200
    except aiohttp.ClientError:
        return False


async def _router_counter(session: aiohttp.ClientSession, url: str, name: str) -> float:
    """The sum of a labelled counter's series on one router's /metrics."""
    async with session.get(url + "/metrics") as resp:
        text = await resp.text()
    lines = [line for line in text.splitlines() if line.startswith(name + "_total{")]
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines)


async def _drive(session: aiohttp.ClientSession, cluster: ComposeCluster) -> dict[int, int]:
    """Rounds through both replicas, each with answers, two refused long prompts (429
    `no_room`) and a failing prefill on each prefill worker (retried), until a retry was
    counted and the rounds have spanned several scrapes: a series born and finished between
    two scrapes has a rate of 0, as Prometheus does not assume a new series started at 0."""
    statuses: dict[int, int] = {}
    huge = {
        "model": "llama-3-8b",
        # ~2,000 prompt tokens fit the 256 blocks of 16 (a prompt that alone does not is a 400
        # at once, router/request/admit.py); with 3,000 more reserved while the estimator has
        # nothing learned for this cap it does not: 429 `no_room`.
        "messages": [{"role": "user", "content": "long " * 1600}],
        "max_tokens": 3000,
        "stream": True,
    }
    started = time.monotonic()
    for round_ in range(30):
        for name in ("prefill-0", "prefill-1"):
            fault = {"prefill_fail": True, "count": 1}
            async with session.post(cluster.url(name) + "/sim/faults", json=fault) as resp:
                assert resp.status == 200
        bodies = [
            {
                "model": "llama-3-8b",
                "messages": [{"role": "user", "content": f"round {round_} request {i}"}],
                "max_tokens": 16 + i,
                "stream": True,
            }
            for i in range(6)
        ]
        calls = [_stream(session, cluster.url(ROUTERS[i % 2]), b) for i, b in enumerate(bodies)]
        calls += [_stream(session, cluster.url(router), huge) for router in ROUTERS]
        for status in await asyncio.gather(*calls):
            statuses[status] = statuses.get(status, 0) + 1
        retried = 0.0
        for router in ROUTERS:
            retried += await _router_counter(session, cluster.url(router), "disagg_router_retries")
        if retried > 0 and time.monotonic() - started > 5:
            return statuses
        await asyncio.sleep(0.3)
    raise AssertionError(f"no retry was counted: {statuses}")


async def test_every_dashboard_query_returns_data(tmp_path: Path) -> None:
    for binary in ("prometheus", "redis-server"):
        if shutil.which(binary) is None:
            pytest.skip(f"{binary} is not installed (.ci/run installs it)")
    services = [name for name in load_compose() if name != "grafana"]
    edits = {"deploy/cluster.yaml": _edit_cluster, "deploy/prometheus.yml": _edit_prometheus}
    with ComposeCluster(tmp_path, services=services, edits=edits) as cluster:
        prom = cluster.url("prometheus")
        timeout = aiohttp.ClientTimeout(total=30)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            deadline = time.monotonic() + 60
            while not await _answers(session, prom + "/-/ready"):
                assert cluster.running["prometheus"].proc.poll() is None, cluster.tail("prometheus")
                assert time.monotonic() < deadline, cluster.tail("prometheus")
                await asyncio.sleep(0.2)
            # Every target of deploy/prometheus.yml is a live process, scraped and up.
            while True:
                with_up = await _query(session, prom, "up == 1")
                if len(with_up) == len(ROUTERS) + len(WORKERS):
                    break
                assert time.monotonic() < deadline, (with_up, cluster.tail("prometheus"))
                await asyncio.sleep(0.5)
            jobs = {r["metric"]["job"] for r in with_up}
            assert jobs == {"disagg-router", "workers"}, jobs

            statuses = await _drive(session, cluster)
            assert set(statuses) == {200, 429}, statuses

            # Scrapes after the traffic: a rate over [1m] needs two samples of each series, so
            # wait until the newest series of every metric the dashboards use has three.
            queries = dashboard_queries()
            deadline = time.monotonic() + 60
            for metric in sorted({m for _, _, e in queries for m in _metric_names(e)}):
                newest = f"min(count_over_time({metric}[1m]))"
                while not [
                    x for x in await _query(session, prom, newest) if float(x["value"][1]) >= 3
                ]:
                    assert time.monotonic() < deadline, (metric, cluster.tail("prometheus"))
                    await asyncio.sleep(0.5)
            results: dict[str, list[dict[str, Any]]] = {}
            for _, _, expr in queries:
                results[expr] = await _query(session, prom, expr)

            def by(expr: str, label: str) -> set[str]:
                return {r["metric"].get(label, "") for r in results[expr]}

            p = "disagg_router_"
            assert by(f"sum by (status) (rate({p}requests_total[1m]))", "status") == {"200", "429"}
            assert "no_room" in by(f"sum by (reason) (rate({p}rejections_total[1m]))", "reason")
            assert "prefill" in by(f"sum by (side) (rate({p}retries_total[1m]))", "side")

    report = []
    for _, title, expr in queries:
        values = [float(r["value"][1]) for r in results[expr]]
        finite = [v for v in values if not math.isnan(v)]
        report.append(f"{len(values):3d} series {len(finite):3d} finite  {title}: {expr}")
    print(f"\n{statuses}\n" + "\n".join(report))
    empty = [e for e, r in results.items() if not r]
    assert not empty, ("queries without data", empty)
    # Data, and numbers: a NaN everywhere would mean a histogram nobody observed.
    no_number = [e for e, r in results.items() if all(math.isnan(float(x["value"][1])) for x in r)]
    assert not no_number, no_number
