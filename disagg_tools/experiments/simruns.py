"""The simulator experiments behind docs/benchmarks.md: one run of a case, goodput searches
over policies, admission modes at fixed overload, and the simulator's speed vs cluster size.

Runs go through `disagg_tools.simcluster.engine.simulate` (the experiments sit above the
simulator: see the layer table in tests/architecture/test_layering.py); searches use
`disagg_tools.goodput`,
the replay bench's search.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from typing import Any

from disagg_tools.experiments.specs import (
    CASES,
    SHAPES,
    TRACE_DIR,
    TRACES,
    CaseSpec,
    ShapeSpec,
    TraceSpec,
    WarmEstimator,
)
from disagg_tools.goodput import goodput
from disagg_tools.simcluster.engine import simulate
from disagg_tools.simcluster.metrics import SimResult
from disagg_tools.simcluster.simulate_cli import parse_case
from disagg_tools.traces import TraceRequest, load_trace
from policies.registry import load_estimator, load_policy

__all__ = ["admission_comparison", "policy_comparison", "run_case", "scaling", "simulate_case"]

# -- one simulation -------------------------------------------------------------------------------


def run_case(
    requests: Sequence[TraceRequest],
    shape: ShapeSpec,
    case: CaseSpec,
    rate_scale: float,
    trace: TraceSpec,
    *,
    seed: int = 0,
    config_overrides: dict[str, Any] | None = None,
    warmup: Sequence[TraceRequest] = (),
) -> dict[str, Any]:
    """One simulator run; the summary row (timing included). `warmup` requests pre-fill the
    online estimator's statistics (not replayed)."""
    cpu0 = time.process_time()
    res = simulate_case(
        requests,
        shape,
        case,
        rate_scale,
        trace,
        seed=seed,
        config_overrides=config_overrides,
        warmup=warmup,
    )
    cpu = time.process_time() - cpu0
    # CPU seconds beside wall seconds: on a shared machine the wall clock also counts the
    # time other processes held the core.
    return {
        "case": case.label,
        "rate_scale": rate_scale,
        **res.summary(timing=True),
        "cpu_s": cpu,
        "events_per_cpu_s": res.events / cpu if cpu > 0 else 0.0,
    }


def simulate_case(
    requests: Sequence[TraceRequest],
    shape: ShapeSpec,
    case: CaseSpec,
    rate_scale: float,
    trace: TraceSpec,
    *,
    seed: int = 0,
    config_overrides: dict[str, Any] | None = None,
    warmup: Sequence[TraceRequest] = (),
) -> SimResult:
    """One simulator run: the `disagg_tools.simcluster.metrics.SimResult`."""
    c = parse_case(case.case)
    overrides = {**trace.config, **(config_overrides or {})}
    cfg = shape.config(reserve=c.reserve, on_full=c.on_full, admission=c.admission, **overrides)
    policy = load_policy(c.policy, dict(case.policy_args))
    est = load_estimator(case.estimator, dict(case.estimator_args)) if c.reserve else None
    if est is not None and est.name == "online_quantile" and warmup:
        est = WarmEstimator.from_requests(est, warmup, cfg.model, cfg.max_tokens)
    return simulate(
        requests,
        cfg,
        policy,
        est,
        seed=seed,
        slo_ttft_s=trace.slo_ttft_s,
        slo_tpot_s=trace.slo_tpot_s,
        rate_scale=rate_scale,
    )


def _base_rps(requests: Sequence[TraceRequest]) -> float:
    span = max(r.arrival_s for r in requests) - min(r.arrival_s for r in requests)
    return len(requests) / span if span > 0 else 0.0


def _goodput_task(args: tuple[str, str, CaseSpec, int | None, float, float]) -> dict[str, Any]:
    trace_name, shape_name, case, limit, start, precision = args
    trace, shape = TRACES[trace_name], SHAPES[shape_name]
    requests = trace.load(limit)
    warmup = trace.warmup()
    t0 = time.perf_counter()
    rows: dict[float, dict[str, Any]] = {}

    def run_at(scale: float) -> float:
        row = run_case(requests, shape, case, scale, trace, warmup=warmup)
        rows[scale] = row
        return float(row["slo_attainment"])

    scale, points = goodput(run_at, start=start, precision=precision)
    at = rows.get(scale)
    return {
        "trace": trace_name,
        "shape": shape_name,
        "case": case.label,
        "baseline": case.baseline,
        "requests": len(requests),
        "base_rps": _base_rps(requests),
        "goodput_scale": scale,
        "goodput_rps": scale * _base_rps(requests),
        "points": points,
        "at_goodput": at,
        "search_wall_s": time.perf_counter() - t0,
    }


def _at_rate_task(args: tuple[str, str, CaseSpec, int | None, float]) -> dict[str, Any]:
    trace_name, shape_name, case, limit, scale = args
    trace, shape = TRACES[trace_name], SHAPES[shape_name]
    requests = trace.load(limit)
    row = run_case(requests, shape, case, scale, trace, warmup=trace.warmup())
    return {"trace": trace_name, "shape": shape_name, **row}


def _pool(jobs: int) -> ProcessPoolExecutor:
    return ProcessPoolExecutor(max_workers=jobs, initializer=_nice)


def _nice() -> None:
    try:
        os.nice(10)
    except OSError:
        pass


def policy_comparison(
    traces: Sequence[str],
    shapes: Sequence[str],
    cases: Sequence[CaseSpec] = CASES,
    *,
    limit: int | None = None,
    precision: float = 1.05,
    jobs: int = 2,
) -> dict[str, Any]:
    """Goodput of every case on every (trace, shape); then every case at one common load (the
    best baseline's goodput) for the latency/memory columns."""
    tasks = [(t, s, c, limit, 1.0, precision) for t in traces for s in shapes for c in cases]
    with _pool(jobs) as pool:
        results = list(pool.map(_goodput_task, tasks))
    common: list[tuple[str, str, CaseSpec, int | None, float]] = []
    for t in traces:
        for s in shapes:
            base = [r for r in results if r["trace"] == t and r["shape"] == s and r["baseline"]]
            best = max((r["goodput_scale"] for r in base), default=1.0) or 1.0
            common += [(t, s, c, limit, best) for c in cases]
    with _pool(jobs) as pool:
        at_common = list(pool.map(_at_rate_task, common))
    return {"goodput": results, "at_common_rate": at_common}


# -- admission -------------------------------------------------------------------------------------


def admission_comparison(
    runs: Sequence[tuple[str, str, float]] = (
        ("mooncake", "8b-4p4d-l40s", 3.0),
        ("mooncake", "8b-4p4d-l40s", 5.0),
        ("conv", "8b-4p4d-l40s", 30.0),
    ),
    *,
    limit: int | None = None,
    jobs: int = 2,
) -> list[dict[str, Any]]:
    """Instantaneous vs predictive admission (two_sided + online, reserving) on overloaded
    replays: rejections, as Mooncake measured them. `runs` = (trace, shape, rate scale)."""
    cases = (
        CaseSpec("instant", "two_sided"),
        CaseSpec("predictive", "two_sided/predictive"),
    )
    tasks = [(t, s, c, limit, scale) for t, s, scale in runs for c in cases]
    with _pool(jobs) as pool:
        return list(pool.map(_at_rate_task, tasks))


# -- scaling ---------------------------------------------------------------------------------------


def scaling(
    sizes: Sequence[int] = (16, 64, 256, 1000),
    *,
    limit: int | None = None,
    rate_scale: float = 1.0,
    per_worker_load: bool = False,
) -> list[dict[str, Any]]:
    """Wall time and events/s of the simulator vs cluster size (P:D = 1:3) on the Azure conv
    trace, two_sided + online_quantile. `per_worker_load` scales the rate with the cluster
    (rate_scale x size/16) instead of replaying the same hour on every size."""
    trace = TRACES["conv"]
    requests = load_trace(TRACE_DIR / trace.file, limit=limit)
    out = []
    for n in sizes:
        n_p = max(1, n // 4)
        shape = ShapeSpec(f"{n}w", n_p, n - n_p)
        scale = rate_scale * (n / 16 if per_worker_load else 1.0)
        t0 = time.perf_counter()
        row = run_case(requests, shape, CaseSpec("two_sided+online", "two_sided"), scale, trace)
        row.update(workers=n, prefill=n_p, decode=n - n_p, total_wall_s=time.perf_counter() - t0)
        out.append(row)
        print(
            f"  {n} workers: {row['wall_s']:.1f} s wall, {row['cpu_s']:.1f} s CPU, "
            f"{row['events']:,} events, {row['events_per_cpu_s']:,.0f} events/CPU-s",
            flush=True,
        )
    return out
