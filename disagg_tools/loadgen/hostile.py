"""Issues 20 and 31 as bench scenarios: wrong output-length estimates and hostile tenants,
on loopback.

    python -m disagg_tools.loadgen.hostile shift       # the over-commit under shifting
                                                       # answers (~2.5 min)
    python -m disagg_tools.loadgen.hostile hint-flood  # X-Expected-Output-Tokens: 1 on
                                                       # 3,000-token answers
    python -m disagg_tools.loadgen.hostile poison      # issue 31: a poisoned estimate
                                                       # (hostile_poison)
    python -m disagg_tools.loadgen.hostile queue       # issue 31: queue lock-out
    python -m disagg_tools.loadgen.hostile refused-rpm # issue 31: refused requests and the
                                                       # tenant's rate (hostile_queue)
    [--time-scale 1] [--json FILE] [--keep-logs] (and each scenario's sizes: --help)

**shift**: two router replicas (`disagg-router serve --config FILE`, one process each) on one
private Redis; one prefill worker p0; three simulated decode workers of 3,000 blocks, d0 and the
`both` workers b0, b1. Phase 1 (`--phase1-s`, 36 s): 100 streaming clients loop on answers of 300
or 1,500 tokens (`--long-share` of them long) over both replicas while an operator moves b0/b1
between roles through the admin API every `--move-every-s`. The `both` workers are then moved back
to decode. Phase 2 (`--phase2-s`): 300 clients ask for 4,000 tokens each, read the response head
and stop reading (hogs: hostile_clients), beside 20 normal clients looping on 64-token
answers. Targets: reserved never above 1.1 x capacity on any worker, every normal request ok,
the normal clients' TTFT p99 < 2 s.

**hint-flood**: one prefill and three decode workers, two replicas, the `hint` estimator (it
trusts the header; `--estimator`): `--clients` loop on answers of 3,000 tokens sent with
`X-Expected-Output-Tokens: 1`. Targets: reserved never above capacity; growth past capacity only
on resident sequences (no "late" reservation grown past it: hostile_report).

Reserved blocks are the store's own (Redis, every ~100 ms); forced growth is also the routers'
`disagg_router_reservation_forced_growth_total`, summed over the replicas. Exit 1 when a target
fails (on today's code they do: that is the issue).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from collections.abc import Callable, Coroutine
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import aiohttp

from disagg_tools.loadgen.entry import run_and_report
from disagg_tools.loadgen.hostile_clients import (
    HogResult,
    Looper,
    cancel_all,
    hog,
    operator,
    request_pool,
)
from disagg_tools.loadgen.hostile_cluster import ClusterShape, HostileCluster, StoreSampler
from disagg_tools.loadgen.hostile_poison import PoisonSpec, run_poison
from disagg_tools.loadgen.hostile_queue import QueueSpec, RefusedSpec, run_queue, run_refused
from disagg_tools.loadgen.hostile_report import clients, format_report, hogs, reservations
from disagg_tools.loadgen.hostile_run import bounded, peak_targets, target

__all__ = ["FloodSpec", "ShiftSpec", "build_parser", "main", "run_flood", "run_shift"]


@dataclass(frozen=True, slots=True)
class ShiftSpec:
    phase1_s: float = 36.0
    phase1_clients: int = 100
    short_tokens: int = 300
    long_tokens: int = 1500
    long_share: float = 0.1
    phase1_max_tokens: int = 2048
    move_every_s: float = 4.0
    phase2_s: float = 60.0
    hogs: int = 300
    hog_tokens: int = 4000
    hold_s: float = 60.0
    normal_clients: int = 20
    normal_tokens: int = 64
    decode_blocks: int = 3000
    time_scale: float = 1.0
    drain_deadline_s: float = 10.0
    log_level: str = "WARNING"


@dataclass(frozen=True, slots=True)
class FloodSpec:
    duration_s: float = 90.0
    clients: int = 200
    ramp_s: float = 15.0  # clients start one after the other over this long
    answer_tokens: int = 3000
    max_tokens: int = 4000
    hint: int = 1
    estimator: str = "hint"
    decode_blocks: int = 3000
    time_scale: float = 1.0
    log_level: str = "WARNING"


async def _phase1(
    spec: ShiftSpec, cluster: HostileCluster, session: aiohttp.ClientSession
) -> tuple[Looper, dict[str, int], float]:
    """Short and long answers while the operator moves the `both` workers; (the clients,
    the operator's answers, when it started)."""
    short = request_pool("short", spec.short_tokens, spec.phase1_max_tokens, 32)
    long = request_pool("long", spec.long_tokens, spec.phase1_max_tokens, 32)
    weights = (1.0 - spec.long_share, spec.long_share)
    clients_ = Looper(
        "phase1", session, cluster.router_urls, (short, long), weights, spec.phase1_s + 60.0
    )
    stop_operator = asyncio.Event()
    moves = asyncio.create_task(operator(cluster, session, spec.move_every_s, stop_operator))
    t0 = time.perf_counter()
    if spec.phase1_s > 0:
        await clients_.run(spec.phase1_clients, spec.phase1_s)
    stop_operator.set()
    return clients_, dict(await moves), t0


async def _phase2(
    spec: ShiftSpec, cluster: HostileCluster, session: aiohttp.ClientSession
) -> tuple[Looper, list[HogResult], float]:
    """The non-reading crowd beside the normal clients; (normal clients, hogs, start)."""
    urls = cluster.router_urls
    hog_pool = request_pool("hog", spec.hog_tokens, spec.hog_tokens, 16)
    hogs_ = [HogResult() for _ in range(spec.hogs)]
    t0 = time.perf_counter()
    hog_tasks = [
        asyncio.create_task(
            hog(res, urls[i % len(urls)], hog_pool[i % len(hog_pool)], spec.hold_s, 90.0)
        )
        for i, res in enumerate(hogs_)
    ]
    normal_pool = request_pool("normal", spec.normal_tokens, spec.normal_tokens, 16)
    normal = Looper("normal", session, urls, (normal_pool,), (1.0,), deadline_s=90.0)
    await normal.run(spec.normal_clients, spec.phase2_s)
    await cancel_all(hog_tasks)  # those still holding close their sockets now
    return normal, hogs_, t0


async def _shift(
    spec: ShiftSpec, cluster: HostileCluster, session: aiohttp.ClientSession
) -> dict[str, Any]:
    all_decode = {wid: "decode" for wid in cluster.shape.both_ids}
    for wid in all_decode:
        await cluster.set_role(session, wid, "decode")
    if not await cluster.until_roles(session, all_decode, 30.0):
        raise RuntimeError("the both workers never took the decode role")
    sampler = StoreSampler(cluster.redis_url, cluster.key_prefix, cluster.shape.decode_ids)
    sampler.start()
    try:
        phase1, moves, t1 = await _phase1(spec, cluster, session)
        for wid in all_decode:
            await cluster.set_role(session, wid, "decode")
        back = await cluster.until_roles(session, all_decode, spec.drain_deadline_s + 20.0)
        t2_sampled = sampler.samples[-1].t if sampler.samples else 0.0
        normal, hogs_, t2 = await _phase2(spec, cluster, session)
    finally:
        await sampler.stop()
    phase2 = reservations(sampler.samples, t_from=t2_sampled)
    norm = clients(normal.results, t2, normal.in_flight)
    p99 = norm["ttft_s"].get("p99")
    return {
        "scenario": "shift",
        "time_scale": spec.time_scale,
        "spec": asdict(spec),
        "roles_back_to_decode": back,
        "reservations": {
            "phase 1": reservations([s for s in sampler.samples if s.t < t2_sampled]),
            "phase 2": phase2,
        },
        "clients": {
            "phase 1": clients(phase1.results, t1, phase1.in_flight),
            "phase 2 normal": norm,
        },
        "hogs": hogs(hogs_),
        "operator": moves,
        "targets": {
            "reserved <= 1.1 x capacity": peak_targets(phase2, 1.1),
            "every normal request ok": target(
                norm["requests"] > 0 and norm["ok"] == norm["requests"],
                f"{norm['ok']} ok of {norm['requests']} ({norm['outcomes']})",
            ),
            "normal TTFT p99 < 2 s": target(p99 is not None and p99 < 2.0, f"p99 {p99} s"),
        },
    }


async def run_shift(spec: ShiftSpec, *, workdir: Path | None = None) -> dict[str, Any]:
    shape = ClusterShape(
        workers=(("p0", "prefill"), ("d0", "decode"), ("b0", "both"), ("b1", "both")),
        decode_blocks=spec.decode_blocks,
        time_scale=spec.time_scale,
        log_level=spec.log_level,
        router={
            "roles": {"interval_s": 0.5, "settle_s": 1.0, "drain_deadline_s": spec.drain_deadline_s}
        },
    )
    return await bounded(
        shape,
        lambda cluster, session: _shift(spec, cluster, session),
        budget_s=spec.phase1_s + spec.phase2_s + 3 * spec.drain_deadline_s + 180.0,
        sessions=spec.phase1_clients + spec.normal_clients + 64,
        workdir=workdir,
    )


async def _flood(
    spec: FloodSpec, cluster: HostileCluster, session: aiohttp.ClientSession
) -> dict[str, Any]:
    sampler = StoreSampler(cluster.redis_url, cluster.key_prefix, cluster.shape.decode_ids)
    sampler.start()
    pool = request_pool("flood", spec.answer_tokens, spec.max_tokens, 32, hint=spec.hint)
    urls = cluster.router_urls
    flood = Looper("flood", session, urls, (pool,), (1.0,), spec.duration_s + 60.0)
    t0 = time.perf_counter()
    try:
        await flood.run(spec.clients, spec.duration_s, spec.ramp_s)
    finally:
        await sampler.stop()
    res = reservations(sampler.samples)
    late = sum(w["late_grown_past_capacity"] for w in res["workers"].values())
    grown = sum(w["grown_past_capacity"] for w in res["workers"].values())
    return {
        "scenario": "hint-flood",
        "time_scale": spec.time_scale,
        "spec": asdict(spec),
        "reservations": {"run": res},
        "clients": {"flood": clients(flood.results, t0, flood.in_flight)},
        "targets": {
            "reserved <= capacity": peak_targets(res, 1.0),
            "forced growth only on resident sequences": target(
                late == 0, f"{late} late reservations grown past capacity ({grown} in all)"
            ),
        },
    }


async def run_flood(spec: FloodSpec, *, workdir: Path | None = None) -> dict[str, Any]:
    estimator_args = {"fallback": "online_quantile"} if spec.estimator == "hint" else {}
    shape = ClusterShape(
        workers=(("p0", "prefill"), ("d0", "decode"), ("d1", "decode"), ("d2", "decode")),
        decode_blocks=spec.decode_blocks,
        time_scale=spec.time_scale,
        log_level=spec.log_level,
        router={"estimates": {"estimator": spec.estimator, "estimator_args": estimator_args}},
    )
    return await bounded(
        shape,
        lambda cluster, session: _flood(spec, cluster, session),
        budget_s=spec.duration_s + 180.0,
        sessions=spec.clients + 64,
        workdir=workdir,
    )


# name -> (its spec, its run): every field of the spec is a flag of the same name.
SCENARIOS: dict[str, tuple[type[Any], Callable[..., Coroutine[Any, Any, dict[str, Any]]]]] = {
    "shift": (ShiftSpec, run_shift),
    "hint-flood": (FloodSpec, run_flood),
    "poison": (PoisonSpec, run_poison),
    "queue": (QueueSpec, run_queue),
    "refused-rpm": (RefusedSpec, run_refused),
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m disagg_tools.loadgen.hostile",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="scenario", required=True)
    for name, (spec_type, _) in SCENARIOS.items():
        sp = sub.add_parser(name, help=f"the {name} scenario")
        for key, value in asdict(spec_type()).items():
            flag = "--" + key.replace("_", "-")
            sp.add_argument(flag, type=type(value), default=value, help=f"default {value}")
        sp.add_argument("--json", type=Path)
        sp.add_argument("--keep-logs", action="store_true")
    return p


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    args = {k: v for k, v in vars(ns).items() if k not in ("scenario", "json", "keep_logs")}
    workdir = Path(tempfile.mkdtemp(prefix="bench-hostile-")) if ns.keep_logs else None
    spec_type, run = SCENARIOS[ns.scenario]
    coro = run(spec_type(**args), workdir=workdir)
    return run_and_report(coro, format_report, workdir=workdir, json_path=ns.json)


if __name__ == "__main__":
    sys.exit(main())
