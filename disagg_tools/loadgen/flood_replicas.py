"""The flood bench across router replicas (issue 33): where each tenant's requests land.

    python -m disagg_tools.loadgen.flood_replicas_cli --placement one,spread,split \
        --fairness vtc,fifo

Two router replicas (`serve --config`, one process each) on one private, password-protected
redis-server, in front of one simulated prefill and one simulated decode worker
(disagg_tools/sim: the toy model's text is known in advance, so every answer is checked token for
token, a preempted and resumed stream's too). The decode worker's room (`decode_blocks`) is one
the aggressor alone fills. Two tenants of weight 1, each with its key:

    victim     `victim_clients` clients, each sending its next request `victim_pause_s` after
               its answer ends (0: back to back)
    aggressor  `aggressor_clients` clients back to back; after a 429 a client waits its
               Retry-After (at most 2 s)

`placement` says which replica each client talks to (replica_of): `one` both tenants on replica
0; `spread` client i of each tenant on replica i mod 2; `split` the victim on replica 0, the
aggressor on replica 1. A run is one of `solo` (the victim alone, placed as in the flood),
`alone` (the aggressor alone) and `flood` (both). Each run has a cluster of its own (fresh
Redis, fresh fairness counters); every request is bounded by `deadline_s` and a client sends no
new request after `duration_s`, so a run ends by itself.

What a run returns (`RunResult`): every request's `loadclient.Result` by tenant, with its send
time from the run's start, and the routers' preemption counters over the run (summed over the
replicas); `placement_row` compares the runs (the numbers: disagg_tools/loadgen/
flood_replicas_report.py).
"""

from __future__ import annotations

import asyncio
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from disagg_tools.loadgen.flood_replicas_report import ratio, tenant_stats
from disagg_tools.loadgen.hostile_cluster import MODEL, HostileCluster
from disagg_tools.loadgen.hostile_run import router_metrics
from disagg_tools.loadgen.hostile_tenants import keyed, tenant_cluster
from disagg_tools.loadgen.loadclient import LoadRequest, Result, make_request, new_session, send

__all__ = [
    "PLACEMENTS",
    "RUN_KINDS",
    "PlacementSpec",
    "RunResult",
    "placement_row",
    "replica_of",
    "run_placement",
    "run_rows",
]

PLACEMENTS = ("one", "spread", "split")
RUN_KINDS = ("solo", "alone", "flood")
_PREEMPTIONS = "disagg_router_preemptions_total"
_STARTS = 3  # cluster starts tried for one run
_clock = time.perf_counter


@dataclass(frozen=True, slots=True)
class PlacementSpec:
    """One run's shape: the load, the cluster and the time bounds."""

    placement: str = "one"
    fairness: str = "vtc"
    victim_clients: int = 2
    victim_pause_s: float = 1.0  # 0: back to back
    aggressor_clients: int = 20
    prompt_tokens: int = 100
    # Every answer's length (max_tokens the same), the same for both tenants: a victim asking
    # for less than the aggressor would slip into the room the aggressor's next request does
    # not fit (the queue's backfill), whatever the order, and hide what the order does.
    victim_tokens: int = 128
    aggressor_tokens: int = 128
    decode_blocks: int = 120  # 8 answers at once (15 blocks each): the aggressor alone fills it
    duration_s: float = 60.0  # no new request after this
    warmup_s: float = 5.0  # requests sent before this are not measured
    max_wait_s: float = 30.0  # the router's admission.max_wait_s (its default)
    deadline_s: float = 120.0  # the client's bound on one request
    time_scale: float = 1.0
    log_level: str = "WARNING"

    def __post_init__(self) -> None:
        if self.placement not in PLACEMENTS:
            raise ValueError(f"placement must be one of {PLACEMENTS}, not {self.placement!r}")
        if self.warmup_s >= self.duration_s:
            raise ValueError("warmup_s must be shorter than duration_s")

    @property
    def victim_mode(self) -> str:
        return "back to back" if self.victim_pause_s <= 0 else f"{self.victim_pause_s:g} s pause"

    def router_settings(self) -> dict[str, Any]:
        """The replicas' settings beyond the cluster's (grouped names, router/config.py)."""
        return {
            "admission": {
                "mode": "queue",
                "max_wait_s": self.max_wait_s,
                "fairness": self.fairness,
            },
            # The answer is exactly max_tokens (the oracle header says so): reserve just that,
            # so the holds are honest and nothing is preempted for an estimate's error.
            "estimates": {"estimator": "max_tokens"},
        }


def replica_of(placement: str, tenant: str, client: int) -> int:
    """The replica (0 or 1) client `client` of `tenant` sends to."""
    if placement == "one":
        return 0
    if placement == "spread":
        return client % 2
    if placement == "split":
        return 0 if tenant == "victim" else 1
    raise ValueError(f"unknown placement {placement!r}")


@dataclass(slots=True)
class RunResult:
    kind: str  # solo | alone | flood
    spec: PlacementSpec
    results: dict[str, list[Result]] = field(default_factory=dict)  # tenant -> its requests
    t0: float = 0.0  # perf_counter at the run's start (Result.t_send - t0: the send time)
    preemptions: float = 0.0  # over both replicas, during the run
    router_counters: dict[str, float] = field(default_factory=dict)
    dead: list[str] = field(default_factory=list)  # processes that exited on their own
    elapsed_s: float = 0.0


def _pool(
    tenant: str, base: int, count: int, spec: PlacementSpec, tokens: int
) -> list[LoadRequest]:
    """`count` distinct streaming chat requests of `tenant`, each answer `tokens` long."""
    return [
        keyed(
            make_request(
                base + i,
                model=MODEL,
                prompt_tokens=spec.prompt_tokens,
                output_tokens=tokens,
                max_tokens=tokens,
                stream=True,
            ),
            tenant,
        )
        for i in range(count)
    ]


async def _client(
    session: aiohttp.ClientSession,
    url: str,
    pool: list[LoadRequest],
    pause_s: float,
    until: float,
    deadline_s: float,
    out: list[Result],
) -> None:
    """Requests from `pool` in turn until `until` (perf_counter), each after the previous one
    ended and `pause_s` passed; after a 429 its Retry-After (at most 2 s), after a failure
    0.2 s (a failing router is not spun on)."""
    i = 0
    while _clock() < until:
        res = await send(session, url, pool[i % len(pool)], deadline_s=deadline_s)
        i += 1
        out.append(res)
        if res.outcome == "shed":
            wait = max(pause_s, min(2.0, float(res.retry_after or 1)))
        elif res.failed:
            wait = max(pause_s, 0.2)
        else:
            wait = pause_s
        if wait > 0:
            await asyncio.sleep(max(0.0, min(wait, until - _clock())))


def _tenants(kind: str, spec: PlacementSpec) -> dict[str, tuple[int, float, int]]:
    """tenant -> (clients, pause between requests, answer tokens) for a run of `kind`."""
    victim = (spec.victim_clients, spec.victim_pause_s, spec.victim_tokens)
    aggressor = (spec.aggressor_clients, 0.0, spec.aggressor_tokens)
    return {
        "solo": {"victim": victim},
        "alone": {"aggressor": aggressor},
        "flood": {"victim": victim, "aggressor": aggressor},
    }[kind]


async def _traffic(cluster: HostileCluster, kind: str, spec: PlacementSpec, run: RunResult) -> None:
    load = _tenants(kind, spec)
    clients = sum(n for n, _, _ in load.values())
    async with new_session(clients + 8) as session:
        urls = cluster.router_urls
        before = await router_metrics(session, urls)
        run.t0 = _clock()
        until = run.t0 + spec.duration_s
        tasks = []
        for t_index, (tenant, (n, pause, tokens)) in enumerate(load.items()):
            pool = _pool(tenant, 7_000_000 + t_index * 100_000, max(4, 2 * n), spec, tokens)
            out: list[Result] = []
            run.results[tenant] = out
            for c in range(n):
                url = urls[replica_of(spec.placement, tenant, c)]
                mine = pool[c % len(pool) :] + pool[: c % len(pool)]  # clients out of step
                tasks.append(
                    asyncio.create_task(
                        _client(session, url, mine, pause, until, spec.deadline_s, out)
                    )
                )
        await asyncio.gather(*tasks)
        after = await router_metrics(session, urls)
    run.router_counters = {
        k: after[k] - before.get(k, 0.0) for k in sorted(after) if after[k] != before.get(k, 0.0)
    }
    run.preemptions = run.router_counters.get(_PREEMPTIONS, 0.0)


def _cluster(spec: PlacementSpec, workdir: Path) -> HostileCluster:
    shape = tenant_cluster(
        (("p0", "prefill"), ("d0", "decode")),
        [{"name": "victim", "weight": 1}, {"name": "aggressor", "weight": 1}],
        decode_blocks=spec.decode_blocks,
        time_scale=spec.time_scale,
        log_level=spec.log_level,
        router=spec.router_settings(),
    )
    return HostileCluster(shape, workdir)


async def run_placement(kind: str, spec: PlacementSpec, log_dir: Path | None = None) -> RunResult:
    """One run (`solo`, `alone` or `flood`) on a cluster of its own, stopped at the end."""
    if kind not in RUN_KINDS:
        raise ValueError(f"run kind must be one of {RUN_KINDS}, not {kind!r}")
    started = time.monotonic()
    run = RunResult(kind, spec)
    with tempfile.TemporaryDirectory(prefix="floodbench-") as tmp:
        workdir = Path(tmp) if log_dir is None else log_dir
        workdir.mkdir(parents=True, exist_ok=True)
        for attempt in range(_STARTS):
            cluster = _cluster(spec, workdir)
            try:
                # A process that dies starting (a free port taken by someone else between its
                # choice and the bind: the machine is shared), and a stranger answering on its
                # port would have the run measure the stranger: start again. One that lost its
                # port exits within the second after the bind.
                try:
                    await cluster.start()
                    await asyncio.sleep(1.0)
                    if cluster.dead():
                        raise RuntimeError(f"processes died while starting: {cluster.dead()}")
                except RuntimeError:
                    if attempt + 1 < _STARTS:
                        continue
                    raise
                # The whole run is bounded: the clients stop sending at duration_s and each
                # request at deadline_s; a minute more for the cluster's start and the scrapes.
                bound = spec.duration_s + spec.deadline_s + 60.0
                await asyncio.wait_for(_traffic(cluster, kind, spec, run), bound)
                run.dead = cluster.dead()
                break
            finally:
                cluster.stop()
    run.elapsed_s = time.monotonic() - started
    return run


def _solo_key(spec: PlacementSpec) -> tuple[Any, ...]:
    """What the victim's solo run depends on: which replica each of its clients talks to and
    its load (not the fairness: a tenant alone is served the same under any order)."""
    replicas = tuple(replica_of(spec.placement, "victim", c) for c in range(spec.victim_clients))
    return (replicas, spec.victim_clients, spec.victim_pause_s, spec.victim_tokens)


async def run_rows(
    specs: list[PlacementSpec], log_dir: Path | None = None
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Every spec's flood run, with the solo and alone runs it is compared with (each run
    once: a solo run serves every row whose victim lands the same way); the rows
    (flood_report.placement_row) and the baseline runs' figures, by name."""
    solos: dict[tuple[Any, ...], RunResult] = {}
    alone: RunResult | None = None
    rows: list[dict[str, Any]] = []
    baselines: dict[str, Any] = {}

    def note(run: RunResult, tenant: str) -> dict[str, Any]:
        s = run.spec
        stats = tenant_stats(run.results.get(tenant, []), run.t0, s.warmup_s, s.duration_s)
        stats["dead_processes"] = run.dead
        print(
            f"[floodbench] {run.kind} {s.fairness} {s.placement} victim {s.victim_mode}: "
            f"{tenant} {stats['ok_per_s']:.2f} ok/s, TTFT p99 {stats['ttft_p99_s']}, "
            f"{stats['outcomes']} ({run.elapsed_s:.0f} s){' DEAD: ' if run.dead else ''}"
            f"{', '.join(run.dead)}",
            file=sys.stderr,
            flush=True,
        )
        return stats

    for spec in specs:
        key = _solo_key(spec)
        if key not in solos:
            solos[key] = await run_placement("solo", spec, log_dir)
            name = f"victim solo, {spec.placement}, {spec.victim_mode}"
            baselines[name] = note(solos[key], "victim")
        if alone is None:
            alone = await run_placement("alone", spec, log_dir)
            baselines[f"aggressor alone, {spec.placement}"] = note(alone, "aggressor")
        flood = await run_placement("flood", spec, log_dir)
        note(flood, "victim")
        rows.append(placement_row(flood, solos[key], alone))
    return rows, baselines


def _stats(run: RunResult, tenant: str) -> dict[str, Any]:
    spec = run.spec
    return tenant_stats(run.results.get(tenant, []), run.t0, spec.warmup_s, spec.duration_s)


def placement_row(flood: RunResult, solo: RunResult, alone: RunResult) -> dict[str, Any]:
    """One row of the table: the flood run  against the victim's solo
    run and the aggressor's run alone, and the issue's targets met or not:

        victim_goodput     victim answers/s >= 0.95 × solo
        victim_ttft_p99    victim TTFT p99 <= 1.5 × solo + 150 ms
        work_conserving    both tenants' output tokens/s >= 0.95 × the aggressor's alone
        aggressor_no_5xx   no 5xx to either tenant
        honest_429         every 429 carried a Retry-After
        texts_exact        no answer's text or end wrong (a preempted and resumed one's included)
    """
    v, a = _stats(flood, "victim"), _stats(flood, "aggressor")
    vs, aa = _stats(solo, "victim"), _stats(alone, "aggressor")
    requests = v["requests"] + a["requests"]
    ok_ratio = ratio(v["ok_per_s"], vs["ok_per_s"])
    p99, solo_p99 = v["ttft_p99_s"], vs["ttft_p99_s"]
    p99_bound = None if solo_p99 is None else 1.5 * solo_p99 + 0.150
    work = ratio(v["tokens_per_s"] + a["tokens_per_s"], aa["tokens_per_s"])
    spec = flood.spec
    targets = {
        "victim_goodput": ok_ratio is not None and ok_ratio >= 0.95,
        "victim_ttft_p99": p99 is not None and p99_bound is not None and p99 <= p99_bound,
        "work_conserving": work is not None and work >= 0.95,
        "aggressor_no_5xx": v["http_5xx"] == 0 and a["http_5xx"] == 0,
        "honest_429": all(s["rejected_429"] == s["rejected_429_with_retry_after"] for s in (v, a)),
        "texts_exact": v["not_exact"] == 0 and a["not_exact"] == 0,
    }
    return {
        "placement": spec.placement,
        "fairness": spec.fairness,
        "victim_mode": spec.victim_mode,
        "victim": v,
        "aggressor": a,
        "victim_solo": vs,
        "aggressor_alone": aa,
        "victim_ok_ratio": ok_ratio,
        "victim_ttft_p50_ratio": ratio(v["ttft_p50_s"], vs["ttft_p50_s"]),
        "victim_ttft_p99_ratio": ratio(p99, solo_p99),
        "victim_ttft_p99_bound_s": p99_bound,
        "work_ratio": work,
        "preemptions": flood.preemptions,
        "preemptions_per_1k": 1000.0 * flood.preemptions / max(1, requests),
        "dead_processes": flood.dead,
        "targets": targets,
    }
