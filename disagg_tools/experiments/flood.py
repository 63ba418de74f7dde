"""Tenants under a flood (issue 25), in the cluster simulator: isolation and share convergence.

    python -m disagg_tools.experiments flood [--duration 90] [--tenants 2,10,1000]

**Isolation.** A victim at its share (weight 1 of 2: half the cluster's capacity) and an
aggressor at ten times its own (five times the capacity) on a decode-bound cluster; the victim
alone first, then both, under `fifo` and `vtc`. Per tenant: TTFT p99, goodput (requests/s
meeting both SLOs) and its ratio to the victim's solo run, served requests/s, 429s.

**Convergence.** N tenants (2, 10, 1,000), weights 1..4 (2: 1 and 3), every one offered more
than its share, admission waits up to `max_wait_s` so all stay backlogged; over a minute of
saturation after a warm-up, each tenant's served share against its weight share: the max
relative deviation |served − w/Σw| / (w/Σw) over the policy's units (decode block-seconds +
prefill tokens, the settled actual cost of the requests admitted in the window) and over
requests.

**Across replicas (issue 33).** The isolation runs again with the admission queue split over two
router replicas as today's router keeps it — a queue and fairness counters per replica, a
release waking its own replica's waiters first, the others at their next store refresh
(disagg_tools/simcluster/replica_queues.py) — for each placement of the live bench (`one`: both
tenants on replica 1; `spread`: each tenant's requests over both; `split`: the victim on replica
1, the aggressor on 2); `shared=True` (`--shared-fairness`) is one fair share and one line for
the cluster instead, what the issue asks for (and the policy `--fairness` names, e.g. a shared
one from policies/); under vtc it takes room back as the router does (streams of the tenant most
over its share preempted for a starved waiter and resumed, at most 4 a second per replica:
disagg_tools/simcluster/fair_takeback.py; `take_back=False` runs without). Per row the issue's
targets: victim goodput ≥ 0.95 × solo, TTFT p99 ≤
1.5 × solo + 150 ms, both tenants' output tokens/s ≥ 0.95 × the aggressor's alone.

The capacity the shares are fractions of is measured, not assumed: one tenant flooding the
cluster, its served requests/s over the window (`capacity`). Every run is deterministic under
`--seed`; the runs are `disagg_tools.simcluster.engine.simulate` with the policies the router
loads (`load_fairness`, `load_policy`, `load_estimator`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from disagg_tools.experiments.specs import TRACES
from disagg_tools.simcluster.config import ClusterConfig
from disagg_tools.simcluster.engine import simulate
from disagg_tools.simcluster.fair_takeback import FAIR_SHARE, PRIORITY, TakeBackSettings
from disagg_tools.simcluster.metrics import RequestRecord, SimResult, percentile
from disagg_tools.simcluster.replica_queues import Replicas, placement
from disagg_tools.simcluster.tenants import (
    TenantLoad,
    TenantRequest,
    tenant_streams,
    tenant_table,
)
from disagg_tools.traces import TraceRequest
from policies.registry import load_estimator, load_fairness, load_policy

__all__ = [
    "FloodSetup",
    "capacity",
    "convergence",
    "isolation",
    "placements",
    "placements_table",
    "preemption_reasons_table",
    "run_mix",
    "served",
    "share_deviation",
    "tenant_row",
]

# (label, fairness policy, its arguments): the router's two orders as it loads them (vtc holds
# the room its least-served tenant's request did not fit: backfill_slack 0), and vtc lending
# that room to whoever fits (backfill_slack inf): what holding room buys (docs/benchmarks.md).
POLICIES: tuple[tuple[str, str, dict[str, float] | None], ...] = (
    ("fifo", "fifo", None),
    ("vtc", "vtc", None),
    ("vtc, backfill_slack=inf", "vtc", {"backfill_slack": math.inf}),
)


@dataclass(frozen=True, slots=True)
class FloodSetup:
    """The cluster, the workload's lengths and the windows every flood run shares."""

    n_prefill: int = 2
    n_decode: int = 2
    capacity_blocks: int = 3000  # per decode worker: small, so decode room is what is scarce
    trace: str = "conv"
    pool: int = 2000  # requests of the trace the lengths are drawn from
    warmup_s: float = 20.0  # arrivals before this are not measured
    duration_s: float = 80.0  # arrivals stop here: a minute measured after the warm-up
    max_wait_s: float = 2.0  # admission wait (the victim's runs: its TTFT SLO)
    seed: int = 0

    def config(self, scale: int = 1, **kw: Any) -> ClusterConfig:
        kw.setdefault("max_wait_s", self.max_wait_s)
        return ClusterConfig.homogeneous(
            self.n_prefill * scale,
            self.n_decode * scale,
            capacity_blocks=self.capacity_blocks,
            queue_limit=1_000_000,
            **kw,
        )

    def lengths(self) -> list[TraceRequest]:
        return TRACES[self.trace].load(self.pool)

    @property
    def slo_ttft_s(self) -> float:
        return TRACES[self.trace].slo_ttft_s

    @property
    def slo_tpot_s(self) -> float:
        return TRACES[self.trace].slo_tpot_s


def run_mix(
    setup: FloodSetup,
    mix: Sequence[TenantLoad],
    fairness: str,
    pool: Sequence[TraceRequest],
    fairness_kwargs: Mapping[str, Any] | None = None,
    replicas: Replicas | None = None,
    **config: Any,
) -> tuple[list[TenantRequest], SimResult]:
    """One run of the mix under `fairness` (built with `fairness_kwargs`), every policy object
    fresh; admissions charged as the router charges them (fair_queue.py); over `replicas`'
    queues when given (replica_queues.py)."""
    reqs = tenant_streams(pool, mix, setup.duration_s, setup.seed)
    res = simulate(
        reqs,
        setup.config(**config),
        load_policy("two_sided"),
        load_estimator("online_quantile"),
        seed=setup.seed,
        slo_ttft_s=setup.slo_ttft_s,
        slo_tpot_s=setup.slo_tpot_s,
        fairness=load_fairness(fairness, fairness_kwargs),
        tenants=tenant_table(mix),
        replicas=replicas,
    )
    return reqs, res


def _window(setup: FloodSetup, r: RequestRecord) -> bool:
    return setup.warmup_s <= r.arrival_s < setup.duration_s


def capacity(setup: FloodSetup, pool: Sequence[TraceRequest], rate: float = 100.0) -> float:
    """Requests/s the cluster serves to one tenant flooding it (arrivals in the window)."""
    mix = (TenantLoad("flood", 1.0, rate),)
    _, res = run_mix(setup, mix, "fifo", pool, max_wait_s=30.0)
    served = sum(1 for r in res.records if r.outcome == "ok" and _window(setup, r))
    return served / (setup.duration_s - setup.warmup_s)


def tenant_row(setup: FloodSetup, res: SimResult, tenant: str) -> dict[str, Any]:
    """One tenant's numbers over the window (arrivals in [warmup, duration))."""
    recs = [r for r in res.records if r.tenant == tenant and _window(setup, r)]
    ok = [r for r in recs if r.outcome == "ok"]
    span = setup.duration_s - setup.warmup_s
    good = sum(1 for r in recs if r.meets(res.slo_ttft_s, res.slo_tpot_s))
    return {
        "tenant": tenant,
        "requests": len(recs),
        "ok": len(ok),
        "rejected": sum(1 for r in recs if r.outcome == "rejected"),
        "failed": sum(1 for r in recs if r.outcome == "failed"),
        "ttft_p50_s": percentile([r.ttft_s for r in ok], 50) or 0.0,
        "ttft_p99_s": percentile([r.ttft_s for r in ok], 99) or 0.0,
        "goodput_rps": good / span,
        "served_rps": len(ok) / span,
        "output_tok_s": sum(r.output_tokens for r in ok) / span,
    }


def isolation(
    setup: FloodSetup, pool: Sequence[TraceRequest], cap_rps: float, *, factor: float = 10.0
) -> list[dict[str, Any]]:
    """Victim solo, then victim + aggressor at `factor` × its share, under each policy."""
    share = 0.5 * cap_rps  # two tenants of weight 1
    victim = TenantLoad("victim", 1.0, share)
    aggressor = TenantLoad("aggressor", 1.0, factor * share)
    rows: list[dict[str, Any]] = []
    for label, policy, kwargs in POLICIES:
        _, solo = run_mix(setup, (victim,), policy, pool, kwargs)
        _, flood = run_mix(setup, (victim, aggressor), policy, pool, kwargs)
        base = tenant_row(setup, solo, "victim")
        v = tenant_row(setup, flood, "victim")
        a = tenant_row(setup, flood, "aggressor")
        rows.append(
            {
                "policy": label,
                "victim_rate_rps": victim.rate,
                "aggressor_rate_rps": aggressor.rate,
                "solo": base,
                "victim": v,
                "aggressor": a,
                "ttft_p99_ratio": _ratio(v["ttft_p99_s"], base["ttft_p99_s"]),
                "goodput_ratio": _ratio(v["goodput_rps"], base["goodput_rps"]),
                "cluster_served_rps": v["served_rps"] + a["served_rps"],
            }
        )
    return rows


def placements(
    setup: FloodSetup,
    pool: Sequence[TraceRequest],
    cap_rps: float,
    names: Sequence[str] = ("one", "spread", "split"),
    *,
    policies: Sequence[str] = ("fifo", "vtc"),
    shared: bool = False,
    victim_x: float = 1 / 6,
    aggressor_x: float = 1.5,
    max_wait_s: float = 30.0,
    refresh_s: float = 0.1,
    take_back: bool = True,
) -> list[dict[str, Any]]:
    """The flood over two replicas, per policy and placement, shaped like the live bench
    (disagg_tools/loadgen/flood_replicas.py): a light victim (`victim_x` × the capacity,
    Poisson: the simulator has no closed-loop clients) and an aggressor that alone keeps the
    decode room full and a queue behind it (`aggressor_x` × the capacity), waits up to
    `max_wait_s` (the router's default, as live). The victim solo placed as in the flood; the
    aggressor alone once (the work the flood must keep: output tokens/s). `take_back`: with
    `shared` and vtc, room is taken back as the router does (the router's settings)."""
    victim = TenantLoad("victim", 1.0, victim_x * cap_rps)
    aggressor = TenantLoad("aggressor", 1.0, aggressor_x * cap_rps)
    _, alone_res = run_mix(setup, (aggressor,), "fifo", pool, max_wait_s=max_wait_s)
    alone = tenant_row(setup, alone_res, "aggressor")
    rows: list[dict[str, Any]] = []
    settings = TakeBackSettings() if take_back else None
    for policy in policies:
        for name in names:
            reps = Replicas(2, placement(name), refresh_s, shared, settings)
            mix = (victim, aggressor)
            _, solo = run_mix(setup, (victim,), policy, pool, replicas=reps, max_wait_s=max_wait_s)
            _, flood = run_mix(setup, mix, policy, pool, replicas=reps, max_wait_s=max_wait_s)
            base = tenant_row(setup, solo, "victim")
            v = tenant_row(setup, flood, "victim")
            a = tenant_row(setup, flood, "aggressor")
            window = [r for r in flood.records if _window(setup, r)]
            cuts = sum(r.router_preemptions for r in window)
            for_share = sum(r.fair_share_preemptions for r in window)
            for_class = sum(r.priority_preemptions for r in window)
            per_1k = 1000.0 / max(1, len(window))
            bound = 1.5 * base["ttft_p99_s"] + 0.150
            work = _ratio(v["output_tok_s"] + a["output_tok_s"], alone["output_tok_s"])
            good = _ratio(v["goodput_rps"], base["goodput_rps"])
            rows.append(
                {
                    "policy": policy,
                    "placement": name,
                    "replicas": _share_label(shared, take_back and policy == "vtc"),
                    "take_back": shared and take_back and policy == "vtc",
                    "victim_rps": victim.rate,
                    "aggressor_rps": aggressor.rate,
                    "solo": base,
                    "victim": v,
                    "aggressor": a,
                    "aggressor_alone": alone,
                    "goodput_ratio": good,
                    "ttft_p99_ratio": _ratio(v["ttft_p99_s"], base["ttft_p99_s"]),
                    "ttft_p99_bound_s": bound,
                    "work_ratio": work,
                    "preemptions_per_1k": per_1k * cuts,
                    # By why (the router's reasons): a growth's (issue 31) or a take-back's.
                    "preemptions_per_1k_by_reason": {
                        "growth": per_1k * (cuts - for_share - for_class),
                        FAIR_SHARE: per_1k * for_share,
                        PRIORITY: per_1k * for_class,
                    },
                    "targets": {
                        "victim_goodput": good >= 0.95,
                        # (a victim served nothing has no TTFT to meet the bound with)
                        "victim_ttft_p99": v["ok"] > 0 and v["ttft_p99_s"] <= bound,
                        "work_conserving": work >= 0.95,
                    },
                }
            )
    return rows


def _share_label(shared: bool, take_back: bool) -> str:
    if not shared:
        return "a share per replica"
    one = "one share for the cluster"
    return f"{one}, room taken back" if take_back else one


def _ratio(a: float, b: float) -> float:
    return a / b if b > 0 else float("inf")


def weights_for(n: int) -> list[float]:
    """Unequal weights: 1 and 3 for two tenants, else 1, 2, 3, 4, 1, 2, ..."""
    return [1.0, 3.0] if n == 2 else [float(1 + i % 4) for i in range(n)]


def served(
    res: SimResult, tenants: Iterable[str], t0: float, t1: float
) -> tuple[dict[str, float], dict[str, int]]:
    """Per tenant, the units (settled decode block-seconds + prefill tokens) and the requests
    admitted in [t0, t1)."""
    units = dict.fromkeys(tenants, 0.0)
    count = dict.fromkeys(units, 0)
    for r in res.records:
        if r.outcome == "rejected" or not t0 <= r.arrival_s + r.queued_s < t1:
            continue
        units[r.tenant] += r.decode_block_s + r.prompt_tokens
        count[r.tenant] += 1
    return units, count


def share_deviation(
    setup: FloodSetup,
    res: SimResult,
    weights: dict[str, float],
    t0: float,
    t1: float,
) -> dict[str, float]:
    """Max relative deviation of served share from weight share over the requests admitted
    in [t0, t1): in the policy's units (block-seconds + prefill tokens, vtc's default unit
    weights) and in requests; also the tenants never served there."""
    units, count = served(res, weights, t0, t1)
    total_w = sum(weights.values())
    total_u, total_n = sum(units.values()), sum(count.values())
    out = {"units_max_dev": 0.0, "requests_max_dev": 0.0, "admitted": float(total_n)}
    for t, w in weights.items():
        fair = w / total_w
        if total_u > 0:
            dev = abs(units[t] / total_u - fair) / fair
            out["units_max_dev"] = max(out["units_max_dev"], dev)
        if total_n > 0:
            dev = abs(count[t] / total_n - fair) / fair
            out["requests_max_dev"] = max(out["requests_max_dev"], dev)
    out["unserved_tenants"] = float(sum(1 for n in count.values() if n == 0))
    out["min_requests_per_tenant"] = float(min(count.values(), default=0))
    return out


def convergence(
    setup: FloodSetup,
    pool: Sequence[TraceRequest],
    cap_rps: float,
    sizes: Sequence[int],
    *,
    overload: float = 3.0,
    replicas: Replicas | None = None,
) -> list[dict[str, Any]]:
    """N backlogged tenants of unequal weights: each offered `overload` × the largest share,
    admission waits up to 30 s; shares over the minute after the warm-up (over `replicas`'
    queues when given: issue 33's shares across replicas)."""
    rows: list[dict[str, Any]] = []
    for n in sizes:
        ws = weights_for(n)
        top = max(ws) / sum(ws)
        mix = tuple(TenantLoad(f"t{i:04d}", w, overload * top * cap_rps) for i, w in enumerate(ws))
        weights = {t.name: t.weight for t in mix}
        for label, policy, kwargs in POLICIES:
            _, res = run_mix(setup, mix, policy, pool, kwargs, replicas, max_wait_s=30.0)
            dev = share_deviation(setup, res, weights, setup.warmup_s, setup.duration_s)
            rows.append({"tenants": n, "policy": label, "offered_rps": len(mix) * mix[0].rate,
                         **dev})  # fmt: skip
    return rows


# -- the report --------------------------------------------------------------------------------


def isolation_table(rows: Sequence[dict[str, Any]]) -> str:
    head = (
        "| order | victim TTFT p99 solo → flood (s) | ratio | victim goodput solo → flood "
        "(req/s) | ratio | victim 429s | aggressor served (req/s) | aggressor 429s |\n"
        "|---|---|---|---|---|---|---|---|"
    )
    lines = [head]
    for r in rows:
        s, v, a = r["solo"], r["victim"], r["aggressor"]
        lines.append(
            f"| {r['policy']} | {s['ttft_p99_s']:.3f} → {v['ttft_p99_s']:.3f} "
            f"| {r['ttft_p99_ratio']:.2f} | {s['goodput_rps']:.2f} → {v['goodput_rps']:.2f} "
            f"| {r['goodput_ratio']:.2f} | {v['rejected']} | {a['served_rps']:.2f} "
            f"| {a['rejected']} |"
        )
    return "\n".join(lines)


def convergence_table(rows: Sequence[dict[str, Any]]) -> str:
    head = (
        "| tenants | order | max rel. deviation, units | max rel. deviation, requests "
        "| admitted | fewest admitted / tenant | tenants never admitted |\n"
        "|---|---|---|---|---|---|---|"
    )
    lines = [head]
    for r in rows:
        lines.append(
            f"| {r['tenants']} | {r['policy']} | {r['units_max_dev']:.1%} "
            f"| {r['requests_max_dev']:.1%} | {r['admitted']:.0f} "
            f"| {r['min_requests_per_tenant']:.0f} | {r['unserved_tenants']:.0f} |"
        )
    return "\n".join(lines)


_PLACED = {
    "one": "one replica",
    "spread": "both tenants spread over both replicas",
    "split": "victim on replica 1, aggressor on replica 2",
}


def placements_table(rows: Sequence[dict[str, Any]]) -> str:
    head = (
        "| order, where the tenants' requests land | fair share | victim goodput solo → flood "
        "(req/s) | ratio | victim TTFT p99 solo → flood (s) | ratio | aggressor served (req/s) "
        "| total work vs aggressor alone | preemptions / 1k | targets (goodput, p99, work) |\n"
        "|---|---|---|---|---|---|---|---|---|---|"
    )
    lines = [head]
    for r in rows:
        s, v, a, t = r["solo"], r["victim"], r["aggressor"], r["targets"]
        met = ", ".join("met" if t[k] else "**not met**" for k in t)
        lines.append(
            f"| {r['policy']}, {_PLACED[r['placement']]} | {r['replicas']} "
            f"| {s['goodput_rps']:.2f} → {v['goodput_rps']:.2f} | {r['goodput_ratio']:.2f} "
            f"| {s['ttft_p99_s']:.3f} → {v['ttft_p99_s']:.3f} | {r['ttft_p99_ratio']:.1f} "
            f"| {a['served_rps']:.2f} | {r['work_ratio']:.2f} | {r['preemptions_per_1k']:.1f} "
            f"| {met} |"
        )
    return "\n".join(lines)


def preemption_reasons_table(rows: Sequence[dict[str, Any]]) -> str:
    """The placements' preemptions per 1,000 requests by why (the router's reasons)."""
    head = (
        "| order, where the tenants' requests land | fair share | growth / 1k "
        "| fair_share / 1k | priority / 1k |\n|---|---|---|---|---|"
    )
    lines = [head]
    for r in rows:
        by = r["preemptions_per_1k_by_reason"]
        lines.append(
            f"| {r['policy']}, {_PLACED[r['placement']]} | {r['replicas']} "
            f"| {by['growth']:.1f} | {by[FAIR_SHARE]:.1f} | {by[PRIORITY]:.1f} |"
        )
    return "\n".join(lines)


def run(setup: FloodSetup, sizes: Sequence[int]) -> dict[str, Any]:
    """Everything the section of docs/benchmarks.md shows: capacity, isolation, convergence."""
    pool = setup.lengths()
    cap = capacity(setup, pool)
    return {
        "capacity_rps": cap,
        "isolation": isolation(setup, pool, cap),
        "convergence": convergence(setup, pool, cap, sizes),
    }


def report(data: dict[str, Any]) -> str:
    return (
        f"capacity (one tenant flooding, fifo, 30 s wait): {data['capacity_rps']:.1f} req/s\n\n"
        f"{isolation_table(data['isolation'])}\n\n{convergence_table(data['convergence'])}"
    )
