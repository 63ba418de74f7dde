"""The reports of disagg_tools/experiments/elastic_roles.py: its markdown tables and its plots
(docs/elastic-roles.md), from the result rows its runs write
(``python -m disagg_tools.experiments.elastic_roles tables | plots`` rebuild them from the JSON
alone)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from disagg_tools.experiments.specs import SHAPES, TRACES

__all__ = [
    "ELASTIC",
    "at_rate_table",
    "arrangement_table",
    "cell_table",
    "splits_table",
    "switch_table",
    "plot_run",
    "plots",
]

# The label of the elastic-roles run in every result row (the fixed splits are labelled by split).
ELASTIC = "elastic"


def at_rate_table(rows: Sequence[dict[str, Any]]) -> str:
    out = [
        "| trace × model | rate req/s | link Gb/s per GPU | local (time-shared) | pool "
        "| hybrid | winner |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    keys = sorted(
        {(r["workload"], r["shape"], r["link_gbps"]) for r in rows},
        key=lambda k: (k[1], k[0], k[2]),
    )
    for w, s, g in keys:
        rs = {
            r["arrangement"]: r
            for r in rows
            if (r["workload"], r["shape"], r["link_gbps"]) == (w, s, g)
        }
        att = {a: rs[a]["attainment"] for a in rs}
        win = max(att, key=lambda a: att[a])
        pool = rs.get("pool", {})
        out.append(
            f"| {w} × {s.split('-')[0]} | {pool.get('rps', 0):.2f} | {g:g} "
            f"| {att.get('local', 0):.1%} | {att.get('pool', 0):.1%} ({pool.get('split')}) "
            f"| {att.get('hybrid', 0):.1%} | {win} |"
        )
    return "\n".join(out)


def arrangement_table(results: Sequence[dict[str, Any]]) -> str:
    rows = [r for r in results if r.get("arrangement")]
    out = [
        "| trace × model | link Gb/s per GPU | local (time-shared) | best pool split "
        "| hybrid at that split | local / best pool | winner |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    keys = sorted(
        {(r["workload"], r["shape"], r["link_gbps"]) for r in rows},
        key=lambda k: (_order((k[0], k[1])), k[2]),
    )
    for w, s, g in keys:
        rs = [r for r in rows if (r["workload"], r["shape"], r["link_gbps"]) == (w, s, g)]
        loc = next((r for r in rs if r["arrangement"] == "local"), None)
        pools = [r for r in rs if r["arrangement"] == "pool"]
        hyb = next((r for r in rs if r["arrangement"] == "hybrid"), None)
        bp = max(pools, key=lambda r: r["goodput_rps"], default=None)
        lv = loc["goodput_rps"] if loc else 0.0
        pv = bp["goodput_rps"] if bp else 0.0
        hv = hyb["goodput_rps"] if hyb else 0.0
        best = max(("local", lv), ("pool", pv), ("hybrid", hv), key=lambda x: x[1])[0]
        out.append(
            f"| {w} × {s.split('-')[0]} | {g:g} | {lv:.2f} "
            f"| {pv:.2f} ({bp['split'] if bp else '-'}) | {hv:.2f} "
            f"| {lv / pv if pv else float('nan'):.2f} | {best} |"
        )
    return "\n".join(out)


# -- tables and plots ------------------------------------------------------------------------------


def cell_table(results: Sequence[dict[str, Any]]) -> str:
    """One row per (workload, shape): peers at the shape's split, the best fixed split (with
    hindsight), elastic, and the two ratios the issue's targets are about."""
    out = [
        "| trace × shape (shape's split) | best peer at the split | two_sided at the split "
        "| best fixed split (hindsight) | elastic | elastic / best peer | elastic / best fixed "
        "| switches (all; after warm-up; per h) | migrated (all; after warm-up; per h; "
        "% of requests) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    results = [r for r in results if not r.get("arrangement")]
    keys = sorted({(r["workload"], r["shape"]) for r in results}, key=_order)
    for w, s in keys:
        rs = [r for r in results if r["workload"] == w and r["shape"] == s]
        shape = SHAPES[s]
        own = f"{shape.n_prefill}P:{shape.n_decode}D"
        peers = [r for r in rs if r["label"].startswith("peer")]
        fixed = [r for r in rs if r["label"].startswith("fixed")]
        el = next((r for r in rs if r["label"] == ELASTIC), None)
        bp = max(peers, key=lambda r: r["goodput_rps"], default=None)
        ts = next((r for r in fixed if r["split"] == own), None)
        bf = max(fixed, key=lambda r: r["goodput_rps"], default=None)
        best_peer = max(bp["goodput_rps"] if bp else 0.0, ts["goodput_rps"] if ts else 0.0)

        def g(r: dict[str, Any] | None) -> str:
            return "-" if r is None else f"{r['goodput_rps']:.2f}"

        ev = el["goodput_rps"] if el else 0.0
        at = (el["at_goodput"] or {}) if el else {}
        sw, mg = _per_hour(at)
        out.append(
            f"| {w} × {s} ({own}) | {g(bp)} ({bp['label'][5:] if bp else '-'}) | {g(ts)} "
            f"| {g(bf)} ({bf['split'] if bf else '-'}) | {g(el)} "
            f"| {ev / best_peer if best_peer else float('nan'):.2f} "
            f"| {ev / bf['goodput_rps'] if bf and bf['goodput_rps'] else float('nan'):.2f} "
            f"| {sw} | {mg} |"
        )
    return "\n".join(out)


def _per_hour(at: dict[str, Any]) -> tuple[str, str]:
    """'all; after warm-up; per hour' for the switches and the migrated streams of a run."""
    if not at:
        return "-", "-"
    hours = at.get("measured_s", 0.0) / 3600.0
    sw, mg = at.get("switches_measured"), at.get("migrated_measured")
    if sw is None or not hours:  # a run recorded before these were
        return str(at.get("switches", 0)), str(at.get("migrated", 0))
    share = mg / at["n_measured"] if at.get("n_measured") else 0.0
    return (
        f"{at.get('switches', 0)}; {sw}; {sw / hours:.0f}",
        f"{at.get('migrated', 0)}; {mg}; {mg / hours:.0f}; {share:.2%}",
    )


def splits_table(results: Sequence[dict[str, Any]]) -> str:
    """Goodput (req/s) of every fixed split and elastic, per (workload, shape)."""
    results = [r for r in results if not r.get("arrangement")]
    keys = sorted({(r["workload"], r["shape"]) for r in results}, key=_order)
    splits = sorted(
        {r["split"] for r in results if r["label"].startswith("fixed")},
        key=lambda x: int(x.split("P")[0]),
    )
    out = [
        "| trace × shape | " + " | ".join(splits) + " | elastic |",
        "|---|" + "---:|" * (len(splits) + 1),
    ]
    for w, s in keys:
        rs = {
            r["split"]: r
            for r in results
            if r["workload"] == w and r["shape"] == s and r["label"].startswith("fixed")
        }
        top = max((r["goodput_rps"] for r in rs.values()), default=0.0)
        el = next(
            (
                r
                for r in results
                if r["workload"] == w and r["shape"] == s and r["label"] == ELASTIC
            ),
            None,
        )

        cells = [_bold(rs[x]["goodput_rps"], top) if x in rs else "-" for x in splits]
        tail = f"{el['goodput_rps']:.2f}" if el else "-"
        out.append(f"| {w} × {s} | " + " | ".join(cells) + f" | {tail} |")
    return "\n".join(out)


def switch_table(results: Sequence[dict[str, Any]], window_s: float = 10.0) -> str:
    """Did attainment collapse while a worker switched? Per elastic run at its goodput: the
    windows (of measured requests) that overlap a switch's drain or pause, their lowest and mean
    attainment, and the same windows of the best fixed split run at the same rate."""
    out = [
        "| trace × shape | rate req/s | switches (measured part) | drain s (median, max) "
        "| windows in a switch | elastic min / mean | best fixed, same windows: min / mean "
        "| elastic overall | fixed overall |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for el in sorted(
        (r for r in results if r["label"] == ELASTIC and r.get("at_goodput")),
        key=lambda r: _order((r["workload"], r["shape"])),
    ):
        at = el["at_goodput"]
        same = el.get("best_fixed_same_rate") or {}
        t0 = at.get("t_measured_s", 0.0)
        sws = [
            x
            for x in (at.get("roles") or {}).get("switches", [])
            if (x["active_t"] or x["t"]) >= t0
        ]
        spans = [(x["t"], x["active_t"] or x["drained_t"] or x["t"]) for x in sws]
        drains = sorted((x["drained_t"] or x["t"]) - x["t"] for x in sws)
        hit = {
            w[0] for w in at["windows"] if any(a < w[0] + window_s and b >= w[0] for a, b in spans)
        }
        ew = [w[2] for w in at["windows"] if w[0] in hit]
        fw = [w[2] for w in same.get("windows", []) if w[0] in hit]

        def mm(v: list[float]) -> str:
            return f"{min(v):.2f} / {sum(v) / len(v):.2f}" if v else "-"

        med = f"{drains[len(drains) // 2]:.1f}, {drains[-1]:.1f}" if drains else "-"
        overall = f"{at.get('attainment', 0):.3f} | {same.get('attainment', 0):.3f}"
        out.append(
            f"| {el['workload']} × {el['shape']} | {el['goodput_rps']:.2f} | {len(sws)} "
            f"| {med} | {len(hit)} | {mm(ew)} | {mm(fw)} | {overall} |"
        )
    return "\n".join(out)


def _bold(v: float, top: float) -> str:
    return f"**{v:.2f}**" if v == top and v > 0 else f"{v:.2f}"


def _order(key: tuple[str, str]) -> tuple[int, str]:
    w, s = key
    names = list(TRACES)
    return (names.index(w) if w in names else 99, w + s)


def plot_run(
    result: dict[str, Any], path: Path, title: str, compare: dict[str, Any] | None = None
) -> bool:
    """Attainment per window (measured requests) at the run's goodput scale, the split over
    time (active prefill workers) and each switch's drain and pause, for an elastic run."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    at = result.get("at_goodput") or {}
    if not at.get("windows"):
        return False
    fig, (ax, bx) = plt.subplots(
        2, 1, figsize=(8, 5.5), sharex=True, gridspec_kw={"height_ratios": [2, 1]}
    )
    xs = [w[0] for w in at["windows"]]  # simulated seconds (arrival times are scaled already)
    ax.plot(
        xs,
        [w[2] for w in at["windows"]],
        "-o",
        ms=2.5,
        label=f"{result['label']} at its goodput, {result['goodput_rps']:.1f} req/s "
        f"({at.get('attainment', 0.0):.1%} overall)",
    )
    same = result.get("best_fixed_same_rate")
    if same and same.get("windows"):
        cw = same["windows"]
        lab = f"{same['label']} at the same rate ({same['attainment']:.1%} overall)"
        ax.plot([w[0] for w in cw], [w[2] for w in cw], "--", lw=1, label=lab)
    elif compare and (compare.get("at_goodput") or {}).get("windows"):
        cw = compare["at_goodput"]["windows"]
        lab = f"{compare['label']} at its goodput {compare['goodput_rps']:.1f} req/s"
        ax.plot([w[0] for w in cw], [w[2] for w in cw], "--", lw=1, label=lab)
    ax.axhline(0.9, color="grey", ls=":", lw=1)
    if at.get("t_measured_s") is not None:
        for axis in (ax, bx):
            axis.axvline(at["t_measured_s"], color="black", lw=0.8, ls="--")
    ax.set_ylim(0, 1.03)
    ax.set_ylabel("attainment per window")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7, loc="lower left")
    ax.grid(alpha=0.3)
    roles = at.get("roles") or {}
    tl = roles.get("timeline") or []
    if tl:
        bx.step([t for t, *_ in tl], [p for _, p, *_ in tl], where="post", label="prefill (active)")
        bx.step(
            [t for t, _, d, *_ in tl],
            [d for _, _, d, *_ in tl],
            where="post",
            label="decode (active)",
        )
    for sw in roles.get("switches") or []:
        end = sw["active_t"] or sw["drained_t"] or sw["t"]
        bx.axvspan(sw["t"], end, color="orange", alpha=0.25, lw=0)
        ax.axvspan(sw["t"], end, color="orange", alpha=0.12, lw=0)
    bx.set_ylabel("workers")
    bx.set_xlabel("simulated seconds (orange: a switch draining or paused; dashed: end of warm-up)")
    bx.legend(fontsize=7, loc="upper left")
    bx.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def plots(results: Sequence[dict[str, Any]], img: Path) -> list[Path]:
    made = []
    results = [r for r in results if not r.get("arrangement")]
    for w, s in sorted({(r["workload"], r["shape"]) for r in results}):
        rs = [r for r in results if r["workload"] == w and r["shape"] == s]
        el = next((r for r in rs if r["label"] == ELASTIC), None)
        fixed = [r for r in rs if r["label"].startswith("fixed")]
        bf = max(fixed, key=lambda r: r["goodput_rps"], default=None)
        if el is None:
            continue
        path = img / f"roles-{w.replace('mix:', 'mix-')}-{s}.png"
        if plot_run(el, path, f"{w} on {s}: elastic roles", bf):
            made.append(path)
    return made


# -- CLI -------------------------------------------------------------------------------------------
