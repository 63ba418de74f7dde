"""Elastic prefill/decode roles against fixed splits, in the cluster simulator
(docs/elastic-roles.md).

    python -m disagg_tools.experiments.elastic_roles cells [--traces conv,code,mooncake]
                                                    [--shapes 8b-2p6d,70b-4p4d]
    python -m disagg_tools.experiments.elastic_roles mix [--mix conv-mooncake,conv-code]
                                                    [--shape 8b-2p6d]
    python -m disagg_tools.experiments.elastic_roles arrangements [--traces conv,mooncake]
                                                    [--links 25,100,400]
    python -m disagg_tools.experiments.elastic_roles tables | plots   (again from the JSON
                                                    under --out)

**cells**: on each trace × shape (fixed GPU count), the goodput of (a) the peers' policies and
two_sided+online at the shape's own split, (b) two_sided+online at every split 1P:(N-1)D ..
(N-1)P:1D (the best of them is the split chosen with hindsight), (c) two_sided+online with the
`elastic` role policy, starting from the shape's split.

**mix**: one run whose traffic moves: conversation traffic, then another trace, then
conversation again, each phase's rate normalised so that every phase alone saturates at about
the same rate scale at its own best split (so no phase is idle). Goodput of every single fixed
split against elastic roles; per-window attainment and the split over time are plotted.

**arrangements**: both arrangements under one cost model, per model × link × trace: every GPU
serving both phases of its own requests (`local`, the time-shared arrangement: no transfer, a
prefill stalls that worker's decode batch), the pools at every split with KV moved over the link
(`pool`; transfers queue on the NICs), and the pools with kv_both decode workers that may also
prefill locally (`hybrid`: two_sided chooses per request), at the pool's best split.

Every run replays a **warm-up** first: the trace rows just before the measured slice, their load
ramping from 30 % to 100 % of the measured rate, not counted (the router has been serving this
traffic; an elastic router had that time to find its split, a fixed one gains nothing from it).
Goodput is DistServe's (`disagg_tools.goodput`): the highest rate scale at which >= 90 %
of the measured requests meet both their TTFT and TPOT SLO.

The simulator (`simcluster`) is a layer below bench (tests/architecture/test_layering.py).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from disagg_tools.experiments.elastic_roles_report import (
    ELASTIC,
    arrangement_table,
    at_rate_table,
    cell_table,
    plots,
    splits_table,
    switch_table,
)
from disagg_tools.experiments.long_answers import LongAnswers, long_answer_phase
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
from disagg_tools.simcluster.simulate_cli import parse_case
from disagg_tools.traces import TraceRequest, load_trace
from policies.registry import load_estimator, load_policy, load_role_policy

__all__ = ["Workload", "ramped", "mix_workload", "run", "cells", "mix", "arrangements", "main"]

RAMP_FROM = 0.3


@dataclass(frozen=True)
class Workload:
    """Requests to replay; the first `n_warm` are the ramped warm-up (not counted). `slos[i]`
    is request i's (TTFT, TPOT) SLO; `phase_of[i]` its phase index (mix shifts)."""

    name: str
    requests: list[TraceRequest]
    n_warm: int
    slos: list[tuple[float, float]]
    phase_of: list[int]
    warm_stats: list[TraceRequest]  # rows before the replay: the estimator's statistics
    config: dict[str, Any]
    phases: tuple[str, ...] = ()

    @property
    def base_rps(self) -> float:
        meas = self.requests[self.n_warm :]
        span = meas[-1].arrival_s - meas[0].arrival_s
        return len(meas) / span if span > 0 else 0.0


def _warm_rows(trace: TraceSpec) -> int:
    return min(trace.start, 1000 if (trace.limit or 0) >= 2000 else 500)


def ramped(trace: TraceSpec, limit: int | None = None) -> Workload:
    """The trace's measured slice, preceded by its warm-up rows on a 30 % -> 100 % ramp."""
    w = _warm_rows(trace)
    n = limit or trace.limit or 1000
    rows = load_trace(TRACE_DIR / trace.file, start=trace.start - w, limit=w + n)
    reqs = _restretch(rows, [1.0 / (RAMP_FROM + (1 - RAMP_FROM) * i / w) for i in range(w)])
    stats = load_trace(TRACE_DIR / trace.file, limit=trace.start - w) if trace.start > w else []
    slo = (trace.slo_ttft_s, trace.slo_tpot_s)
    return Workload(
        trace.name,
        reqs,
        w,
        [slo] * len(reqs),
        [0] * len(reqs),
        stats,
        dict(trace.config),
        (trace.name,),
    )


def _restretch(rows: Sequence[TraceRequest], stretch: Sequence[float]) -> list[TraceRequest]:
    """Rebuild arrival times from the rows' gaps, gap i multiplied by stretch[i] (1 beyond)."""
    out: list[TraceRequest] = []
    t = 0.0
    prev = rows[0].arrival_s if rows else 0.0
    for i, r in enumerate(rows):
        gap = r.arrival_s - prev
        prev = r.arrival_s
        t += gap * (stretch[i] if i < len(stretch) else 1.0)
        out.append(replace(r, arrival_s=t, index=i))
    return out


# The decode-heavy phase: conv rows, long answers (LONG_CONFIG: the phase's client max_tokens).
# LONG_RATE: the phase alone saturates its best split (1P:7D, 9.81 req/s) at conv's saturation
# scale (x21.67 at 5P:3D); calibration in long_answers.py's docstring.
LONG = "long"
LONG_RATE = 0.085
LONG_CONFIG: dict[str, Any] = {"max_tokens": LongAnswers().hi}
# What the other phases' clients ask in a mix with the long phase (the simulator's default cap):
# each row carries its own, so the estimator keeps conv's answers and the long ones apart.
SHORT_MAX_TOKENS = 4096

# A mix: (trace, first row, rows, rate multiplier); the conv phases run at the trace's own rate.
MIXES: dict[str, tuple[tuple[str, int, int, float], ...]] = {
    # Each phase alone saturates 8 H100 (8B) near the same rate scale at its own best split
    "conv-mooncake": (
        ("conv", 2000, 6000, 1.0),
        ("mooncake", 1000, 1000, 0.115),
        ("conv", 8000, 6000, 1.0),
    ),
    "conv-code": (("conv", 2000, 6000, 1.0), ("code", 2000, 1500, 0.19), ("conv", 8000, 6000, 1.0)),
    # The decode-heavy phase (issue 26): conv's arrivals and prompts with reasoning-model answers
    # (disagg_tools/experiments/long_answers.py), on conv rows the other phases do not use;
    # 3,000 rows: five or more answer lifetimes at the measured rates, decode at steady state.
    "conv-long": (
        ("conv", 2000, 6000, 1.0),
        (LONG, 14000, 3000, LONG_RATE),
        ("conv", 8000, 6000, 1.0),
    ),
}


def mix_workload(name: str) -> Workload:
    """Conversation traffic, then another trace, then conversation again (`MIXES`), each phase
    at its multiplier of its own trace's rate, after a ramped warm-up of conversation rows."""
    phases = MIXES[name]
    conv = TRACES["conv"]
    w = 1000
    rows: list[TraceRequest] = []
    stretch: list[float] = []
    slos: list[tuple[float, float]] = []
    phase_of: list[int] = []
    config: dict[str, Any] = {}
    first = [("conv", phases[0][1] - w, w, 1.0), *phases]
    has_long = any(p[0] == LONG for p in phases)
    for k, (tname, start, n, mult) in enumerate(first):
        spec = TRACES["conv" if tname == LONG else tname]
        part = load_trace(TRACE_DIR / spec.file, start=start, limit=n)
        if tname == LONG:
            part = long_answer_phase(part)
            config.update(LONG_CONFIG)
        elif has_long:
            part = [replace(r, max_tokens=SHORT_MAX_TOKENS) for r in part]
        if rows:  # continue the clock: one mean gap of the new phase between the phases
            gap = (part[-1].arrival_s - part[0].arrival_s) / max(1, len(part) - 1) / mult
            base = rows[-1].arrival_s + gap
        else:
            base = 0.0
        for i, r in enumerate(part):
            rows.append(replace(r, arrival_s=base + (r.arrival_s - part[0].arrival_s) / mult))
            stretch.append(1.0 / (RAMP_FROM + (1 - RAMP_FROM) * i / w) if k == 0 else 1.0)
            slos.append((spec.slo_ttft_s, spec.slo_tpot_s))
            phase_of.append(max(0, k - 1))
        config.update(spec.config)
    reqs = _restretch(rows, stretch)
    stats = load_trace(TRACE_DIR / conv.file, limit=phases[0][1] - w)
    if has_long:
        stats = [replace(r, max_tokens=SHORT_MAX_TOKENS) for r in stats]
    return Workload(name, reqs, w, slos, phase_of, stats, config, tuple(p[0] for p in phases))


# -- one run -------------------------------------------------------------------------------------


def run(
    wl: Workload,
    shape: ShapeSpec,
    case: CaseSpec,
    scale: float,
    *,
    role: str | None = None,
    role_args: dict[str, Any] | None = None,
    config: dict[str, Any] | None = None,
    window_s: float = 10.0,
    detail: bool = False,
) -> dict[str, Any]:
    """One simulation; attainment over the measured requests (each against its own SLOs)."""
    c = parse_case(case.case)
    overrides = {**wl.config, **(config or {})}
    if role is not None:
        overrides["elastic"] = True
    cfg = shape.config(reserve=c.reserve, on_full=c.on_full, admission=c.admission, **overrides)
    policy = load_policy(c.policy, dict(case.policy_args))
    est = load_estimator(case.estimator, dict(case.estimator_args)) if c.reserve else None
    if est is not None and est.name == "online_quantile" and wl.warm_stats:
        est = WarmEstimator.from_requests(est, wl.warm_stats, cfg.model, cfg.max_tokens)
    rp = load_role_policy(role, role_args) if role is not None else None
    ttft = max(s[0] for s in wl.slos)  # the admission queue's deadline: the loosest TTFT SLO
    t0 = time.process_time()
    res = simulate(
        wl.requests,
        cfg,
        policy,
        est,
        slo_ttft_s=ttft,
        slo_tpot_s=wl.slos[0][1],
        rate_scale=scale,
        role_policy=rp,
    )
    cpu = time.process_time() - t0
    good = n = 0
    per_phase: dict[int, list[int]] = {}
    wins: dict[int, list[int]] = {}
    for r in res.records:
        if r.index < wl.n_warm:
            continue
        slo_t, slo_p = wl.slos[r.index]
        ok = r.meets(slo_t, slo_p)
        good += ok
        n += 1
        ph = per_phase.setdefault(wl.phase_of[r.index], [0, 0])
        ph[0] += ok
        ph[1] += 1
        wn = wins.setdefault(int(r.arrival_s // window_s), [0, 0])
        wn[0] += ok
        wn[1] += 1
    s = res.summary()
    t_meas = wl.requests[wl.n_warm].arrival_s / scale if wl.n_warm < len(wl.requests) else 0.0
    measured_s = wl.requests[-1].arrival_s / scale - t_meas
    logged = res.roles["switches"] if res.roles is not None else []
    after = [x for x in logged if x["t"] >= t_meas]
    out: dict[str, Any] = {
        "scale": scale,
        "attainment": good / n if n else 0.0,
        "phase_attainment": {k: v[0] / v[1] for k, v in sorted(per_phase.items())},
        "switches": int(s.get("role_switches", 0)),
        "migrated": int(s.get("role_migrated", 0)),
        # After the warm-up: the switches started and the streams they migrated, per hour of
        # measured traffic (simulated time between the first and last measured arrival).
        "measured_s": measured_s,
        "switches_measured": len(after),
        "migrated_measured": sum(x["migrated"] for x in after),
        "n_measured": n,
        "rejected": s["rejected"],
        "ttft_p99_s": s["ttft_p99_s"],
        "itl_p99_s": s["itl_p99_s"],
        "cpu_s": cpu,
    }
    if detail:
        out["windows"] = [(k * window_s, v[1], v[0] / v[1]) for k, v in sorted(wins.items())]
        out["roles"] = res.roles
        out["t_measured_s"] = wl.requests[wl.n_warm].arrival_s / scale
    return out


# -- goodput searches ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Task:
    workload: str  # trace name or "mix:<name>"
    shape: str
    label: str
    case: CaseSpec
    n_prefill: int
    role: str | None = None
    role_args: tuple[tuple[str, Any], ...] = ()
    config: tuple[tuple[str, Any], ...] = ()
    precision: float = 1.05
    limit: int | None = None
    start: float = 1.0  # where the goodput search starts bracketing (a hint saves probes)


def _workload(name: str, limit: int | None) -> Workload:
    if name.startswith("mix:"):
        return mix_workload(name[4:])
    return ramped(TRACES[name], limit)


def _search(task: Task) -> dict[str, Any]:
    wl = _workload(task.workload, task.limit)
    base = SHAPES[task.shape]
    n = base.n_prefill + base.n_decode
    shape = replace(
        base,
        name=f"{task.n_prefill}P:{n - task.n_prefill}D",
        n_prefill=task.n_prefill,
        n_decode=n - task.n_prefill,
    )
    t0 = time.perf_counter()
    rows: dict[float, dict[str, Any]] = {}
    role_args, config = dict(task.role_args), dict(task.config)

    def at(scale: float, detail: bool = False) -> dict[str, Any]:
        return run(
            wl,
            shape,
            task.case,
            scale,
            role=task.role,
            role_args=role_args,
            config=config,
            detail=detail,
        )

    def attainment(scale: float) -> float:
        rows[scale] = at(scale)
        return float(rows[scale]["attainment"])

    scale, points = goodput(attainment, precision=task.precision, start=task.start)
    best = at(scale, detail=True) if scale > 0 else {}
    return {
        "workload": task.workload,
        "shape": task.shape,
        "label": task.label,
        "split": shape.name,
        "role": task.role,
        "base_rps": wl.base_rps,
        "goodput_scale": scale,
        "goodput_rps": scale * wl.base_rps,
        "points": points,
        "at_goodput": best,
        "wall_s": time.perf_counter() - t0,
    }


def _same_rate_task(args: tuple[str, str, int, float, int | None]) -> dict[str, Any]:
    """The best fixed split re-run at the elastic run's goodput rate, for the plots."""
    workload, shape_name, k, scale, limit = args
    wl = _workload(workload, limit)
    base = SHAPES[shape_name]
    n = base.n_prefill + base.n_decode
    shape = replace(base, n_prefill=k, n_decode=n - k)
    out = run(wl, shape, TWO_SIDED, scale, detail=True)
    out["label"] = f"fixed {k}P:{n - k}D"
    return out


def _with_same_rate(
    results: list[dict[str, Any]], jobs: int, limit: int | None = None
) -> list[dict[str, Any]]:
    """Attach to each elastic result the best fixed split run at the same (elastic) rate."""
    todo: list[tuple[dict[str, Any], tuple[str, str, int, float, int | None]]] = []
    for el in results:
        if el["label"] != ELASTIC or not el["goodput_scale"]:
            continue
        fixed = [
            r
            for r in results
            if r["label"].startswith("fixed")
            and (r["workload"], r["shape"]) == (el["workload"], el["shape"])
        ]
        if fixed:
            bf = max(fixed, key=lambda r: r["goodput_rps"])
            k = int(bf["split"].split("P")[0])
            todo.append((el, (el["workload"], el["shape"], k, el["goodput_scale"], limit)))
    with ProcessPoolExecutor(max_workers=jobs, initializer=_nice) as pool:
        for (el, _), row in zip(todo, pool.map(_same_rate_task, [t for _, t in todo]), strict=True):
            el["best_fixed_same_rate"] = row
    return results


def _nice() -> None:
    try:
        os.nice(19)
    except OSError:
        pass


def _map(tasks: Sequence[Task], jobs: int) -> list[dict[str, Any]]:
    with ProcessPoolExecutor(max_workers=jobs, initializer=_nice) as pool:
        return list(pool.map(_search, tasks))


TWO_SIDED = CaseSpec("two_sided+online", "two_sided")


def cell_tasks(
    traces: Sequence[str],
    shapes: Sequence[str],
    *,
    precision: float = 1.05,
    limit: int | None = None,
    peers: bool = True,
    fixed: bool = True,
    role_args: dict[str, Any] | None = None,
    config: dict[str, Any] | None = None,
) -> list[Task]:
    tasks: list[Task] = []
    ra = tuple(sorted((role_args or {}).items()))
    cf = tuple(sorted((config or {}).items()))
    for t in traces:
        for s in shapes:
            shape = SHAPES[s]
            n = shape.n_prefill + shape.n_decode
            if peers:
                tasks += [
                    Task(
                        t,
                        s,
                        f"peer {c.label}",
                        c,
                        shape.n_prefill,
                        precision=precision,
                        limit=limit,
                    )
                    for c in CASES
                    if c.baseline
                ]
            if fixed:
                tasks += [
                    Task(
                        t, s, f"fixed {k}P:{n - k}D", TWO_SIDED, k, precision=precision, limit=limit
                    )
                    for k in range(1, n)
                ]
            tasks.append(
                Task(
                    t,
                    s,
                    ELASTIC,
                    TWO_SIDED,
                    shape.n_prefill,
                    role=ELASTIC,
                    role_args=ra,
                    config=cf,
                    precision=precision,
                    limit=limit,
                )
            )
    return tasks


def cells(
    traces: Sequence[str], shapes: Sequence[str], *, jobs: int = 2, **kw: Any
) -> list[dict[str, Any]]:
    res = _map(cell_tasks(traces, shapes, **kw), jobs)
    return _with_same_rate(res, jobs, kw.get("limit")) if kw.get("fixed", True) else res


def mix(
    names: Sequence[str],
    shape: str,
    *,
    jobs: int = 2,
    precision: float = 1.05,
    fixed: bool = True,
    role_args: dict[str, Any] | None = None,
    config: dict[str, Any] | None = None,
    splits: Sequence[int] | None = None,
    start: float = 16.0,
) -> list[dict[str, Any]]:
    base = SHAPES[shape]
    n = base.n_prefill + base.n_decode
    ra = tuple(sorted((role_args or {}).items()))
    cf = tuple(sorted((config or {}).items()))
    tasks = []
    for m in names:
        if fixed:
            tasks += [
                Task(
                    f"mix:{m}",
                    shape,
                    f"fixed {k}P:{n - k}D",
                    TWO_SIDED,
                    k,
                    precision=precision,
                    start=start,
                )
                for k in (splits or range(1, n))
                if 0 < k < n
            ]
        tasks.append(
            Task(
                f"mix:{m}",
                shape,
                ELASTIC,
                TWO_SIDED,
                base.n_prefill,
                role=ELASTIC,
                role_args=ra,
                config=cf,
                precision=precision,
                start=start,
            )
        )
    res = _map(tasks, jobs)
    return _with_same_rate(res, jobs) if fixed else res


# The models of the arrangement study, as shapes with 8 workers each (the split is searched).
ARRANGEMENT_SHAPES = ("8b-2p6d", "70b-4p4d")
# Rate scales near the cells' goodputs: the searches start bracketing there.
START_HINTS = {
    ("conv", "8b-2p6d"): 16.0,
    ("mooncake", "8b-2p6d"): 2.0,
    ("conv", "70b-4p4d"): 8.0,
    ("mooncake", "70b-4p4d"): 1.0,
    ("code", "8b-2p6d"): 4.0,
    ("code", "70b-4p4d"): 1.0,
}


def _link_config(gbps: float, shape: str, **extra: Any) -> tuple[tuple[str, Any], ...]:
    """A per-GPU link of `gbps` (a TP worker has one NIC per GPU), transfers queueing."""
    tp = SHAPES[shape].tp_size or 1
    bw = gbps * 1e9 / 8 * tp
    cfg = {
        "link_contention": True,
        "default_link_bytes_per_s": bw,
        "links": {("prefill", "decode"): bw},
        **extra,
    }
    return tuple(sorted(cfg.items()))


def arrangements(
    traces: Sequence[str],
    links: Sequence[float],
    *,
    jobs: int = 2,
    precision: float = 1.05,
    shapes: Sequence[str] = ARRANGEMENT_SHAPES,
    splits: Sequence[int] | None = None,
) -> list[dict[str, Any]]:
    """Local (every GPU both phases) vs pools at every split vs hybrid at the best split."""
    first: list[Task] = []
    for t in traces:
        for s in shapes:
            n = SHAPES[s].n_prefill + SHAPES[s].n_decode
            for g in links:
                h = START_HINTS.get((t, s), 1.0)
                local = _link_config(g, s, local_prefill=True)
                first.append(
                    Task(
                        t,
                        s,
                        f"local @{g:g}G",
                        TWO_SIDED,
                        0,
                        precision=precision,
                        config=local,
                        start=h,
                    )
                )
                first += [
                    Task(
                        t,
                        s,
                        f"pool {k}P:{n - k}D @{g:g}G",
                        TWO_SIDED,
                        k,
                        precision=precision,
                        config=_link_config(g, s),
                        start=h,
                    )
                    for k in (splits or range(1, n))
                    if 0 < k < n
                ]
    res = _map(first, jobs)
    second: list[Task] = []
    for t in traces:
        for s in shapes:
            for g in links:
                tail = f"@{g:g}G"
                pools = [
                    r
                    for r in res
                    if (r["workload"], r["shape"]) == (t, s)
                    and r["label"].startswith("pool")
                    and r["label"].endswith(tail)
                ]
                best = max(pools, key=lambda r: r["goodput_rps"])
                k = int(best["split"].split("P")[0])
                second.append(
                    Task(
                        t,
                        s,
                        f"hybrid {best['split']} @{g:g}G",
                        TWO_SIDED,
                        k,
                        precision=precision,
                        start=best["goodput_scale"] or 1.0,
                        config=_link_config(g, s, local_prefill=True),
                    )
                )
    for r in (res := res + _map(second, jobs)):
        r["arrangement"] = r["label"].split()[0]
        r["link_gbps"] = float(r["label"].rsplit("@", 1)[1][:-1])
    return res


# The cells' best fixed split and its goodput rate scale (docs/elastic-roles.md, default link).
BEST_SPLITS = {
    ("conv", "8b-2p6d"): (5, 21.67),
    ("mooncake", "8b-2p6d"): (6, 2.49),
    ("conv", "70b-4p4d"): (6, 12.34),
    ("mooncake", "70b-4p4d"): (7, 1.30),
}


def _at_rate_task(args: tuple[str, str, str, int, float, float]) -> dict[str, Any]:
    trace, shape_name, arrangement, k, scale, gbps = args
    wl = _workload(trace, None)
    base = SHAPES[shape_name]
    n = base.n_prefill + base.n_decode
    shape = replace(base, n_prefill=k, n_decode=n - k)
    cfg = dict(_link_config(gbps, shape_name, local_prefill=arrangement != "pool"))
    row = run(wl, shape, TWO_SIDED, scale, config=cfg)
    return {
        "workload": trace,
        "shape": shape_name,
        "arrangement": arrangement,
        "split": f"{k}P:{n - k}D",
        "scale": scale,
        "link_gbps": gbps,
        "rps": scale * wl.base_rps,
        **row,
    }


def arrangements_at_rate(
    traces: Sequence[str],
    links: Sequence[float],
    *,
    jobs: int = 2,
    shapes: Sequence[str] = ARRANGEMENT_SHAPES,
) -> list[dict[str, Any]]:
    """Cheaper than goodput searches: SLO attainment of local (every GPU both phases), the pool
    at the cells' best split and hybrid at that split, all at the rate where that pool split
    reached its goodput on the default link."""
    tasks = []
    for t in traces:
        for s in shapes:
            if (t, s) not in BEST_SPLITS:
                continue
            k, scale = BEST_SPLITS[(t, s)]
            for g in links:
                tasks += [
                    (t, s, "local", 0, scale, g),
                    (t, s, "pool", k, scale, g),
                    (t, s, "hybrid", k, scale, g),
                ]
    with ProcessPoolExecutor(max_workers=jobs, initializer=_nice) as pool:
        return list(pool.map(_at_rate_task, tasks))


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m disagg_tools.experiments.elastic_roles",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument(
        "what", choices=("cells", "mix", "arrangements", "arrangements-at-rate", "tables", "plots")
    )
    ap.add_argument("--links", default="25,100,400", help="arrangements: Gb/s per GPU")
    ap.add_argument(
        "--splits",
        default=None,
        help="arrangements, mix: prefill counts of the fixed splits (default: all)",
    )
    ap.add_argument("--traces", default="conv,code,mooncake")
    ap.add_argument("--shapes", default="8b-2p6d,70b-4p4d")
    ap.add_argument("--shape", default="8b-2p6d", help="mix: the cluster shape")
    ap.add_argument("--mix", default="conv-mooncake,conv-code")
    ap.add_argument("--limit", type=int, default=None, help="cells: measured requests")
    ap.add_argument("--precision", type=float, default=1.05)
    ap.add_argument("--no-peers", action="store_true", help="cells: skip the peer policies")
    ap.add_argument("--role-args", default="{}", help="JSON: ElasticRoles arguments")
    ap.add_argument(
        "--config",
        default="{}",
        help="JSON: ClusterConfig overrides of the elastic runs (e.g. reconfig_pause_s)",
    )
    ap.add_argument("--only-elastic", action="store_true", help="cells/mix: elastic runs only")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--out", default="bench-results")
    ap.add_argument("--tag", default="")
    ap.add_argument("--img", default="docs/img")
    ns = ap.parse_args(argv)
    out = Path(ns.out)
    out.mkdir(parents=True, exist_ok=True)
    role_args = json.loads(ns.role_args)
    tag = f"-{ns.tag}" if ns.tag else ""
    if ns.what == "cells":
        res = cells(
            ns.traces.split(","),
            ns.shapes.split(","),
            jobs=ns.jobs,
            precision=ns.precision,
            limit=ns.limit,
            peers=not (ns.no_peers or ns.only_elastic),
            fixed=not ns.only_elastic,
            role_args=role_args,
            config=json.loads(ns.config),
        )
        (out / f"roles-cells{tag}.json").write_text(json.dumps(res, indent=1))
    elif ns.what == "mix":
        res = mix(
            ns.mix.split(","),
            ns.shape,
            jobs=ns.jobs,
            precision=ns.precision,
            fixed=not ns.only_elastic,
            role_args=role_args,
            config=json.loads(ns.config),
            splits=[int(x) for x in ns.splits.split(",")] if ns.splits else None,
        )
        (out / f"roles-mix{tag}.json").write_text(json.dumps(res, indent=1))
    elif ns.what == "arrangements":
        res = arrangements(
            ns.traces.split(","),
            [float(x) for x in ns.links.split(",")],
            jobs=ns.jobs,
            precision=ns.precision,
            splits=[int(x) for x in ns.splits.split(",")] if ns.splits else None,
            shapes=ns.shapes.split(","),
        )
        (out / f"roles-arrangements{tag}.json").write_text(json.dumps(res, indent=1))
    elif ns.what == "arrangements-at-rate":
        rows = arrangements_at_rate(
            ns.traces.split(","),
            [float(x) for x in ns.links.split(",")],
            jobs=ns.jobs,
            shapes=ns.shapes.split(","),
        )
        (out / f"arrangements-at-rate{tag}.json").write_text(json.dumps(rows, indent=1))
        print(at_rate_table(rows))
        return 0
    else:
        res = []
        for p in sorted(out.glob("roles-*.json")):
            part = json.loads(p.read_text())
            missing = any(r["label"] == ELASTIC and "best_fixed_same_rate" not in r for r in part)
            if ns.what == "plots" and missing:  # runs made before the same-rate comparison
                part = _with_same_rate(part, ns.jobs)
                p.write_text(json.dumps(part, indent=1))
            res += part
    if ns.what in ("cells", "mix", "tables"):
        print(cell_table(res))
        print()
        print(splits_table(res))
        print()
        print(switch_table(res))
    if ns.what in ("arrangements", "tables"):
        print()
        print(arrangement_table(res))
    if ns.what in ("cells", "mix", "plots"):
        for p in plots(res, Path(ns.img)):
            print(f"wrote {p}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
