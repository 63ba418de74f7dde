"""Scripted simulator experiments behind docs/benchmarks.md: every table there comes from one
command here (the live validation is `python -m disagg_tools.launcher.validate`).

    python -m disagg_tools.experiments policies  [--traces conv,code,mooncake]
                                                 [--shapes 8b-2p6d,70b-4p4d]
    python -m disagg_tools.experiments admission
    python -m disagg_tools.experiments scaling   [--sizes 16,64,256,1000]
    python -m disagg_tools.experiments flood     [--tenants 2,10,1000] [--duration 80]
                                                 (tenants under a flood: experiments/flood.py)
    python -m disagg_tools.experiments flood --shares 2,10,1000 [--shared-fairness]
                                                 [--shares-duration 680]
                                                 [--shares-windows 60,120,240,480]
                                                 (issue 33: shares across two replicas:
                                                 experiments/flood_shares.py)
    python -m disagg_tools.experiments flood --placements one,spread,split
                                                 [--fairness fifo,vtc] [--shared-fairness]
                                                 [--no-take-back]
                                                 (issue 33: the flood over two replicas, only)
    python -m disagg_tools.experiments preemption [--seeds 6] [--burst 40]
                                                 (a burst that overruns the estimates, the
                                                 router's preemption on and off:
                                                 experiments/preemption.py)
    python -m disagg_tools.experiments all       (the three above, then the Markdown tables)
    python -m disagg_tools.experiments tables    (every table again from the JSON under --out)
    python -m disagg_tools.experiments plots     (the PNGs again from policies.json)

Each prints Markdown tables and writes JSON (and PNG plots) under `--out` (default
`bench-results/`). The pieces: `disagg_tools.experiments.specs` (traces, shapes, cases),
`disagg_tools.experiments.simruns` (the runs), `disagg_tools.goodput` (the search),
`disagg_tools.experiments.tables` (tables and plots).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from disagg_tools.experiments import flood, flood_shares, preemption
from disagg_tools.experiments.simruns import admission_comparison, policy_comparison, scaling
from disagg_tools.experiments.specs import CASES, SHAPES, TRACES, VARIANTS
from disagg_tools.experiments.tables import (
    admission_table,
    goodput_table,
    plot_attainment,
    scaling_table,
    validation_table,
)

__all__ = ["main", "write_json"]

# -- CLI -------------------------------------------------------------------------------------------


def write_json(out: Path, name: str, data: Any) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(data, indent=1, default=_jsonable))


def _jsonable(o: Any) -> Any:
    if hasattr(o, "__dataclass_fields__"):
        return asdict(o)
    raise TypeError(type(o))


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["preemption"]:  # its own arguments (experiments/preemption.py)
        return preemption.main(args[1:])
    ap = argparse.ArgumentParser(
        prog="python -m disagg_tools.experiments",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument(
        "what", choices=("policies", "admission", "scaling", "flood", "all", "tables", "plots")
    )
    ap.add_argument("--traces", default=",".join(TRACES))
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--cases", default=None, help="comma-separated case labels (default: all)")
    ap.add_argument(
        "--limit",
        type=int,
        default=None,
        help="requests per trace (default: the slice in TRACES; scaling: the whole trace)",
    )
    ap.add_argument("--precision", type=float, default=1.05, help="goodput bisection hi/lo")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--sizes", default="16,64,256,1000")
    ap.add_argument("--scaling-rate", type=float, default=1.0)
    ap.add_argument("--per-worker-load", action="store_true")
    ap.add_argument(
        "--admission-runs",
        default=None,
        help="admission: trace:shape:rate_scale,... (default: see the function)",
    )
    ap.add_argument("--tenants", default="2,10,1000", help="flood: convergence tenant counts")
    ap.add_argument("--duration", type=float, default=80.0, help="flood: arrivals stop (s)")
    ap.add_argument("--seed", type=int, default=0, help="flood: the runs' seed")
    ap.add_argument(
        "--placements",
        default="",
        help="flood: only the runs over two replicas, these placements (one,spread,split)",
    )
    ap.add_argument(
        "--shares",
        default="",
        help="flood: only the shares across two replicas, for these tenant counts (2,10,1000)",
    )
    ap.add_argument(
        "--shares-duration",
        type=float,
        default=None,
        help="flood --shares: arrivals stop at this many seconds (default: each row's, 80); "
        "the window runs from the warm-up (20 s) to it",
    )
    ap.add_argument(
        "--shares-windows",
        default=None,
        help="flood --shares: the worst error also over the last L seconds, for these L "
        "(default: each row's)",
    )
    ap.add_argument("--fairness", default="fifo,vtc", help="flood --placements: the orders")
    ap.add_argument(
        "--shared-fairness",
        action="store_true",
        help="flood --placements/--shares: one fair share and one line for the cluster, not "
        "per replica",
    )
    ap.add_argument(
        "--no-take-back",
        action="store_true",
        help="flood --placements/--shares --shared-fairness: do not take room back (the "
        "router's fair-share and priority preemptions, on by default as in the router), to "
        "compare",
    )
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
        data = policy_comparison(
            traces, shapes, cases, limit=ns.limit, precision=ns.precision, jobs=ns.jobs
        )
        write_json(out, "policies" + ("-" + ns.tag if ns.tag else ""), data)
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
            kw["runs"] = [
                (t, sh, float(x))
                for t, sh, x in (r.split(":") for r in ns.admission_runs.split(","))
            ]
        rows = admission_comparison(limit=ns.limit, jobs=ns.jobs, **kw)
        write_json(out, "admission" + ("-" + ns.tag if ns.tag else ""), rows)
        print(admission_table(rows), flush=True)
    if ns.what in ("scaling", "all"):
        sizes = [int(x) for x in ns.sizes.split(",")]
        rows = scaling(
            sizes, limit=ns.limit, rate_scale=ns.scaling_rate, per_worker_load=ns.per_worker_load
        )
        write_json(out, "scaling" + ("-per-worker" if ns.per_worker_load else ""), rows)
        print(scaling_table(rows), flush=True)
    if ns.what == "flood" and ns.shares:
        setup = flood.FloodSetup(seed=ns.seed)
        pool = setup.lengths()
        cap = flood.capacity(setup, pool)
        runs = [flood_shares.DEFAULT_RUNS.get(n) or flood_shares.SharesRun(n) for n in
                (int(x) for x in ns.shares.split(",") if x)]  # fmt: skip
        if ns.shares_duration is not None:
            runs = [replace(r, duration_s=ns.shares_duration) for r in runs]
        if ns.shares_windows is not None:
            windows = tuple(float(x) for x in ns.shares_windows.split(",") if x)
            runs = [replace(r, windows_s=windows) for r in runs]
        share_rows = flood_shares.shares_across_replicas(
            setup,
            pool,
            cap,
            runs,
            shared=ns.shared_fairness,
            take_back=ns.shared_fairness and not ns.no_take_back,
        )
        tag = ("-shared" if ns.shared_fairness else "") + (
            "-no-take-back" if ns.shared_fairness and ns.no_take_back else ""
        )
        write_json(out, "flood-shares" + tag + ("-" + ns.tag if ns.tag else ""), share_rows)
        print(f"capacity {cap:.1f} req/s\n\n" + flood_shares.shares_table(share_rows), flush=True)
    elif ns.what == "flood" and ns.placements:
        setup = flood.FloodSetup(duration_s=ns.duration, seed=ns.seed)
        pool = setup.lengths()
        cap = flood.capacity(setup, pool)
        rows = flood.placements(
            setup,
            pool,
            cap,
            [p for p in ns.placements.split(",") if p],
            policies=[f for f in ns.fairness.split(",") if f],
            shared=ns.shared_fairness,
            take_back=not ns.no_take_back,
        )
        tag = ("-shared" if ns.shared_fairness else "") + (
            "-no-take-back" if ns.no_take_back else ""
        )
        write_json(out, "flood-placements" + tag + ("-" + ns.tag if ns.tag else ""), rows)
        print(f"capacity {cap:.1f} req/s\n\n" + flood.placements_table(rows), flush=True)
    elif ns.what == "flood":
        setup = flood.FloodSetup(duration_s=ns.duration, seed=ns.seed)
        fdata = flood.run(setup, [int(x) for x in ns.tenants.split(",") if x])
        write_json(out, "flood" + ("-" + ns.tag if ns.tag else ""), fdata)
        print(flood.report(fdata), flush=True)
    if ns.what == "plots":  # again from policies.json, without re-running anything
        data = json.loads((out / "policies.json").read_text())
        for t, s in sorted({(r["trace"], r["shape"]) for r in data["goodput"]}):
            spec = TRACES[t]
            slo = f"TTFT ≤ {spec.slo_ttft_s:g} s, TPOT ≤ {spec.slo_tpot_s * 1e3:g} ms"
            plot_attainment(data["goodput"], t, s, Path(ns.img) / f"attainment-{t}-{s}.png", slo)
    if ns.what == "tables":
        for name, fmt in (
            ("policies", goodput_table),
            ("admission", admission_table),
            ("scaling", scaling_table),
            ("validate", validation_table),
        ):
            for p in sorted(out.glob(f"{name}*.json")):
                print(f"\n### {p.stem}\n")
                print(fmt(json.loads(p.read_text())))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
