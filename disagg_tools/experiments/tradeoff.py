"""What the in-flight estimate corrections cost and buy (issue 20), in the cluster simulator.

    python -m disagg_tools.experiments.tradeoff
        [--workloads conv,code,mooncake,conv-shift,synth-shift]
        [--cells none,feedback,margin,both,none q0.5,both q0.5]
        [--jobs 2] [--precision 1.05] [--over 1.15] [--out bench-results]

two_sided with the online_quantile estimator, on the memory-bound shape (8B, 4 H100 prefill :
4 L40S decode), four ways (`CELLS`): no correction (the behaviour before issue 20), in-flight
feedback only (policies/overruns.py LiveOverruns: a live request past its reservation counts
as a censored sample of its class), the per-worker margin only (OverrunMargin: room held back
after forced growth), and both (the default); and the first and last at the median instead of
the p90. Workloads (`WORKLOADS`): the shared traces as `disagg_tools.experiments` runs them,
and two shifts from short to long answers with one `max_tokens` for all, so the asked-bucket
classes do not separate them and only the in-flight corrections can catch the shift:

- conv-shift: conv's slice, its second half's answers x4-x8 (seeded per row), cut at max_tokens;
- synth-shift: Poisson arrivals at 1 req/s x scale, prompts ~N(1000, 300), answers ~N(200, 40)
  then ~N(1500, 300). Both start warm on short answers, as a long-running router would.

Per (workload, cell): the goodput search (`disagg_tools.goodput`), then two fixed loads for all
cells, the no-correction cell's goodput (the knee) and `--over` times it, where forced growth
shows.
Forced growth is `overrun_unreserved` (a sequence outgrew its reservation on a worker with no
free room), `overrun_grown` the growth into free room. Prints Markdown; JSON under --out.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import random
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from disagg_tools.experiments.simruns import simulate_case
from disagg_tools.experiments.specs import SHAPES, TRACES, CaseSpec, TraceSpec
from disagg_tools.goodput import goodput
from disagg_tools.traces import TraceRequest

__all__ = ["CELLS", "WORKLOADS", "Cell", "Workload", "main", "run_cell", "shifted", "synth_shift"]

SHAPE = "8b-4p4d-l40s"  # decode memory binds here (disagg_tools/experiments/specs.py SHAPES note)


@dataclass(frozen=True, slots=True)
class Cell:
    """One way of running the router: which corrections are on, and the reserved quantile."""

    label: str
    inflight_feedback: bool
    overrun_margin: bool
    quantile: float = 0.9

    def case(self) -> CaseSpec:
        return CaseSpec(self.label, "two_sided", estimator_args={"quantile": self.quantile})

    def overrides(self) -> dict[str, Any]:
        # Preemption off: what the corrections cut is forced growth, which the router's
        # preemption (issue 31, on by default) turns into preemptions; these cells measure
        # the corrections alone, as docs/benchmarks.md's figures were (experiments/preemption.py
        # measures preemption against forced growth).
        return {
            "inflight_feedback": self.inflight_feedback,
            "overrun_margin": self.overrun_margin,
            "preemption": False,
        }


CELLS: tuple[Cell, ...] = (
    Cell("none", False, False),  # (a) before issue 20
    Cell("feedback", True, False),  # (b)
    Cell("margin", False, True),  # (c)
    Cell("both", True, True),  # (d) the default
    Cell("none q0.5", False, False, 0.5),
    Cell("both q0.5", True, True, 0.5),
)
BASE = "none"  # the cell whose goodput sets the fixed loads


@dataclass(frozen=True, slots=True)
class Workload:
    """Requests, the warm-up that pre-fills the estimator, the SLOs, and where answers shift
    (request position; None: no shift)."""

    name: str
    spec: TraceSpec
    requests: tuple[TraceRequest, ...]
    warmup: tuple[TraceRequest, ...]
    shift_at: int | None = None


def _max_tokens() -> int:
    return int(SHAPES[SHAPE].config().max_tokens)


def shifted(
    requests: Sequence[TraceRequest], *, at: int, lo: float = 4.0, hi: float = 8.0,
    max_tokens: int = 4096,
) -> list[TraceRequest]:  # fmt: skip
    """`requests` with the answers from position `at` on multiplied by a factor drawn in
    [lo, hi] (seeded by the row, so every run gets the same), cut at `max_tokens`."""
    out = list(requests[:at])
    for r in requests[at:]:
        factor = random.Random(r.index).uniform(lo, hi)
        tokens = min(max_tokens, max(1, round(r.output_tokens * factor)))
        out.append(replace(r, output_tokens=tokens))
    return out


def synth_shift(
    n: int, *, rate: float = 1.0, short: tuple[float, float] = (200, 40),
    long: tuple[float, float] | None = (1500, 300), prompt: tuple[float, float] = (1000, 300),
    seed: int = 1, first_index: int = 0,
) -> list[TraceRequest]:  # fmt: skip
    """`n` Poisson arrivals at `rate` req/s; answers ~N(short) for the first half and ~N(long)
    for the second (long=None: short throughout, a warm-up)."""
    rng = random.Random(seed)
    t, out = 0.0, []
    for i in range(n):
        t += rng.expovariate(rate)
        mu, sd = short if long is None or i < n // 2 else long
        p = max(16, round(rng.gauss(*prompt)))
        o = max(1, round(rng.gauss(mu, sd)))
        out.append(TraceRequest(t, p, o, (), first_index + i))
    return out


@functools.cache
def load_workload(name: str, limit: int | None = None) -> Workload:
    if name in TRACES:
        spec = TRACES[name]
        return Workload(name, spec, tuple(spec.load(limit)), tuple(spec.warmup()))
    if name == "conv-shift":
        spec = TRACES["conv"]
        reqs = spec.load(limit)
        at = len(reqs) // 2
        long = shifted(reqs, at=at, max_tokens=_max_tokens())
        return Workload(name, replace(spec, name=name), tuple(long), tuple(spec.warmup()), at)
    if name == "synth-shift":
        n = limit or 2000
        spec = TraceSpec(name, "", n, 2.0, 0.1)
        warm = synth_shift(2000, long=None, seed=2, first_index=10**6)
        return Workload(name, spec, tuple(synth_shift(n)), tuple(warm), n // 2)
    raise KeyError(f"unknown workload {name!r}; known: {', '.join(WORKLOADS)}")


WORKLOADS: tuple[str, ...] = (*TRACES, "conv-shift", "synth-shift")
# Where each goodput search starts: just under the knee measured once (docs/benchmarks.md),
# so a search takes ~6 probes instead of ~9 from x1. The start changes the probes, not where
# an attainment that falls with load crosses 90 %.
START: dict[str, float] = {
    "conv": 6.0, "code": 1.8, "mooncake": 1.4, "conv-shift": 1.0, "synth-shift": 4.0,
}  # fmt: skip

# -- runs -----------------------------------------------------------------------------------------


def run_cell(
    w: Workload, cell: Cell, rate_scale: float, *, shape: Any = None,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:  # fmt: skip
    """One simulator run of `cell` on `w`: its summary, with the per-1,000 rates and, for a
    shift, the attainment of the requests after it."""
    t0 = time.process_time()
    res = simulate_case(
        w.requests, shape or SHAPES[SHAPE], cell.case(), rate_scale, w.spec,
        config_overrides={**cell.overrides(), **(extra or {})}, warmup=w.warmup,
    )  # fmt: skip
    row: dict[str, Any] = {"workload": w.name, "cell": cell.label, "rate_scale": rate_scale}
    row.update(res.summary())
    n = max(1, int(row["requests"]))
    row["forced_per_1k"] = 1000 * row["overrun_unreserved"] / n
    row["grown_per_1k"] = 1000 * row["overrun_grown"] / n
    if w.shift_at is not None:
        late = [r for r in res.records if r.index >= w.shift_at]
        met = sum(r.meets(res.slo_ttft_s, res.slo_tpot_s) for r in late)
        row["after_shift_attainment"] = met / len(late) if late else 0.0
    row["cpu_s"] = time.process_time() - t0
    return row


def _base_rps(w: Workload) -> float:
    arr = [r.arrival_s for r in w.requests]
    span = max(arr) - min(arr)
    return len(arr) / span if span > 0 else 0.0


def _search_task(args: tuple[str, int | None, Cell, float]) -> dict[str, Any]:
    name, limit, cell, precision = args
    w = load_workload(name, limit)
    scale, points = goodput(
        lambda s: float(run_cell(w, cell, s)["slo_attainment"]),
        start=START.get(name, 1.0),
        precision=precision,
    )
    out = {"workload": name, "cell": cell.label, "goodput_scale": scale, "points": points}
    out.update(requests=len(w.requests), base_rps=_base_rps(w), goodput_rps=scale * _base_rps(w))
    print(f"  {name:12} {cell.label:10} goodput x{scale:.3g}", file=sys.stderr, flush=True)
    return out


def _at_task(args: tuple[str, int | None, Cell, float, str]) -> dict[str, Any]:
    name, limit, cell, scale, load = args
    return {**run_cell(load_workload(name, limit), cell, scale), "load": load}


def _nice() -> None:
    try:
        os.nice(10)
    except OSError:
        pass


def tradeoff(
    workloads: Sequence[str] = WORKLOADS, cells: Sequence[Cell] = CELLS, *,
    limit: int | None = None, precision: float = 1.05, over: float = 1.15, jobs: int = 2,
) -> dict[str, Any]:  # fmt: skip
    """Goodput of every cell on every workload, then every cell at the base cell's goodput
    ("knee") and `over` times it ("over")."""
    tasks = [(w, limit, c, precision) for w in workloads for c in cells]
    with ProcessPoolExecutor(max_workers=jobs, initializer=_nice) as pool:
        searches = list(pool.map(_search_task, tasks))
    fixed: list[tuple[str, int | None, Cell, float, str]] = []
    for w in workloads:
        base = [s for s in searches if s["workload"] == w and s["cell"] == BASE]
        knee = (base[0]["goodput_scale"] if base else 0.0) or 1.0
        fixed += [(w, limit, c, knee, "knee") for c in cells]
        fixed += [(w, limit, c, knee * over, "over") for c in cells]
    with ProcessPoolExecutor(max_workers=jobs, initializer=_nice) as pool:
        at = list(pool.map(_at_task, fixed))
    return {"shape": SHAPE, "over": over, "goodput": searches, "at_load": at}


# -- tables ---------------------------------------------------------------------------------------


def tables(data: dict[str, Any]) -> str:
    out: list[str] = []
    workloads = list(dict.fromkeys(s["workload"] for s in data["goodput"]))
    for w in workloads:
        searches = {s["cell"]: s for s in data["goodput"] if s["workload"] == w}
        rows = [r for r in data["at_load"] if r["workload"] == w]
        first = next(iter(searches.values()))
        spec = load_workload(w).spec if w in WORKLOADS else None
        slo = f"TTFT ≤ {spec.slo_ttft_s:g} s, TPOT ≤ {spec.slo_tpot_s * 1e3:g} ms" if spec else ""
        knee = next((r["rate_scale"] for r in rows if r["load"] == "knee"), 0.0)
        shift = any("after_shift_attainment" in r for r in rows)
        out.append(
            f"\n**{w} × {data['shape']}** ({first['requests']} requests, "
            f"{first['base_rps']:.2f} req/s at ×1; {slo}; fixed loads: ×{knee:.2f} "
            f"(the no-correction goodput) and ×{knee * data['over']:.2f})\n"
        )
        head = "| cell | goodput req/s (×scale) | load | SLO % |"
        head += " after shift SLO % |" if shift else ""
        head += (
            " forced growth /1k | grown /1k | preempt | rejected | TTFT p99 ms "
            "| reserved-unused M blk·s |"
        )
        out.append(head)
        out.append("|---|---:|---|" + "---:|" * (head.count("|") - 4))
        for load in ("knee", "over"):
            for r in (r for r in rows if r["load"] == load):
                s = searches.get(r["cell"], {})
                gp = (
                    f"{s['goodput_rps']:.2f} (×{s['goodput_scale']:.2f})"
                    if load == "knee" and s
                    else ""
                )
                line = f"| {r['cell']} | {gp} | ×{r['rate_scale']:.2f} "
                line += f"| {100 * r['slo_attainment']:.1f} |"
                if shift:
                    line += f" {100 * r.get('after_shift_attainment', 0.0):.1f} |"
                line += (
                    f" {r['forced_per_1k']:.1f} | {r['grown_per_1k']:.0f} | {r['preemptions']} "
                    f"| {r['rejected']} | {1e3 * r['ttft_p99_s']:,.0f} "
                    f"| {r['reserved_unused_block_s'] / 1e6:.2f} |"
                )
                out.append(line)
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m disagg_tools.experiments.tradeoff",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--cells", default=",".join(c.label for c in CELLS))
    ap.add_argument("--limit", type=int, default=None, help="requests per workload")
    ap.add_argument("--precision", type=float, default=1.05, help="goodput bisection hi/lo")
    ap.add_argument("--over", type=float, default=1.15, help="second load, × the knee")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--out", default="bench-results")
    ap.add_argument("--tables", action="store_true", help="redraw from the JSON under --out")
    ns = ap.parse_args(argv)
    path = Path(ns.out) / "tradeoff.json"
    if ns.tables:
        print(tables(json.loads(path.read_text())))
        return 0
    names = [w for w in ns.workloads.split(",") if w]
    for w in names:
        if w not in WORKLOADS:
            ap.error(f"unknown workload {w!r}; known: {', '.join(WORKLOADS)}")
    want = [c for c in ns.cells.split(",") if c]
    cells = [c for c in CELLS if c.label in want]
    if len(cells) != len(want) or not any(c.label == BASE for c in cells):
        ap.error(f"cells: a subset of {', '.join(c.label for c in CELLS)}, including {BASE!r}")
    t0 = time.perf_counter()
    data = tradeoff(
        names, cells, limit=ns.limit, precision=ns.precision, over=ns.over, jobs=ns.jobs
    )
    data["wall_s"] = time.perf_counter() - t0
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1))
    print(tables(data))
    print(f"\n({data['wall_s']:.0f} s wall; JSON: {path})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
