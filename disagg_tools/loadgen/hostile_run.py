"""The frame every hostile scenario runs in: start the cluster, run the traffic within a time
bound, read the routers' counters and the simulated workers' own, stop everything, and turn
the targets into the verdict (`violations`; the command exits 1 on any)."""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp

from disagg_tools.loadgen.entry import git_commit, raise_nofile
from disagg_tools.loadgen.hostile_cluster import ClusterShape, HostileCluster
from disagg_tools.loadgen.loadclient import new_session
from disagg_tools.loadgen.probes import metric_sums

__all__ = ["bounded", "peak_targets", "router_metrics", "sim_states", "target"]

_FORCED = "disagg_router_reservation_forced_growth_total"
_ROUTER_METRICS = (
    _FORCED,
    "disagg_router_reservation_overruns_total",
    "disagg_router_rejections_total",
    "disagg_router_admitted_on_forecast_total",
    "disagg_router_preemptions_total",
    "disagg_router_preempted_tokens_total",
    "disagg_router_tenant_rejections_total",
)


async def router_metrics(session: aiohttp.ClientSession, urls: list[str]) -> dict[str, float]:
    total: dict[str, float] = {}
    for url in urls:
        try:
            sums = await metric_sums(session, url)
        except (aiohttp.ClientError, TimeoutError):
            continue
        for k, v in sums.items():
            if k.startswith(_ROUTER_METRICS) or (
                k.startswith("disagg_router_requests_total{") and 'status="5' in k
            ):
                total[k] = total.get(k, 0.0) + v
    return total


async def sim_states(session: aiohttp.ClientSession, cluster: HostileCluster) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for wid in cluster.shape.decode_ids:
        try:
            async with session.get(
                cluster.worker_urls[wid] + "/sim/state", timeout=aiohttp.ClientTimeout(total=10)
            ) as resp:
                state = await resp.json()
        except (aiohttp.ClientError, TimeoutError):
            continue
        out[wid] = {"preemptions": state["counters"].get("preemptions", 0)}
    return out


def target(ok: bool, what: str) -> tuple[bool, str]:
    return ok, what


def _finish(rep: dict[str, Any], cluster: HostileCluster, t_start: float) -> dict[str, Any]:
    rep["commit"] = git_commit()
    rep["wall_s"] = round(time.perf_counter() - t_start, 1)
    rep["loadavg_1m"] = round(os.getloadavg()[0], 2)
    violations = [f"target {k}: {what}" for k, (ok, what) in rep["targets"].items() if not ok]
    dead = cluster.dead()
    if dead:
        violations.append(f"exited during the run: {dead}")
    # The 503s a scenario provokes on purpose (refused-rpm: no worker in rotation) are no
    # violation; any other 5xx is.
    fivexx = sum(v for k, v in rep["router"].items() if 'status="5' in k)
    fivexx -= rep.get("expected_5xx", 0)
    if fivexx:
        violations.append(f"the routers answered {fivexx:.0f} requests with a 5xx")
    rep["violations"] = violations
    return rep


def peak_targets(res: dict[str, Any], bound: float) -> tuple[bool, str]:
    unknown = [wid for wid, w in res["workers"].items() if w["peak_ratio"] is None]
    if unknown or not res["workers"]:
        return False, f"no capacity read for {unknown or 'any worker'}: nothing to compare"
    worst = max(w["peak_ratio"] for w in res["workers"].values())
    return worst <= bound, f"worst peak {worst:.0%} of capacity (bound {bound:.0%})"


async def bounded(
    shape: ClusterShape,
    traffic: Callable[[HostileCluster, aiohttp.ClientSession], Awaitable[dict[str, Any]]],
    *,
    budget_s: float,
    sessions: int,
    workdir: Path | None,
) -> dict[str, Any]:
    """Start the cluster, run `traffic` within `budget_s`, stop everything; the report."""
    raise_nofile(8192)
    own_dir = workdir is None
    workdir = workdir or Path(tempfile.mkdtemp(prefix="bench-hostile-"))
    cluster = HostileCluster(shape, workdir)
    t_start = time.perf_counter()
    try:
        try:
            async with asyncio.timeout(budget_s):
                await cluster.start()
                async with new_session(sessions) as session:
                    rep = await traffic(cluster, session)
                    rep["router"] = await router_metrics(session, cluster.router_urls)
                    rep["sim"] = await sim_states(session, cluster)
        except TimeoutError as exc:
            raise RuntimeError(f"the run did not end within its {budget_s:.0f} s bound") from exc
        return _finish(rep, cluster, t_start)
    finally:
        cluster.stop()
        if own_dir:
            shutil.rmtree(workdir, ignore_errors=True)
