"""`python -m disagg_tools.launcher.validate`: the simulator against the live simulated cluster.

The same trace slice through router + simulated workers (`disagg_tools.launcher.localcluster`,
time-scaled) and through the simulator (`disagg_tools.experiments.simruns`), same shape, policy
and estimator; p50/p90 TTFT and ITL side by side (docs/benchmarks.md, "Validation"). With
`--calibrate` the router's fixed per-request cost and the per-step overhead are measured first
on a synthetic workload.

Like is compared with like: TTFT and TPOT percentiles on both sides are
`disagg_tools.simcluster.metrics.percentile` over the requests that finished, and the live ITL goes
through
the simulator's own gap histogram (`disagg_tools.replay.calibration.live_metrics`).

    python -m disagg_tools.launcher.validate --requests 300 --time-scale 2 [--calibrate |
    --overheads R_MS,S_MS]
"""

from __future__ import annotations

import argparse
import asyncio
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from disagg_tools.experiments.experiments_cli import write_json
from disagg_tools.experiments.simruns import run_case, simulate_case
from disagg_tools.experiments.specs import TRACE_DIR, TRACES, CaseSpec, ShapeSpec, TraceSpec
from disagg_tools.experiments.tables import validation_table
from disagg_tools.launcher.localcluster import ClusterShape, local_cluster
from disagg_tools.replay.calibration import (
    N_ISOLATED,
    calibration_requests,
    live_metrics,
    live_mirror,
)
from disagg_tools.replay.replay_report import summarize
from disagg_tools.replay.replayer import replay
from disagg_tools.traces import TraceRequest, load_trace

__all__ = ["calibrate", "main", "validate"]


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
    live = asyncio.run(
        _live(
            requests, time_scale, 1.0, n_prefill, n_decode, policy, estimator, model, records=True
        )
    )
    shape = ShapeSpec("validate", n_prefill, n_decode, model)
    case = CaseSpec(f"{policy}+{estimator}", policy, estimator=estimator)
    sim = simulate_case(requests, shape, case, 1.0, trace, config_overrides=live_mirror(time_scale))
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


# Both sides under the simulator's summary keys, computed the same way (replay.calibration).
_METRICS = (
    ("TTFT p50", "ttft_p50_s"),
    ("TTFT p90", "ttft_p90_s"),
    ("ITL p50", "itl_p50_s"),
    ("ITL p90", "itl_p90_s"),
    ("TPOT p50", "tpot_p50_s"),
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
        cal = calibrate(
            time_scale=time_scale,
            n_prefill=n_prefill,
            n_decode=n_decode,
            policy=policy,
            estimator=estimator,
            model=model,
        )
        overheads = (cal["router_overhead_s"], cal["step_overhead_s"])
        print(
            f"calibration at time scale {time_scale:g}: router_overhead_s = "
            f"{1e3 * overheads[0]:.2f} ms, step_overhead_s = {1e3 * overheads[1]:.3f} ms "
            f"(simulated; wall {1e3 * overheads[0] / time_scale:.2f} / "
            f"{1e3 * overheads[1] / time_scale:.3f} ms)",
            flush=True,
        )
    live = asyncio.run(
        _live(
            requests,
            time_scale,
            rate_scale,
            n_prefill,
            n_decode,
            policy,
            estimator,
            model,
            trace_name=trace_name,
        )
    )
    load1 = os.getloadavg()
    variants = {"sim_s": None, "mirror_s": live_mirror(time_scale)}
    if overheads is not None:
        variants["cal_s"] = live_mirror(time_scale, *overheads)
    sims = {
        k: _sim_same(
            requests, rate_scale, n_prefill, n_decode, policy, estimator, trace, model, overrides
        )
        for k, overrides in variants.items()
    }
    rows = []
    for metric, sk in _METRICS:
        lv = live["metrics"][sk]
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
        "overheads": None
        if overheads is None
        else {"router_overhead_s": overheads[0], "step_overhead_s": overheads[1]},
        "calibration": cal,
        "load_avg_before": load0,
        "load_avg_after": load1,
        "live_outcomes": live["summary"]["requests"],
        "sim_outcomes": {k: simrow[k] for k in ("ok", "rejected", "failed")},
        "live_client_lag_p99_s": live["summary"]["client_send_lag_s"]["p99"],
    }


async def _live(
    requests: Sequence[TraceRequest],
    time_scale: float,
    rate_scale: float,
    n_prefill: int,
    n_decode: int,
    policy: str,
    estimator: str,
    model: str = "llama-3-8b",
    *,
    trace_name: str = "conv",
    records: bool = False,
) -> dict[str, Any]:
    shape = ClusterShape(
        n_prefill=n_prefill,
        n_decode=n_decode,
        time_scale=time_scale,
        policy=policy,
        estimator=estimator,
        model=model,
    )
    async with local_cluster(shape, redis_url=os.environ.get("REDIS_URL")) as cluster:
        cap = 4096
        result = await replay(
            cluster.router_url,
            requests,
            model=shape.model,
            endpoint="chat",
            max_tokens_cap=cap,
            time_scale=time_scale,
            rate_scale=rate_scale,
            timeout_s=600.0,
        )
    trace = TRACES[trace_name]
    summary = summarize(result, slo_ttft_s=trace.slo_ttft_s, slo_tpot_s=trace.slo_tpot_s)
    out: dict[str, Any] = {"summary": summary, "metrics": live_metrics(result.records)}
    if records:
        out["records"] = [r.to_dict() for r in result.records]
    return out


def _sim_same(
    requests: Sequence[TraceRequest],
    rate_scale: float,
    n_prefill: int,
    n_decode: int,
    policy: str,
    estimator: str,
    trace: TraceSpec,
    model: str = "llama-3-8b",
    overrides: dict[str, Any] | None = None,
) -> dict[str, Any]:
    shape = ShapeSpec("validate", n_prefill, n_decode, model)
    case = CaseSpec(f"{policy}+{estimator}", policy, estimator=estimator)
    # The live cluster's router sends max_tokens = 4096 (the replay's cap), like the simulator.
    return run_case(requests, shape, case, rate_scale, trace, config_overrides=overrides)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m disagg_tools.launcher.validate",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--requests", type=int, default=300, help="trace requests")
    ap.add_argument("--time-scale", type=float, default=4.0, help="live time scale")
    ap.add_argument("--rate-scale", type=float, default=1.0, help="arrival rate scale")
    ap.add_argument("--model", default="llama-3-8b", help="model profile")
    ap.add_argument("--trace", default="conv", help="trace")
    ap.add_argument("--start", type=int, default=0, help="first trace row")
    ap.add_argument(
        "--calibrate",
        action="store_true",
        help="measure the router and step overheads first (synthetic requests), then apply "
        "them to the simulator",
    )
    ap.add_argument(
        "--overheads",
        default=None,
        help="ROUTER_MS,STEP_MS (simulated ms) to apply instead of measuring them",
    )
    ap.add_argument("--out", default="bench-results")
    ap.add_argument("--tag", default="", help="suffix for the JSON file name")
    ns = ap.parse_args(argv)
    given = None
    if ns.overheads:
        r_ms, s_ms = (float(x) for x in ns.overheads.split(","))
        given = (r_ms / 1e3, s_ms / 1e3)
    v = validate(
        n_requests=ns.requests,
        time_scale=ns.time_scale,
        rate_scale=ns.rate_scale,
        model=ns.model,
        trace_name=ns.trace,
        start=ns.start,
        calibrate_first=ns.calibrate,
        overheads=given,
    )
    print(
        f"load average before/after: {v['load_avg_before'][0]:.2f} / "
        f"{v['load_avg_after'][0]:.2f}; client send lag p99 "
        f"{1e3 * v['live_client_lag_p99_s']:.1f} ms; live {v['live_outcomes']}",
        flush=True,
    )
    write_json(Path(ns.out), "validate" + ("-" + ns.tag if ns.tag else ""), v)
    print(validation_table(v), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
