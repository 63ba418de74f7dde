"""Issue 31's queue lock-out and refused-request reproductions as bench scenarios.

    python -m disagg_tools.loadgen.hostile queue        [--fairness vtc] [--time-scale 1] ...
    python -m disagg_tools.loadgen.hostile refused-rpm  [--rpm 6] ...

Both: two router replicas on a private, password-protected redis-server, one prefill and one
decode worker (simulated, 3,000 blocks), tenants with keys.

**queue**: tenants `a` and `b` of equal weight, `admission.max_waiters` 1,024. `a` keeps 1,100
requests open on replica 0 (each client sends its next as soon as one ends; after a 429 it
waits the Retry-After, at most 2 s), answers of 1,000 tokens: ~43 fit on the decode worker at
once, the rest wait, and the queue fills (the queue and its shares are per replica: the
flood is where it hurts). Once replica 0's queue holds `max_waiters` and `a` has been refused
for it, `b` sends 10 requests to the same replica at once. Target: every one of b's 10 served
(the tenant under its share gets all its requests served), every text exact; a's counts
reported by outcome.

**refused-rpm**: tenant `r` with requests_per_minute 6. The only prefill worker is drained
through the admin API (`force`: the guard rail refuses to empty a pool otherwise), both
replicas see it; `r` sends 5 requests (503: no worker in rotation) over both replicas; the
worker is undrained, both replicas see it back; `r` sends 6 requests. Target: none of the 6
is a 429 (a refused request gives its tenant's request back), all within a minute of the
first 503 (else the rate's window would have let them through anyway: no verdict); and a 7th
is a 429 (the rate is enforced at all).
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import aiohttp

from disagg_tools.loadgen.hostile_clients import Looper
from disagg_tools.loadgen.hostile_cluster import MODEL, HostileCluster
from disagg_tools.loadgen.hostile_report import clients
from disagg_tools.loadgen.hostile_run import bounded, target
from disagg_tools.loadgen.hostile_tenants import (
    admin_post,
    keyed,
    settle,
    tenant_cluster,
    worker_views,
)
from disagg_tools.loadgen.loadclient import LoadRequest, Result, make_request, send
from disagg_tools.loadgen.probes import metric_sums

__all__ = ["QueueSpec", "RefusedSpec", "run_queue", "run_refused"]

PROMPT_TOKENS = 100
_WAITING = "disagg_router_admission_waiting"


@dataclass(frozen=True, slots=True)
class QueueSpec:
    flood_requests: int = 1100  # a's open requests
    max_waiters: int = 1024
    b_requests: int = 10
    answer_tokens: int = 1000  # of both tenants' answers (max_tokens the same)
    fairness: str = "vtc"
    decode_blocks: int = 3000
    fill_timeout_s: float = 180.0  # for replica 0's queue to fill
    wait_s: float = 300.0  # b's deadline per request
    time_scale: float = 1.0
    log_level: str = "WARNING"


@dataclass(frozen=True, slots=True)
class RefusedSpec:
    rpm: int = 6  # r's requests_per_minute
    refused: int = 5  # requests sent while no prefill worker is in rotation
    after: int = 6  # requests sent once it is back (0: rpm)
    answer_tokens: int = 16
    time_scale: float = 1.0
    log_level: str = "WARNING"


def _pool(tenant: str, base: int, count: int, tokens: int) -> list[LoadRequest]:
    return [
        keyed(
            make_request(
                base + i,
                model=MODEL,
                prompt_tokens=PROMPT_TOKENS,
                output_tokens=tokens,
                max_tokens=tokens,
                stream=True,
            ),
            tenant,
        )
        for i in range(count)
    ]


async def _waiting(session: aiohttp.ClientSession, url: str) -> float:
    try:
        return (await metric_sums(session, url)).get(_WAITING, 0.0)
    except (aiohttp.ClientError, TimeoutError):
        return -1.0


async def _queue(
    spec: QueueSpec, cluster: HostileCluster, session: aiohttp.ClientSession
) -> dict[str, Any]:
    url = cluster.router_urls[0]
    a_pool = _pool("a", 9_000_000, 64, spec.answer_tokens)
    flood = Looper("a", session, [url], (a_pool,), (1.0,), deadline_s=spec.wait_s + 60.0)
    t0 = time.perf_counter()
    flood_task = asyncio.create_task(flood.run(spec.flood_requests, 24 * 3600.0))
    peak_waiting = 0.0
    deadline = time.monotonic() + spec.fill_timeout_s
    full = False
    while time.monotonic() < deadline and not flood_task.done():
        waiting = await _waiting(session, url)
        peak_waiting = max(peak_waiting, waiting)
        if waiting >= spec.max_waiters and any(r.status == 429 for r in flood.results):
            full = True
            break
        await asyncio.sleep(0.5)
    t_fill = time.perf_counter() - t0
    b_results: list[Result] = []
    if full:
        b_pool = _pool("b", 9_500_000, spec.b_requests, spec.answer_tokens)
        b_results = list(
            await asyncio.gather(*(send(session, url, r, deadline_s=spec.wait_s) for r in b_pool))
        )
        peak_waiting = max(peak_waiting, await _waiting(session, url))
    flood.stop.set()
    await flood_task
    left = await settle(cluster, ["a", "b"], timeout_s=60.0)
    b_ok = sum(r.outcome == "ok" for r in b_results)
    return {
        "scenario": "queue",
        "time_scale": spec.time_scale,
        "spec": asdict(spec),
        "reservations": {},
        "clients": {"a (flood)": clients(flood.results, t0, flood.in_flight)},
        "extra": {
            "queue": {
                "filled": full,
                "fill_s": round(t_fill, 1),
                "peak_waiting_replica0": peak_waiting,
            },
            "b": {
                "sent": len(b_results),
                "ok": b_ok,
                "outcomes": dict(Counter(r.outcome for r in b_results)),
                "seconds_max": round(max((r.t_end - r.t_send for r in b_results), default=0), 1),
                "details": [r.detail for r in b_results if r.outcome != "ok"][:3],
            },
            "left in store": left,
        },
        "targets": {
            "the queue filled (else nothing was tested)": target(
                full, f"peak {peak_waiting:.0f} waiting of {spec.max_waiters} at +{t_fill:.0f} s"
            ),
            "b, under its share, gets all its requests served": target(
                full and b_ok == spec.b_requests, f"{b_ok} of {spec.b_requests} served exactly"
            ),
        },
    }


async def run_queue(spec: QueueSpec, *, workdir: Path | None = None) -> dict[str, Any]:
    shape = tenant_cluster(
        (("p0", "prefill"), ("d0", "decode")),
        [{"name": "a", "weight": 1.0}, {"name": "b", "weight": 1.0}],
        decode_blocks=spec.decode_blocks,
        time_scale=spec.time_scale,
        log_level=spec.log_level,
        router={
            "admission": {"fairness": spec.fairness, "max_waiters": spec.max_waiters},
            # every request reserves its whole answer: no overrun
            "estimates": {"estimator": "max_tokens"},
        },
    )
    return await bounded(
        shape,
        lambda cluster, session: _queue(spec, cluster, session),
        budget_s=spec.fill_timeout_s + spec.wait_s + 240.0,
        sessions=spec.flood_requests + spec.b_requests + 64,
        workdir=workdir,
    )


async def _until_drained(
    session: aiohttp.ClientSession, cluster: HostileCluster, drained: bool, timeout_s: float = 30.0
) -> bool:
    """Both replicas see p0 drained (or back: undrained and healthy)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        views = await worker_views(session, cluster, "p0")
        if all(v.get("drained") is drained and (drained or v.get("healthy")) for v in views):
            return True
        await asyncio.sleep(0.2)
    return False


async def _refused(
    spec: RefusedSpec, cluster: HostileCluster, session: aiohttp.ClientSession
) -> dict[str, Any]:
    urls = cluster.router_urls
    after = spec.after or spec.rpm
    pool = _pool("r", 9_800_000, spec.refused + after + 1, spec.answer_tokens)
    status, body = await admin_post(session, urls[0], "/admin/workers/p0/drain", {"force": True})
    if status != 200:
        raise RuntimeError(f"draining p0 answered {status}: {body}")
    if not await _until_drained(session, cluster, True):
        raise RuntimeError("a replica never saw p0 drained")
    t0 = time.perf_counter()
    refused = [
        await send(session, urls[i % len(urls)], pool[i], deadline_s=120.0)
        for i in range(spec.refused)
    ]
    status, body = await admin_post(session, urls[0], "/admin/workers/p0/undrain")
    if status != 200 or not await _until_drained(session, cluster, False):
        raise RuntimeError(f"p0 never came back in rotation ({status}: {body})")
    later = [
        await send(session, urls[i % len(urls)], pool[spec.refused + i], deadline_s=120.0)
        for i in range(after)
    ]
    elapsed = time.perf_counter() - t0
    # One more than the rate allows: a 429, or the rate was never enforced (nothing tested).
    over = await send(session, urls[0], pool[-1], deadline_s=120.0) if after >= spec.rpm else None
    left = await settle(cluster, ["r"])
    unavailable = sum(r.status == 503 for r in refused)
    shed = sum(r.status == 429 for r in later)
    ok = sum(r.outcome == "ok" for r in later)
    return {
        "scenario": "refused-rpm",
        "time_scale": spec.time_scale,
        "spec": asdict(spec),
        "reservations": {},
        "clients": {
            "r, p0 drained": clients(refused, t0),
            "r, p0 back": clients(later, t0),
        },
        "expected_5xx": unavailable,
        "extra": {
            "503s": f"{unavailable} of {spec.refused}, seconds each "
            f"{[round(r.t_end - r.t_send, 2) for r in refused]}",
            "then": f"{ok} ok, {shed} x 429 of {after} (rpm {spec.rpm}); "
            f"{elapsed:.1f} s from the first 503 to the last answer",
            "429 details": [r.detail for r in later if r.status == 429][:2],
            "left in store": left,
        },
        "targets": {
            "every request sent while no prefill worker was in rotation got a 503": target(
                unavailable == spec.refused, f"{[r.status for r in refused]}"
            ),
            "the rate is enforced: one more request is a 429": target(
                over is not None and over.status == 429,
                "not sent (--after below --rpm)"
                if over is None
                else f"{over.status}: {over.detail[:80]}",
            ),
            "the 503s used up none of the tenant's rate": target(
                shed == 0 and ok == after and elapsed < 60.0,
                f"{shed} x 429, {ok} ok of {after}, within {elapsed:.1f} s (< 60 s needed)",
            ),
        },
    }


async def run_refused(spec: RefusedSpec, *, workdir: Path | None = None) -> dict[str, Any]:
    shape = tenant_cluster(
        (("p0", "prefill"), ("d0", "decode")),
        [{"name": "r", "requests_per_minute": spec.rpm}],
        decode_blocks=3000,
        time_scale=spec.time_scale,
        log_level=spec.log_level,
        router={"loops": {"registry_refresh_s": 0.2}},
    )
    return await bounded(
        shape,
        lambda cluster, session: _refused(spec, cluster, session),
        budget_s=600.0,
        sessions=16,
        workdir=workdir,
    )
