"""One measured load run of one target, and the summary over its rounds: the client's records
and the CPU the router, the workers and the client spent around them (sampled from /proc every
250 ms, so the saturation phase can take the middle half of a run). The router's CPU is the
scheduler's nanosecond run time (schedstat), not utime+stime: those count 10 ms ticks, and a short
rung at one stream can spend less than one tick, which read as 0 ms per request."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from disagg_tools.overhead.overhead_client import LoadSpec, StreamRecord, run_load
from disagg_tools.overhead.overhead_report import summarize
from disagg_tools.overhead.targets import Workers
from disagg_tools.procs import Child, own_cpu_s, process_tree_run_s, process_tree_user_sys_s

__all__ = ["CpuSampler", "Segment", "combine", "measure", "steady_tokens"]


class CpuSampler:
    """Samples (time, router CPU, workers CPU, client CPU) while a run goes on."""

    def __init__(self, router: Child | None, workers: Workers, period_s: float = 0.25) -> None:
        self.router = router
        self.workers = workers
        self.period_s = period_s
        self.samples: list[tuple[float, float, float, float]] = []
        self._task: asyncio.Task[None] | None = None
        # The router's (user, system) seconds over the whole run: where its CPU goes (ticks,
        # so only the run's total, not the samples).
        self.router_user_sys = (0.0, 0.0)
        self._user_sys_at_start = (0.0, 0.0)

    def sample(self) -> tuple[float, float, float, float]:
        s = (
            time.perf_counter(),
            process_tree_run_s(self.router.pid) if self.router else 0.0,
            self.workers.cpu_s(),
            own_cpu_s(),
        )
        self.samples.append(s)
        return s

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.period_s)
            self.sample()

    def _router_user_sys(self) -> tuple[float, float]:
        return process_tree_user_sys_s(self.router.pid) if self.router else (0.0, 0.0)

    def __enter__(self) -> CpuSampler:
        self._user_sys_at_start = self._router_user_sys()
        self.sample()
        self._task = asyncio.get_running_loop().create_task(self._loop())
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()
        self.sample()
        (u0, s0), (u1, s1) = self._user_sys_at_start, self._router_user_sys()
        self.router_user_sys = (u1 - u0, s1 - s0)

    def delta(self, t0: float | None = None, t1: float | None = None) -> tuple[float, ...]:
        """(seconds, router, workers, client) CPU between the samples nearest t0 and t1."""
        a = self.samples[0] if t0 is None else min(self.samples, key=lambda s: abs(s[0] - t0))
        b = self.samples[-1] if t1 is None else min(self.samples, key=lambda s: abs(s[0] - t1))
        return tuple(y - x for x, y in zip(a, b, strict=True))


def steady_tokens(records: list[StreamRecord], t0: float, t1: float) -> int:
    n = 0
    for r in records:
        for t, k in zip(r.reads, r.counts, strict=True):
            if t0 <= t < t1:
                n += k
    return n


@dataclass(slots=True)
class Segment:
    """One measured load run of one target: raw records and the CPU spent around them."""

    records: list[StreamRecord]
    secs: float
    window: float
    router_cpu: float
    worker_cpu: float
    client_cpu: float
    upstream: dict[str, int]
    loadavg: float
    steady: tuple[float, ...] = ()  # saturation: (secs, router, workers, client, tokens)
    router_user_sys: tuple[float, float] = (0.0, 0.0)  # the router's (user, system) seconds


async def measure(
    spec: LoadSpec,
    router: Child | None,
    workers: Workers,
    *,
    saturation: bool = False,
    load: Callable[[], Awaitable[tuple[list[StreamRecord], float, float]]] | None = None,
) -> Segment:
    """`spec` run closed loop (`run_load`), or `load` run instead (the open-loop arrivals of
    `disagg_tools.overhead.saturation`), and the CPU around it."""
    load_before = os.getloadavg()[0]
    before = await workers.counters()
    with CpuSampler(router, workers) as cpu:
        records, _, window = await (load() if load is not None else run_load(spec))
    after = await workers.counters()
    # Reading the counters opens one connection per worker: not the router's.
    upstream = {k: after[k] - before.get(k, 0) for k in after}
    upstream["prefill_connections"] -= 1
    upstream["decode_connections"] -= 1
    secs, router_cpu, worker_cpu, client_cpu = cpu.delta()
    seg = Segment(
        records,
        secs,
        window,
        router_cpu,
        worker_cpu,
        client_cpu,
        upstream,
        load_before,
        router_user_sys=cpu.router_user_sys,
    )
    if saturation:
        # The middle half of the run: every slot is streaming, none is ramping up or down.
        start = cpu.samples[0][0]
        t0 = start + 0.25 * secs
        d = cpu.delta(t0, start + 0.75 * secs)
        seg.steady = (*d, steady_tokens(records, t0, t0 + d[0]))
    return seg


def combine(
    name: str, spec: LoadSpec, segs: list[Segment], has_router: bool, saturation: bool = False
) -> dict[str, Any]:
    """One summary over the rounds of one (target, concurrency)."""
    records = [r for s in segs for r in s.records]
    secs = sum(s.secs for s in segs)
    out = summarize(
        records,
        max_tokens=spec.max_tokens,
        wall_s=secs,
        window_s=sum(s.window for s in segs),
        router_cpu_s=sum(s.router_cpu for s in segs) if has_router else None,
        client_cpu_s=sum(s.client_cpu for s in segs),
        worker_cpu_s=sum(s.worker_cpu for s in segs),
    )
    upstream: dict[str, int] = {}
    for s in segs:
        for k, v in s.upstream.items():
            upstream[k] = upstream.get(k, 0) + v
    out = {
        "target": name,
        "concurrency": spec.concurrency,
        "max_tokens": spec.max_tokens,
        "rounds": len(segs),
        "loadavg_1m": [round(s.loadavg, 2) for s in segs],
        "upstream": upstream,
        **out,
    }
    if has_router:
        user = sum(s.router_user_sys[0] for s in segs)
        system = sum(s.router_user_sys[1] for s in segs)
        # Which half of the router's CPU differs from a peer's: its own code (user) or the
        # system calls both make per token (docs/benchmarks-overhead.md, issue 36).
        out["router_kernel_share"] = round(system / (user + system), 3) if user + system else None
        out["router_cpu_s_per_1k_by_round"] = [
            round(s.router_cpu / t * 1000, 4) if (t := sum(r.tokens for r in s.records)) else None
            for s in segs
        ]
    if saturation:
        st = [sum(s.steady[i] for s in segs) for i in range(5)]
        s_secs, s_router, s_workers, s_client, tokens = st
        out.update(
            {
                "steady_s": round(s_secs, 3),
                "tokens_per_s": round(tokens / s_secs, 1) if s_secs > 0 else None,
                "router_cpu_util": round(s_router / s_secs, 3) if has_router and s_secs else None,
                "client_cpu_util": round(s_client / s_secs, 3) if s_secs > 0 else None,
                "worker_cpu_s": round(s_workers, 3),
                "wall_s": round(s_secs, 3),
                "tokens_per_router_cpu_s": round(tokens / s_router)
                if has_router and s_router
                else None,
                "cpu_s_per_1k_tokens": (
                    round(s_router / tokens * 1000, 4) if has_router and tokens else None
                ),
            }
        )
    return out
