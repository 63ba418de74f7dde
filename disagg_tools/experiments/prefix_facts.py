"""Placement on facts (issue 22): what exact prefix-cache knowledge is worth, in the simulator.

    python -m disagg_tools.experiments.prefix_facts [--goodput] [--smoke] [--json FILE]

Every run is the same cluster (2 prefill + 6 decode H100, llama-3-8b, decode workers may prefill
locally), the same two-sided policy and online estimator, the same physical prefix caches on
every worker (`ClusterConfig.affinity`, disagg_tools/simcluster/prefix_facts.py), at the same
load; only what the router is told of the caches changes:

    exact          both pools' cached_prefix_tokens, from KV events delayed `--lag` seconds
    exact_prefill  the prefill pool's only (the peers' KV-event routers)
    estimated      recent_prefixes, the router's own record of what it sent each prefill worker
    none           nothing
    oracle         both pools, read straight from the caches

Two workloads (../shared/traces): multi-turn conversations derived from the Azure conversation
trace (`disagg_tools.traces.multi_turn`, 64-token blocks, a shared 1k-token system prompt), and
the Mooncake trace, whose hash ids are 512-token prefix blocks. Two cache sizes per worker: a
GPU-sized one (200k tokens of free HBM) and an offloaded one (4M tokens, a CPU tier).

Per row: TTFT p50/p90/p99, prefix-hit rate (prompt tokens not computed because a cache held
them), KV bytes moved P→D, SLO attainment and, with `--goodput`, the DistServe goodput (highest
rate scale with >= 90 % of requests meeting TTFT 2 s and TPOT 100 ms).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from typing import Any

import orjson

from disagg_tools.goodput import goodput
from disagg_tools.simcluster.config import Affinity, ClusterConfig
from disagg_tools.simcluster.engine import simulate
from disagg_tools.traces import TRACE_DIR, TraceRequest, load_trace, multi_turn
from policies.estimators import OnlineQuantileEstimator
from policies.two_sided import TwoSidedPolicy

__all__ = ["MODES", "CACHES", "Workload", "workloads", "run_one", "run_grid", "main"]

MODES: tuple[Affinity, ...] = ("exact", "exact_prefill", "estimated", "none", "oracle")
# Cache size per worker, in tokens (turned into the workload's blocks).
CACHES: dict[str, int] = {"gpu": 200_000, "offload": 4_000_000}
SLO_TTFT_S, SLO_TPOT_S = 2.0, 0.1


@dataclass(frozen=True, slots=True)
class Workload:
    name: str
    requests: tuple[TraceRequest, ...]
    block_tokens: int
    rate_scale: float  # the equal load every mode is measured at


def workloads(smoke: bool = False) -> list[Workload]:
    """The two workloads; `smoke` cuts them to a CI-sized run (seconds)."""
    conv = multi_turn(
        TRACE_DIR / "AzureLLMInferenceTrace_conv.csv",
        conversations=40 if smoke else 500,
        seed=1,
        block_tokens=64,
        system_tokens=1024,
    )
    mooncake = load_trace(TRACE_DIR / "mooncake_synthetic_trace.jsonl", limit=60 if smoke else 1000)
    return [
        Workload("multi_turn", tuple(conv), 64, 2.0),
        Workload("mooncake", tuple(mooncake), 512, 0.6),
    ]


def _config(work: Workload, mode: Affinity, cache_tokens: int, lag_s: float) -> ClusterConfig:
    return ClusterConfig.homogeneous(
        2,
        6,
        affinity=mode,
        prefix_cache_blocks=cache_tokens // work.block_tokens,
        prefix_block_tokens=work.block_tokens,
        kv_event_lag_s=lag_s,
        local_prefill=True,
    )


def _attainment(work: Workload, cfg: ClusterConfig, rate_scale: float) -> dict[str, Any]:
    res = simulate(
        work.requests,
        cfg,
        TwoSidedPolicy(),
        OnlineQuantileEstimator(),
        rate_scale=rate_scale,
        slo_ttft_s=SLO_TTFT_S,
        slo_tpot_s=SLO_TPOT_S,
    )
    return res.summary()


def run_one(
    work: Workload, mode: Affinity, cache: str, lag_s: float, with_goodput: bool
) -> dict[str, Any]:
    """One row: the mode at the workload's load (and its goodput, if asked)."""
    cfg = _config(work, mode, CACHES[cache], lag_s)
    s = _attainment(work, cfg, work.rate_scale)
    row: dict[str, Any] = {
        "workload": work.name,
        "cache": cache,
        "mode": mode,
        "requests": s["requests"],
        "ttft_p50_s": s["ttft_p50_s"],
        "ttft_p90_s": s["ttft_p90_s"],
        "ttft_p99_s": s["ttft_p99_s"],
        "hit_rate": s["prefix_hit_rate"],
        "kv_gb_moved": s["kv_bytes_moved"] / 1e9,
        "slo_attainment": s["slo_attainment"],
    }
    if with_goodput:
        scale, _ = goodput(
            lambda r: float(_attainment(work, cfg, r)["slo_attainment"]),
            start=work.rate_scale,
            precision=1.1,
        )
        row["goodput_scale"] = scale
    return row


def _run_star(args: tuple[Workload, Affinity, str, float, bool]) -> dict[str, Any]:
    return run_one(*args)


def run_grid(
    works: Sequence[Workload],
    *,
    lag_s: float = 0.05,
    with_goodput: bool = False,
    jobs: int = 1,
    caches: Sequence[str] = tuple(CACHES),
) -> list[dict[str, Any]]:
    """Every (workload, cache, mode) row, in that order; deterministic whatever `jobs` is."""
    grid = [(w, m, c, lag_s, with_goodput) for w in works for c in caches for m in MODES]
    if jobs <= 1:
        return [_run_star(g) for g in grid]
    with ProcessPoolExecutor(jobs) as pool:
        return list(pool.map(_run_star, grid))


def checks(rows: Sequence[dict[str, Any]]) -> list[str]:
    """The issue's targets, each with its verdict, per (workload, cache)."""
    out: list[str] = []
    keys = dict.fromkeys((r["workload"], r["cache"]) for r in rows)
    for work, cache in keys:
        by = {r["mode"]: r for r in rows if r["workload"] == work and r["cache"] == cache}
        ex, est, pre, ora = by["exact"], by["estimated"], by["exact_prefill"], by["oracle"]
        ahead = all(ex[k] <= est[k] for k in ("ttft_p50_s", "ttft_p90_s", "ttft_p99_s"))
        ahead = ahead and ex["hit_rate"] >= est["hit_rate"]
        gap = (ora["hit_rate"] - ex["hit_rate"]) * 100
        fewer = ex["kv_gb_moved"] < pre["kv_gb_moved"]
        out.append(
            f"{work}/{cache}: exact >= estimated (TTFT p50/p90/p99 and hit rate): "
            f"{'yes' if ahead else 'NO'}; exact's hit rate {gap:+.2f} points below the oracle "
            f"({'within 2' if gap <= 2 else 'NOT within 2'}); both sides move "
            f"{ex['kv_gb_moved']:.1f} GB vs prefill-only {pre['kv_gb_moved']:.1f} GB "
            f"({'fewer' if fewer else 'NOT fewer'})"
        )
    return out


def markdown(rows: Sequence[dict[str, Any]]) -> str:
    goodput_col = any("goodput_scale" in r for r in rows)
    head = (
        "| workload | cache | mode | TTFT p50 s | p90 s | p99 s | prefix hit | KV GB moved | SLO |"
    )
    rule = "|---|---|---|---:|---:|---:|---:|---:|---:|"
    if goodput_col:
        head += " goodput (rate scale) |"
        rule += "---:|"
    lines = [head, rule]
    for r in rows:
        line = (
            f"| {r['workload']} | {r['cache']} | {r['mode']} | {r['ttft_p50_s']:.3f} | "
            f"{r['ttft_p90_s']:.3f} | {r['ttft_p99_s']:.3f} | {r['hit_rate']:.3f} | "
            f"{r['kv_gb_moved']:.1f} | {r['slo_attainment']:.3f} |"
        )
        if goodput_col:
            line += f" {r.get('goodput_scale', 0.0):.2f} |"
        lines.append(line)
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m disagg_tools.experiments.prefix_facts")
    ap.add_argument("--goodput", action="store_true", help="also search each row's goodput")
    ap.add_argument("--smoke", action="store_true", help="CI-sized workloads (seconds)")
    ap.add_argument("--lag", type=float, default=0.05, help="KV-event delay to the router, s")
    ap.add_argument("--jobs", type=int, default=1, help="worker processes (rows are the same)")
    ap.add_argument("--json", help="also write the rows to this file")
    args = ap.parse_args(argv)
    rows = run_grid(
        workloads(args.smoke), lag_s=args.lag, with_goodput=args.goodput, jobs=args.jobs
    )
    print(markdown(rows))
    print()
    for line in checks(rows):
        print("- " + line)
    if args.json:
        with open(args.json, "wb") as fh:
            fh.write(orjson.dumps(rows, option=orjson.OPT_INDENT_2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
