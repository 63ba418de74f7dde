"""Scripted experiments behind docs/benchmarks.md: every table there comes from one command here.

    python -m bench.experiments policies   [--traces conv,code,mooncake] [--shapes 8b-2p6d,70b-4p4d]
    python -m bench.experiments admission
    python -m bench.experiments scaling    [--sizes 16,64,256,1000]
    python -m bench.experiments validate   [--requests 300 --time-scale 4]
    python -m bench.experiments all        (the four above, then the Markdown tables)

Each prints Markdown tables and writes JSON (and PNG plots) under `--out` (default
`bench-results/`). `--quick` shrinks every run to a smoke test (tests/test_bench_experiments.py).

The simulator (`sim`) and the live cluster (`router.localcluster`) are imported inside the
functions that need them: `bench` is a client and imports neither at module import time
(tests/test_layering.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench.traces import TraceRequest, load_trace

__all__ = [
    "TRACES",
    "SHAPES",
    "CASES",
    "TraceSpec",
    "ShapeSpec",
    "CaseSpec",
    "goodput",
    "policy_comparison",
    "admission_comparison",
    "scaling",
    "validate",
    "calibrate",
    "live_mirror",
    "main",
]

_DEFAULT_TRACES = Path(__file__).resolve().parents[2] / "shared" / "traces"
TRACE_DIR = Path(os.environ.get("DISAGG_TRACES", _DEFAULT_TRACES))


@dataclass(frozen=True, slots=True)
class TraceSpec:
    """A trace slice and the SLOs it is judged by (justified in docs/benchmarks.md)."""

    name: str
    file: str
    limit: int | None
    slo_ttft_s: float
    slo_tpot_s: float
    # The slice starts at row `start`; the rows before it warm the output-length statistics,
    # as a long-running router's shared store would be warm (0 = start cold).
    start: int = 0
    # ClusterConfig overrides every run of this trace gets (e.g. a prefix cache for Mooncake).
    config: dict[str, Any] = field(default_factory=dict)

    def load(self, limit: int | None = None) -> list[TraceRequest]:
        return load_trace(TRACE_DIR / self.file, limit=limit or self.limit, start=self.start)

    def warmup(self) -> list[TraceRequest]:
        return load_trace(TRACE_DIR / self.file, limit=self.start) if self.start else []


@dataclass(frozen=True, slots=True)
class ShapeSpec:
    name: str
    n_prefill: int
    n_decode: int
    model: str = "llama-3-8b"
    gpu: str = "h100"
    tp_size: int | None = None
    capacity_blocks: int | None = None
    decode_gpu: str | None = None
    note: str = ""

    def config(self, **kw: Any) -> Any:
        from sim.cluster_config import ClusterConfig

        return ClusterConfig.homogeneous(
            self.n_prefill, self.n_decode, self.model, self.gpu,
            tp_size=self.tp_size, capacity_blocks=self.capacity_blocks,
            decode_gpu=self.decode_gpu, **kw,
        )  # fmt: skip


@dataclass(frozen=True, slots=True)
class CaseSpec:
    """A policy run the way its router runs it. `case` is `sim.cluster_cli.parse_case` syntax."""

    label: str
    case: str
    estimator: str = "online_quantile"
    policy_args: dict[str, Any] = field(default_factory=dict)
    estimator_args: dict[str, Any] = field(default_factory=dict)
    baseline: bool = False


TRACES: dict[str, TraceSpec] = {
    # Chat: a person reads as it streams; 2 s to start, 10 tokens/s is reading speed.
    "conv": TraceSpec("conv", "AzureLLMInferenceTrace_conv.csv", 3000, 2.0, 0.1, 2000),
    # Code completion: an editor waits for a short answer (median 13 tokens): tighter TTFT.
    "code": TraceSpec("code", "AzureLLMInferenceTrace_code.csv", 3000, 1.0, 0.1, 2000),
    # Long context (mean 15 K, p99 66 K prompt tokens): the p99 prompt alone prefills in 4.5 s
    # (8B) / 7.6 s (70B) on an idle GPU, so TTFT must be looser.
    # Mooncake's trace exists to exercise prefix caching: each prefill worker keeps 2,000
    # 512-token blocks (~1 M tokens, a DRAM tier as in Mooncake's pool).
    "mooncake": TraceSpec("mooncake", "mooncake_synthetic_trace.jsonl", 1500, 10.0, 0.1, 1000,
                          {"prefix_cache_blocks": 2000}),
}

SHAPES: dict[str, ShapeSpec] = {
    "8b-2p6d": ShapeSpec("8b-2p6d", 2, 6, "llama-3-8b", note="8B, 2P:6D H100: ~400 K KV tokens "
                         "per decode GPU, decode memory does not bind"),
    "70b-4p4d": ShapeSpec("70b-4p4d", 4, 4, "llama-3-70b", tp_size=4, note="70B TP4, 4P:4D "
                          "H100 (32 GPUs): 320 KiB/token, ~400 K KV tokens per decode worker"),
    "8b-4p4d-l40s": ShapeSpec("8b-4p4d-l40s", 4, 4, "llama-3-8b", decode_gpu="l40s",
                              note="8B, 4 H100 prefill : 4 L40S decode (48 GB): ~190 K KV "
                              "tokens per decode GPU, decode memory binds on long contexts"),
}

CASES: tuple[CaseSpec, ...] = (
    CaseSpec("random", "random/noreserve", baseline=True),
    CaseSpec("round_robin", "round_robin/noreserve", baseline=True),
    CaseSpec("least_loaded", "least_loaded/noreserve", baseline=True),
    CaseSpec("power_of_two", "power_of_two/noreserve", baseline=True),
    CaseSpec("least_loaded refuse", "least_loaded/noreserve/refuse", baseline=True),
    CaseSpec("two_sided+online", "two_sided"),
    CaseSpec("two_sided+oracle", "two_sided", estimator="oracle"),
)

# The investigation of docs/benchmarks.md: reservation quantile and admission, same policy.
VARIANTS: tuple[CaseSpec, ...] = (
    CaseSpec("two_sided+online q0.5", "two_sided", estimator_args={"quantile": 0.5}),
    CaseSpec("two_sided+online q0.7", "two_sided", estimator_args={"quantile": 0.7}),
    CaseSpec("two_sided+online predictive", "two_sided/predictive"),
    CaseSpec("two_sided+online q0.7 predictive", "two_sided/predictive",
             estimator_args={"quantile": 0.7}),
    CaseSpec("two_sided+online ttft-gate", "bench.experiments:TTFTGatedTwoSided"),
    CaseSpec("two_sided+online ttft-gate q0.7 predictive",
             "bench.experiments:TTFTGatedTwoSided/predictive", estimator_args={"quantile": 0.7}),
)


class WarmEstimator:
    """An estimator whose statistics start from earlier traffic (`warm`: class key -> bucket ->
    count) instead of empty, as a router with a shared, long-lived store would."""

    def __init__(self, inner: Any, warm: dict[str, dict[int, int]]) -> None:
        self.inner = inner
        self.name = inner.name
        self.warm = warm

    def class_keys(self, request: Any) -> tuple[str, ...]:
        return tuple(self.inner.class_keys(request))

    def estimate(self, request: Any, histograms: Any) -> Any:
        merged = {}
        for key in self.class_keys(request):
            h = dict(self.warm.get(key, {}))
            for b, c in histograms.get(key, {}).items():
                h[b] = h.get(b, 0) + c
            merged[key] = h
        return self.inner.estimate(request, merged)

    def bucket_of(self, n: int) -> int:
        return int(self.inner.bucket_of(n))

    @classmethod
    def from_requests(cls, inner: Any, warmup: Sequence[TraceRequest], model: str,
                      max_tokens: int) -> WarmEstimator:  # fmt: skip
        from policies.base import RequestInfo

        warm: dict[str, dict[int, int]] = {}
        for r in warmup:
            info = RequestInfo(str(r.index), model, max(1, r.prompt_tokens), max_tokens)
            b = inner.bucket_of(max(1, min(r.output_tokens, max_tokens)))
            for key in inner.class_keys(info):
                h = warm.setdefault(key, {})
                h[b] = h.get(b, 0) + 1
        return cls(inner, warm)


class TTFTGatedTwoSided:
    """EXPERIMENT (not a shipped policy): two_sided, but candidates whose predicted TTFT is over
    the request's TTFT SLO (× `slack`) are dropped, and a request with none left is rejected
    (it waits in the admission queue and is retried until its deadline). Sheds requests that
    would miss anyway instead of letting them lengthen the prefill queues for everyone."""

    name = "two_sided_ttft_gate"

    def __init__(self, slack: float = 1.0, **kwargs: Any) -> None:
        from policies.two_sided import TwoSidedPolicy

        self.inner = TwoSidedPolicy(**kwargs)
        self.slack = slack

    def place(self, request: Any, view: Any) -> Any:
        from policies.base import Placement, Rejection

        decision = self.inner.place(request, view)
        if not isinstance(decision, Placement) or request.slo_ttft_s is None:
            return decision
        limit = request.slo_ttft_s * self.slack
        kept = tuple(c for c in decision.candidates if c.predicted_ttft_s <= limit)
        if kept:
            return Placement(kept)
        best = min(c.predicted_ttft_s for c in decision.candidates)
        return Rejection(f"predicted TTFT {best:.2f} s over the SLO", 0.5)


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
    res = _simulate(requests, shape, case, rate_scale, trace, seed=seed,
                    config_overrides=config_overrides, warmup=warmup)  # fmt: skip
    cpu = time.process_time() - cpu0
    # CPU seconds beside wall seconds: on a shared machine the wall clock also counts the
    # time other processes held the core.
    return {"case": case.label, "rate_scale": rate_scale, **res.summary(timing=True),
            "cpu_s": cpu, "events_per_cpu_s": res.events / cpu if cpu > 0 else 0.0}  # fmt: skip


def _simulate(
    requests: Sequence[TraceRequest],
    shape: ShapeSpec,
    case: CaseSpec,
    rate_scale: float,
    trace: TraceSpec,
    *,
    seed: int = 0,
    config_overrides: dict[str, Any] | None = None,
    warmup: Sequence[TraceRequest] = (),
) -> Any:
    """One simulator run: the `sim.cluster_metrics.SimResult`."""
    from policies.registry import load_estimator, load_policy
    from sim.cluster import simulate
    from sim.cluster_cli import parse_case

    c = parse_case(case.case)
    overrides = {**trace.config, **(config_overrides or {})}
    cfg = shape.config(reserve=c.reserve, on_full=c.on_full, admission=c.admission, **overrides)
    policy = load_policy(c.policy, dict(case.policy_args))
    est = load_estimator(case.estimator, dict(case.estimator_args)) if c.reserve else None
    if est is not None and est.name == "online_quantile" and warmup:
        est = WarmEstimator.from_requests(est, warmup, cfg.model, cfg.max_tokens)
    return simulate(
        requests, cfg, policy, est, seed=seed, slo_ttft_s=trace.slo_ttft_s,
        slo_tpot_s=trace.slo_tpot_s, rate_scale=rate_scale,
    )  # fmt: skip


def goodput(
    run_at: Callable[[float], float],
    *,
    start: float = 1.0,
    target: float = 0.9,
    precision: float = 1.05,
    lo_limit: float = 1 / 64,
    hi_limit: float = 256.0,
) -> tuple[float, list[tuple[float, float]]]:
    """DistServe goodput on the rate scale: the highest scale with attainment >= `target`.

    Brackets from `start` by doubling/halving, then bisects geometrically until hi/lo <=
    `precision`. Returns (scale, every (scale, attainment) probed); 0.0 if even `lo_limit` fails.
    """
    points: list[tuple[float, float]] = []

    def ok(scale: float) -> bool:
        att = run_at(scale)
        points.append((scale, att))
        return att >= target

    lo: float | None = None
    hi: float | None = None
    s = start
    if ok(s):
        lo = s
        while hi is None:
            s *= 2
            if s > hi_limit:
                return lo, points
            if ok(s):
                lo = s
            else:
                hi = s
    else:
        hi = s
        while lo is None:
            s /= 2
            if s < lo_limit:
                return 0.0, points
            if ok(s):
                lo = s
            else:
                hi = s
    while hi / lo > precision:
        mid = math.sqrt(lo * hi)
        if ok(mid):
            lo = mid
        else:
            hi = mid
    return lo, points


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
        print(f"  {n} workers: {row['wall_s']:.1f} s wall, {row['cpu_s']:.1f} s CPU, "
              f"{row['events']:,} events, {row['events_per_cpu_s']:,.0f} events/CPU-s",
              flush=True)  # fmt: skip
    return out


# -- validation: live simulated cluster vs the simulator ------------------------------------------


def live_mirror(time_scale: float, router_overhead_s: float = 0.0,
                step_overhead_s: float = 0.0) -> dict[str, Any]:
    """ClusterConfig overrides that make the simulator run the live simulated cluster's
    mechanics at `time_scale` (see `sim.cluster_config.ClusterConfig`): every sleep of the
    simulated workers rounded to uvloop's 1 ms (× time scale in simulated time), a sequence
    joins a decode batch mid-step, no extra link latency (the live KV pull has none beyond its
    HTTP hop, which the router overhead covers), plus the two measured overheads."""
    return {
        "timer_quantum_s": 0.001 * time_scale,
        "join_mid_step": True,
        "link_latency_s": 0.0,
        "router_overhead_s": router_overhead_s,
        "step_overhead_s": step_overhead_s,
    }


def calibration_requests(time_scale: float) -> list[TraceRequest]:
    """A synthetic workload, from no trace: 12 isolated requests (one in flight at a time,
    prompts 64/512/2048, 48 output tokens), then 3 bursts of 8 at once (256 in, 96 out)."""
    reqs: list[TraceRequest] = []
    t = 0.0
    for i in range(12):
        reqs.append(TraceRequest(t, (64, 512, 2048)[i % 3], 48, index=len(reqs)))
        t += 0.6 * time_scale  # wall gap 0.6 s: the previous request is done by then
    for _ in range(3):
        reqs += [TraceRequest(t, 256, 96, index=len(reqs) + k) for k in range(8)]
        t += 2.0 * time_scale
    return reqs


N_ISOLATED = 12


def calibrate(
    *,
    time_scale: float,
    n_prefill: int = 2,
    n_decode: int = 2,
    policy: str = "two_sided",
    estimator: str = "online_quantile",
    model: str = "llama-3-8b",
) -> dict[str, Any]:
    """Measure the live path's fixed per-request cost and per-step overhead, independently of
    any trace: `calibration_requests` through the live cluster and through the simulator with
    the live mechanics but no overheads (`live_mirror(time_scale)`), request by request.

    router_overhead_s = median TTFT difference of the isolated requests (no queueing, so the
    difference is hops, store round trips, router work and timer overshoot);
    step_overhead_s = median difference of the mean token gap, over all requests (batch 1
    and the bursts' batches of ~4 per decode worker)."""
    requests = calibration_requests(time_scale)
    trace = TRACES["conv"]  # its SLOs only (admission deadlines); none is near
    live = asyncio.run(_live(requests, time_scale, 1.0, n_prefill, n_decode, policy, estimator,
                             model, records=True))  # fmt: skip
    shape = ShapeSpec("validate", n_prefill, n_decode, model)
    case = CaseSpec(f"{policy}+{estimator}", policy, estimator=estimator)
    sim = _simulate(requests, shape, case, 1.0, trace,
                    config_overrides=live_mirror(time_scale))  # fmt: skip
    by_index = {r["index"]: r for r in live["records"]}
    d_ttft: list[float] = []
    by_prompt: list[tuple[int, float]] = []
    d_gap: list[float] = []
    d_gap_iso: list[float] = []
    for i, sr in enumerate(sim.records):
        lr = by_index.get(requests[i].index)
        if lr is None or lr["outcome"] != "ok" or sr.outcome != "ok" or lr["ttft_s"] is None:
            continue
        if i < N_ISOLATED:
            d_ttft.append(lr["ttft_s"] - sr.ttft_s)
            by_prompt.append((requests[i].prompt_tokens, lr["ttft_s"] - sr.ttft_s))
        if lr["tpot_s"] is not None and sr.output_tokens > 1:
            d_gap.append(lr["tpot_s"] - sr.mean_gap_s)
            if i < N_ISOLATED:
                d_gap_iso.append(lr["tpot_s"] - sr.mean_gap_s)
    if not d_ttft or not d_gap:
        raise RuntimeError("calibration: no request completed on both sides")
    router_s = max(0.0, _median(d_ttft))
    step_s = max(0.0, _median(d_gap))
    return {
        "time_scale": time_scale,
        "router_overhead_s": router_s,
        "step_overhead_s": step_s,
        "router_overhead_wall_s": router_s / time_scale,
        "step_overhead_wall_s": step_s / time_scale,
        "ttft_diff_s": sorted(d_ttft),
        "ttft_diff_by_prompt_s": sorted(by_prompt),
        "gap_diff_isolated_s": sorted(d_gap_iso),
        "gap_diff_s": sorted(d_gap),
        "live_outcomes": live["summary"]["requests"],
        "load_avg": os.getloadavg(),
    }


def _median(xs: Sequence[float]) -> float:
    v = sorted(xs)
    n = len(v)
    return v[n // 2] if n % 2 else 0.5 * (v[n // 2 - 1] + v[n // 2])


_METRICS = (
    ("TTFT p50", ("ttft_s", "p50"), "ttft_p50_s"),
    ("TTFT p90", ("ttft_s", "p90"), "ttft_p90_s"),
    ("ITL p50", ("itl_s", "p50"), "itl_p50_s"),
    ("ITL p90", ("itl_s", "p90"), "itl_p90_s"),
    ("TPOT p50", ("tpot_s", "p50"), "tpot_p50_s"),
)


def validate(
    *,
    n_requests: int = 300,
    time_scale: float = 4.0,
    rate_scale: float = 1.0,
    n_prefill: int = 2,
    n_decode: int = 2,
    policy: str = "two_sided",
    estimator: str = "online_quantile",
    start: int = 0,
    model: str = "llama-3-8b",
    trace_name: str = "conv",
    calibrate_first: bool = False,
    overheads: tuple[float, float] | None = None,
) -> dict[str, Any]:
    """The same trace slice through router + simulated workers (time-scaled) and through the
    simulator, same shape/policy/estimator: p50/p90 TTFT and ITL side by side.

    The simulator runs three ways: the cost model exactly (`sim_s`), with the live cluster's
    mechanics (`live_mirror`, no overheads: `mirror_s`), and with them plus the router and step
    overheads (`cal_s`) — measured by `calibrate` first (`calibrate_first`, on a synthetic
    workload, not this slice) or given as `overheads` = (router_overhead_s, step_overhead_s)."""
    trace = TRACES[trace_name]
    requests = load_trace(TRACE_DIR / trace.file, limit=n_requests, start=start)
    load0 = os.getloadavg()
    cal = None
    if calibrate_first:
        cal = calibrate(time_scale=time_scale, n_prefill=n_prefill, n_decode=n_decode,
                        policy=policy, estimator=estimator, model=model)  # fmt: skip
        overheads = (cal["router_overhead_s"], cal["step_overhead_s"])
        print(f"calibration at time scale {time_scale:g}: router_overhead_s = "
              f"{1e3 * overheads[0]:.2f} ms, step_overhead_s = {1e3 * overheads[1]:.3f} ms "
              f"(simulated; wall {1e3 * overheads[0] / time_scale:.2f} / "
              f"{1e3 * overheads[1] / time_scale:.3f} ms)", flush=True)  # fmt: skip
    live = asyncio.run(_live(requests, time_scale, rate_scale, n_prefill, n_decode, policy,
                             estimator, model, trace_name=trace_name))  # fmt: skip
    load1 = os.getloadavg()
    variants = {"sim_s": None, "mirror_s": live_mirror(time_scale)}
    if overheads is not None:
        variants["cal_s"] = live_mirror(time_scale, *overheads)
    sims = {k: _sim_same(requests, rate_scale, n_prefill, n_decode, policy, estimator, trace,
                         model, overrides) for k, overrides in variants.items()}  # fmt: skip
    rows = []
    for metric, lk, sk in _METRICS:
        lv = live["summary"][lk[0]][lk[1]]
        row: dict[str, Any] = {"metric": metric, "live_s": lv}
        for k, simrow in sims.items():
            sv = simrow[sk]
            row[k] = sv
            suffix = {"sim_s": "", "mirror_s": "_mirror", "cal_s": "_cal"}[k]
            row["rel_diff" + suffix] = (sv - lv) / lv if lv else None
        rows.append(row)
    simrow = sims["sim_s"]
    return {
        "trace": trace_name,
        "start": start,
        "requests": len(requests),
        "time_scale": time_scale,
        "rate_scale": rate_scale,
        "shape": f"{n_prefill}P:{n_decode}D {model} h100",
        "policy": policy,
        "estimator": estimator,
        "rows": rows,
        "overheads": None if overheads is None else {
            "router_overhead_s": overheads[0], "step_overhead_s": overheads[1]},
        "calibration": cal,
        "load_avg_before": load0,
        "load_avg_after": load1,
        "live_outcomes": live["summary"]["requests"],
        "sim_outcomes": {k: simrow[k] for k in ("ok", "rejected", "failed")},
        "live_client_lag_p99_s": live["summary"]["client_send_lag_s"]["p99"],
    }  # fmt: skip


async def _live(
    requests: Sequence[TraceRequest], time_scale: float, rate_scale: float, n_prefill: int,
    n_decode: int, policy: str, estimator: str, model: str = "llama-3-8b", *,
    trace_name: str = "conv", records: bool = False,
) -> dict[str, Any]:  # fmt: skip
    from bench.replay import replay
    from bench.report import summarize
    from router.localcluster import ClusterShape, local_cluster

    shape = ClusterShape(n_prefill=n_prefill, n_decode=n_decode, time_scale=time_scale,
                         policy=policy, estimator=estimator, model=model)  # fmt: skip
    async with local_cluster(shape, redis_url=os.environ.get("REDIS_URL")) as cluster:
        cap = 4096
        result = await replay(cluster.router_url, requests, model=shape.model, endpoint="chat",
                              max_tokens_cap=cap, time_scale=time_scale, rate_scale=rate_scale,
                              timeout_s=600.0)  # fmt: skip
    trace = TRACES[trace_name]
    summary = summarize(result, slo_ttft_s=trace.slo_ttft_s, slo_tpot_s=trace.slo_tpot_s)
    out: dict[str, Any] = {"summary": summary}
    if records:
        out["records"] = [r.to_dict() for r in result.records]
    return out


def _sim_same(
    requests: Sequence[TraceRequest], rate_scale: float, n_prefill: int, n_decode: int,
    policy: str, estimator: str, trace: TraceSpec, model: str = "llama-3-8b",
    overrides: dict[str, Any] | None = None,
) -> dict[str, Any]:  # fmt: skip
    shape = ShapeSpec("validate", n_prefill, n_decode, model)
    case = CaseSpec(f"{policy}+{estimator}", policy, estimator=estimator)
    # The live cluster's router sends max_tokens = 4096 (the replay's cap), like the simulator.
    return run_case(requests, shape, case, rate_scale, trace, config_overrides=overrides)


# -- plots and tables ------------------------------------------------------------------------------


def plot_attainment(results: Sequence[dict[str, Any]], trace: str, shape: str, path: Path,
                    slo: str = "") -> bool:  # fmt: skip
    """Attainment vs offered req/s per policy, from the goodput searches' probes."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for r in results:
        if r["trace"] != trace or r["shape"] != shape:
            continue
        pts = sorted(r["points"])
        style = "-" if not r["baseline"] else "--"
        ax.plot([s * r["base_rps"] for s, _ in pts], [a for _, a in pts], style, marker="o",
                markersize=3, label=f"{r['case']} ({r['goodput_rps']:.1f} req/s)")  # fmt: skip
    ax.axhline(0.9, color="grey", linestyle=":", label="90 % target")
    ax.set_xscale("log")
    from matplotlib.ticker import ScalarFormatter

    for axis in (ax.xaxis,):
        axis.set_major_formatter(ScalarFormatter())
        axis.set_minor_formatter(ScalarFormatter())
    ax.tick_params(axis="x", which="minor", labelsize=7)
    ax.set_xlabel("offered load, requests/s (log)")
    ax.set_ylabel("fraction meeting both SLOs")
    ax.set_ylim(0, 1.02)
    ax.set_title(f"{trace} on {shape}{' — ' + slo if slo else ''}")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, loc="lower left")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _ms(v: float) -> str:
    return f"{1e3 * v:,.0f}" if v >= 0.1 else f"{1e3 * v:.1f}"


def goodput_table(data: dict[str, Any]) -> str:
    out = []
    keyed = {(r["trace"], r["shape"], r["case"]): r for r in data["at_common_rate"]}
    combos = sorted({(r["trace"], r["shape"]) for r in data["goodput"]},
                    key=lambda ts: (list(TRACES).index(ts[0]) if ts[0] in TRACES else 99, ts[1]))
    for t, s in combos:
        rows = [r for r in data["goodput"] if r["trace"] == t and r["shape"] == s]
        best_base = max((r["goodput_rps"] for r in rows if r["baseline"]), default=0.0)
        spec = TRACES.get(t)
        slo = f"TTFT ≤ {spec.slo_ttft_s:g} s, TPOT ≤ {spec.slo_tpot_s * 1e3:g} ms" if spec else ""
        common = next((keyed[(t, s, r["case"])]["rate_scale"] for r in rows
                       if (t, s, r["case"]) in keyed), None)  # fmt: skip
        out.append(f"\n**{t} × {s}** ({rows[0]['requests']} requests, {rows[0]['base_rps']:.2f} "
                   f"req/s at ×1; {slo}; latency columns at the best baseline's goodput, "
                   f"×{common:.2f})\n")  # fmt: skip
        out.append("| policy | goodput req/s (×scale) | vs best baseline | SLO % | TTFT p99 ms "
                   "| ITL p99 ms | rejected | preempt | refused handoffs | stranded GB·s "
                   "| reserved-unused M blk·s |")  # fmt: skip
        out.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for r in rows:
            c = keyed.get((t, s, r["case"]), {})
            ratio = r["goodput_rps"] / best_base if best_base else float("nan")
            out.append(
                f"| {r['case']} | {r['goodput_rps']:.2f} (×{r['goodput_scale']:.2f}) "
                f"| {ratio:.2f} | {100 * c.get('slo_attainment', 0):.1f} "
                f"| {_ms(c.get('ttft_p99_s', 0))} | {_ms(c.get('itl_p99_s', 0))} "
                f"| {c.get('rejected', 0)} | {c.get('preemptions', 0)} "
                f"| {int(c.get('handoff_refusals', 0))} | {c.get('stranded_byte_s', 0) / 1e9:.1f} "
                f"| {c.get('reserved_unused_block_s', 0) / 1e6:.2f} |"
            )
    return "\n".join(out)


def admission_table(rows: Sequence[dict[str, Any]]) -> str:
    out = ["| trace × shape | rate | admission | rejected | SLO % | admitted on forecast "
           "| TTFT p99 ms | preempt |", "|---|---:|---|---:|---:|---:|---:|---:|"]  # fmt: skip
    for r in rows:
        out.append(f"| {r['trace']} × {r['shape']} | ×{r['rate_scale']:g} | {r['case']} "
                   f"| {r['rejected']} | {100 * r['slo_attainment']:.1f} "
                   f"| {int(r['admitted_on_forecast'])} | {_ms(r['ttft_p99_s'])} "
                   f"| {r['preemptions']} |")  # fmt: skip
    return "\n".join(out)


def scaling_table(rows: Sequence[dict[str, Any]]) -> str:
    out = ["| workers (P+D) | rate | requests | events | wall s | CPU s | events/CPU-s "
           "| events/wall-s | SLO % |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for r in rows:
        out.append(f"| {r['workers']} ({r['prefill']}+{r['decode']}) | ×{r['rate_scale']:g} "
                   f"| {r['requests']:,} | {r['events']:,} | {r['wall_s']:.1f} "
                   f"| {r.get('cpu_s', float('nan')):.1f} "
                   f"| {r.get('events_per_cpu_s', float('nan')):,.0f} "
                   f"| {r['events_per_s']:,.0f} | {100 * r['slo_attainment']:.1f} |")  # fmt: skip
    return "\n".join(out)


def validation_table(v: dict[str, Any]) -> str:
    def pct(d: float | None) -> str:
        return "" if d is None else f"{100 * d:+.1f} %"

    cols = [("sim_s", "rel_diff", "simulator (cost model)"),
            ("mirror_s", "rel_diff_mirror", "sim + live mechanics"),
            ("cal_s", "rel_diff_cal", "sim + mechanics + overheads")]  # fmt: skip
    cols = [c for c in cols if v["rows"] and c[0] in v["rows"][0]]
    head = "| metric | live (router + sim workers) ms |" + "".join(
        f" {name} ms | vs live |" for _, _, name in cols)
    out = [head, "|---|---:|" + "---:|---:|" * len(cols)]
    for r in v["rows"]:
        out.append(f"| {r['metric']} | {1e3 * (r['live_s'] or 0):.1f} |" + "".join(
            f" {1e3 * r[k]:.1f} | {pct(r.get(d))} |" for k, d, _ in cols))  # fmt: skip
    return "\n".join(out)


# -- CLI -------------------------------------------------------------------------------------------


def _write(out: Path, name: str, data: Any) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(data, indent=1, default=_jsonable))


def _jsonable(o: Any) -> Any:
    if hasattr(o, "__dataclass_fields__"):
        return asdict(o)
    raise TypeError(type(o))


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.experiments", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=("policies", "admission", "scaling", "validate", "all",
                                     "tables", "plots"))  # fmt: skip
    ap.add_argument("--traces", default=",".join(TRACES))
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--cases", default=None, help="comma-separated case labels (default: all)")
    ap.add_argument("--limit", type=int, default=None, help="requests per trace (default: "
                    "the slice in TRACES; scaling: the whole trace)")  # fmt: skip
    ap.add_argument("--precision", type=float, default=1.05, help="goodput bisection hi/lo")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--sizes", default="16,64,256,1000")
    ap.add_argument("--scaling-rate", type=float, default=1.0)
    ap.add_argument("--per-worker-load", action="store_true")
    ap.add_argument("--admission-runs", default=None,
                    help="admission: trace:shape:rate_scale,... (default: see the function)")
    ap.add_argument("--requests", type=int, default=300, help="validate: trace requests")
    ap.add_argument("--time-scale", type=float, default=4.0, help="validate: live time scale")
    ap.add_argument("--rate-scale", type=float, default=1.0, help="validate: arrival rate scale")
    ap.add_argument("--model", default="llama-3-8b", help="validate: model profile")
    ap.add_argument("--trace", default="conv", help="validate: trace")
    ap.add_argument("--start", type=int, default=0, help="validate: first trace row")
    ap.add_argument("--calibrate", action="store_true", help="validate: measure the router and "
                    "step overheads first (synthetic requests), then apply them to the simulator")
    ap.add_argument("--overheads", default=None, help="validate: ROUTER_MS,STEP_MS (simulated "
                    "ms) to apply instead of measuring them")  # fmt: skip
    ap.add_argument("--out", default="bench-results")
    ap.add_argument("--tag", default="", help="suffix for the JSON file names")
    ap.add_argument("--img", default="docs/img")
    ns = ap.parse_args(argv)
    out = Path(ns.out)
    traces = [t for t in ns.traces.split(",") if t]
    shapes = [s for s in ns.shapes.split(",") if s]
    cases = CASES
    if ns.cases:
        want = set(ns.cases.split(","))
        cases = tuple(c for c in (*CASES, *VARIANTS) if c.label in want)
    if ns.what in ("policies", "all"):
        data = policy_comparison(traces, shapes, cases, limit=ns.limit, precision=ns.precision,
                                 jobs=ns.jobs)  # fmt: skip
        _write(out, "policies" + ("-" + ns.tag if ns.tag else ""), data)
        for t in traces:
            for s in shapes:
                spec = TRACES[t]
                slo = f"TTFT ≤ {spec.slo_ttft_s:g} s, TPOT ≤ {spec.slo_tpot_s * 1e3:g} ms"
                png = Path(ns.img) / f"attainment-{t}-{s}.png"
                plot_attainment(data["goodput"], t, s, png, slo)
        print(goodput_table(data), flush=True)
    if ns.what in ("admission", "all"):
        kw: dict[str, Any] = {}
        if ns.admission_runs:
            kw["runs"] = [(t, sh, float(x)) for t, sh, x in
                          (r.split(":") for r in ns.admission_runs.split(","))]  # fmt: skip
        rows = admission_comparison(limit=ns.limit, jobs=ns.jobs, **kw)
        _write(out, "admission" + ("-" + ns.tag if ns.tag else ""), rows)
        print(admission_table(rows), flush=True)
    if ns.what in ("scaling", "all"):
        sizes = [int(x) for x in ns.sizes.split(",")]
        rows = scaling(sizes, limit=ns.limit, rate_scale=ns.scaling_rate,
                       per_worker_load=ns.per_worker_load)  # fmt: skip
        _write(out, "scaling" + ("-per-worker" if ns.per_worker_load else ""), rows)
        print(scaling_table(rows), flush=True)
    if ns.what in ("validate", "all"):
        given = None
        if ns.overheads:
            r_ms, s_ms = (float(x) for x in ns.overheads.split(","))
            given = (r_ms / 1e3, s_ms / 1e3)
        v = validate(n_requests=ns.requests, time_scale=ns.time_scale, rate_scale=ns.rate_scale,
                     model=ns.model, trace_name=ns.trace, start=ns.start,
                     calibrate_first=ns.calibrate, overheads=given)  # fmt: skip
        print(f"load average before/after: {v['load_avg_before'][0]:.2f} / "
              f"{v['load_avg_after'][0]:.2f}; client send lag p99 "
              f"{1e3 * v['live_client_lag_p99_s']:.1f} ms; live {v['live_outcomes']}", flush=True)
        _write(out, "validate" + ("-" + ns.tag if ns.tag else ""), v)
        print(validation_table(v), flush=True)
    if ns.what == "plots":  # again from policies.json, without re-running anything
        data = json.loads((out / "policies.json").read_text())
        for t, s in sorted({(r["trace"], r["shape"]) for r in data["goodput"]}):
            spec = TRACES[t]
            slo = f"TTFT ≤ {spec.slo_ttft_s:g} s, TPOT ≤ {spec.slo_tpot_s * 1e3:g} ms"
            plot_attainment(data["goodput"], t, s, Path(ns.img) / f"attainment-{t}-{s}.png", slo)
    if ns.what == "tables":
        for name, fmt in (("policies", goodput_table), ("admission", admission_table),
                          ("scaling", scaling_table), ("validate", validation_table)):  # fmt: skip
            for p in sorted(out.glob(f"{name}*.json")):
                print(f"\n### {p.stem}\n")
                print(fmt(json.loads(p.read_text())))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
