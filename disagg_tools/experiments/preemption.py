"""A burst that overruns the estimates (issue 31), in the cluster simulator: the router's
preemption with exact resume against today's forced growth, same seed.

    python -m disagg_tools.experiments preemption [--seed 0] [--burst 120] [--capacity 700]

The workload teaches the estimator short answers, then sends long ones under the same
`max_tokens` (one estimator class): a warm phase of `warm` requests over `warm_s` whose
answers are 16-64 tokens, then a burst of `burst` requests over `burst_s` whose answers are
300-1,000 tokens (prompts 100-800 tokens throughout, all under max_tokens 1,024). The
`online_quantile` estimator (the router's default) has learned the short answers, so the burst
is admitted on reservations a tenth of its answers' size: as the answers outgrow them, the
decode workers run out of room. Today (`preemption` off) the growth is forced past capacity and
the engines preempt and recompute on their own; with preemption on, the router preempts the
newest stream of the grower's tenant on the worker and resumes it through admission.

Per run: goodput (requests/s meeting both SLOs over the arrival span) and its ratio to the
forced-growth run, the requests served, p99 TTFT of the requests the router did not preempt (and
of those it did: their first token came before the preemption), the router's preemptions (per
1,000 requests), the prefill tokens redone for them, engine preemptions, forced growths and the
most any decode worker was held past its capacity. Deterministic under `--seed`.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from disagg_tools.simcluster.config import ClusterConfig
from disagg_tools.simcluster.engine import simulate
from disagg_tools.simcluster.metrics import SimResult, percentile
from disagg_tools.traces import TraceRequest
from policies.registry import load_estimator, load_fairness, load_policy

__all__ = ["BurstSetup", "overrunning_burst", "run", "compare", "pooled", "table"]

MAX_TOKENS = 1024


@dataclass(frozen=True, slots=True)
class BurstSetup:
    """The workload and the cluster of the overrunning burst."""

    warm: int = 80  # requests teaching the estimator short answers
    warm_s: float = 40.0
    burst: int = 40  # long answers, on the short answers' estimate
    burst_s: float = 8.0
    n_prefill: int = 1
    n_decode: int = 2
    capacity_blocks: int = 700  # per decode worker (16-token blocks): decode room is scarce
    slo_ttft_s: float = 2.0
    slo_tpot_s: float = 0.1
    seed: int = 0

    def config(self, preemption: bool) -> ClusterConfig:
        return ClusterConfig.homogeneous(
            self.n_prefill,
            self.n_decode,
            capacity_blocks=self.capacity_blocks,
            max_tokens=MAX_TOKENS,
            max_wait_s=30.0,  # the burst waits for room rather than being refused
            preemption=preemption,
        )


def overrunning_burst(setup: BurstSetup) -> list[TraceRequest]:
    """The warm phase's short answers, then the burst's long ones (deterministic in the seed)."""
    rng = random.Random(f"overrunning-burst|{setup.seed}")
    rows: list[TraceRequest] = []
    t = 0.0
    for i in range(setup.warm):
        t += rng.expovariate(setup.warm / setup.warm_s)
        rows.append(TraceRequest(t, rng.randint(100, 800), rng.randint(16, 64), (), i, MAX_TOKENS))
    t0 = t + 2.0  # the last short answers are learnt before the burst
    for i in range(setup.burst):
        at = t0 + rng.uniform(0.0, setup.burst_s)
        rows.append(
            TraceRequest(
                at, rng.randint(100, 800), rng.randint(300, 1000), (), setup.warm + i, MAX_TOKENS
            )
        )
    rows.sort(key=lambda r: (r.arrival_s, r.index))
    return rows


def run(setup: BurstSetup, preemption: bool) -> SimResult:
    """One run, with the router's defaults: `two_sided` placement, `online_quantile`, and its
    admission queue (`fifo`: in arrival order, a waiter that does not fit skipped for the next
    ones; a preempted stream's continuation keeps its request's place, the oldest)."""
    return simulate(
        overrunning_burst(setup),
        setup.config(preemption),
        load_policy("two_sided"),
        load_estimator("online_quantile"),
        seed=setup.seed,
        slo_ttft_s=setup.slo_ttft_s,
        slo_tpot_s=setup.slo_tpot_s,
        fairness=load_fairness("fifo"),
    )


_FIELDS = (
    "ok",
    "failed",
    "rejected",
    "slo_met_rps",
    "slo_attainment",
    "ttft_p99_s",
    "ttft_p99_not_preempted_s",
    "ttft_p99_preempted_s",
    "tpot_p99_s",
    "router_preemptions",
    "router_preemptions_per_1k",
    "preempted_requests",
    "redone_prefill_tokens",
    "preemptions",
    "steps_held_past_capacity",
    "preemption_forced_growth",
    "peak_held_past_capacity",
    "sim_end_s",
)


OFF, ON = "forced growth (off)", "preemption (on)"


def compare(setup: BurstSetup) -> dict[str, dict[str, Any]]:
    """Both runs' figures, same workload and seed: {OFF: ..., ON: ...}."""
    out: dict[str, dict[str, Any]] = {}
    for label, on in ((OFF, False), (ON, True)):
        s = run(setup, on).summary()
        out[label] = {k: s.get(k, 0) for k in _FIELDS}
    base = out[OFF]["slo_met_rps"]
    for row in out.values():
        row["goodput_ratio"] = row["slo_met_rps"] / base if base else 0.0
    return out


def pooled(setup: BurstSetup, seeds: Sequence[int]) -> dict[str, dict[str, Any]]:
    """Both modes over several seeds: goodput summed (its ratio to forced growth's), p99 TTFT
    over every seed's requests pooled, counts summed. One seed's p99 rests on a handful of
    requests; the pool's on all of them."""
    out: dict[str, dict[str, Any]] = {}
    for label, on in ((OFF, False), (ON, True)):
        results = [run(replace(setup, seed=seed), on) for seed in seeds]
        recs = [r for res in results for r in res.records]
        ok = [r for r in recs if r.outcome == "ok"]
        sums = [res.summary() for res in results]
        total = sum(len(res.records) for res in results)
        cut = sum(r.router_preemptions for r in recs)
        out[label] = {
            "requests": total,
            "ok": len(ok),
            "goodput_rps_sum": sum(float(s["slo_met_rps"]) for s in sums),
            "ttft_p99_not_preempted_s": percentile(
                [r.ttft_s for r in ok if not r.router_preemptions], 99
            )
            or 0.0,
            "ttft_p99_preempted_s": percentile([r.ttft_s for r in ok if r.router_preemptions], 99)
            or 0.0,
            "router_preemptions": cut,
            "router_preemptions_per_1k": 1000.0 * cut / total if total else 0.0,
            "redone_prefill_tokens": sum(r.redone_tokens for r in recs),
            "engine_preemptions": sum(r.preemptions for r in recs),
            "steps_held_past_capacity": sum(int(s["steps_held_past_capacity"]) for s in sums),
            "peak_held_past_capacity": max(int(s["peak_held_past_capacity"]) for s in sums),
        }
    base = out[OFF]["goodput_rps_sum"]
    for row in out.values():
        row["goodput_ratio"] = row["goodput_rps_sum"] / base if base else 0.0
    return out


def table(rows: dict[str, dict[str, Any]]) -> str:
    """A markdown table, one column per run."""
    labels = list(rows)
    lines = ["| | " + " | ".join(labels) + " |", "|---|" + "---|" * len(labels)]
    for key in rows[labels[0]]:
        cells = [_fmt(rows[label][key]) for label in labels]
        lines.append(f"| {key} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.3f}" if abs(v) < 1000 else f"{v:.0f}"
    return str(v)


def main(argv: Sequence[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m disagg_tools.experiments preemption")
    p.add_argument("--seeds", type=int, default=6, help="seeds 0..N-1, pooled")
    default = BurstSetup()
    p.add_argument("--warm", type=int, default=default.warm)
    p.add_argument("--burst", type=int, default=default.burst)
    p.add_argument("--capacity", type=int, default=default.capacity_blocks)
    ns = p.parse_args(argv)
    setup = BurstSetup(warm=ns.warm, burst=ns.burst, capacity_blocks=ns.capacity)
    print(f"seeds 0..{ns.seeds - 1} pooled:\n")
    print(table(pooled(setup, range(ns.seeds))))
    print("\nseed 0:\n")
    print(table(compare(setup)))
    return 0
