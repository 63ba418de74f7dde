"""The Markdown tables and attainment plots of the experiments (experiments_cli,
launcher.validate), from their result dicts, so `tables` and `plots` can redraw them from JSON."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from disagg_tools.experiments.specs import TRACES

__all__ = [
    "admission_table",
    "goodput_table",
    "plot_attainment",
    "scaling_table",
    "validation_table",
]

# -- plots and tables ------------------------------------------------------------------------------


def plot_attainment(
    results: Sequence[dict[str, Any]], trace: str, shape: str, path: Path, slo: str = ""
) -> bool:
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
        ax.plot(
            [s * r["base_rps"] for s, _ in pts],
            [a for _, a in pts],
            style,
            marker="o",
            markersize=3,
            label=f"{r['case']} ({r['goodput_rps']:.1f} req/s)",
        )
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
    combos = sorted(
        {(r["trace"], r["shape"]) for r in data["goodput"]},
        key=lambda ts: (list(TRACES).index(ts[0]) if ts[0] in TRACES else 99, ts[1]),
    )
    for t, s in combos:
        rows = [r for r in data["goodput"] if r["trace"] == t and r["shape"] == s]
        best_base = max((r["goodput_rps"] for r in rows if r["baseline"]), default=0.0)
        spec = TRACES.get(t)
        slo = f"TTFT ≤ {spec.slo_ttft_s:g} s, TPOT ≤ {spec.slo_tpot_s * 1e3:g} ms" if spec else ""
        common = next(
            (keyed[(t, s, r["case"])]["rate_scale"] for r in rows if (t, s, r["case"]) in keyed),
            None,
        )
        out.append(
            f"\n**{t} × {s}** ({rows[0]['requests']} requests, {rows[0]['base_rps']:.2f} "
            f"req/s at ×1; {slo}; latency columns at the best baseline's goodput, "
            f"×{common:.2f})\n"
        )
        out.append(
            "| policy | goodput req/s (×scale) | vs best baseline | SLO % | TTFT p99 ms "
            "| ITL p99 ms | rejected | preempt | refused handoffs | stranded GB·s "
            "| reserved-unused M blk·s |"
        )
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
    out = [
        "| trace × shape | rate | admission | rejected | SLO % | admitted on forecast "
        "| TTFT p99 ms | preempt |",
        "|---|---:|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        out.append(
            f"| {r['trace']} × {r['shape']} | ×{r['rate_scale']:g} | {r['case']} "
            f"| {r['rejected']} | {100 * r['slo_attainment']:.1f} "
            f"| {int(r['admitted_on_forecast'])} | {_ms(r['ttft_p99_s'])} "
            f"| {r['preemptions']} |"
        )
    return "\n".join(out)


def scaling_table(rows: Sequence[dict[str, Any]]) -> str:
    out = [
        "| workers (P+D) | rate | requests | events | wall s | CPU s | events/CPU-s "
        "| events/wall-s | SLO % |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        out.append(
            f"| {r['workers']} ({r['prefill']}+{r['decode']}) | ×{r['rate_scale']:g} "
            f"| {r['requests']:,} | {r['events']:,} | {r['wall_s']:.1f} "
            f"| {r.get('cpu_s', float('nan')):.1f} "
            f"| {r.get('events_per_cpu_s', float('nan')):,.0f} "
            f"| {r['events_per_s']:,.0f} | {100 * r['slo_attainment']:.1f} |"
        )
    return "\n".join(out)


def validation_table(v: dict[str, Any]) -> str:
    def pct(d: float | None) -> str:
        return "" if d is None else f"{100 * d:+.1f} %"

    cols = [
        ("sim_s", "rel_diff", "simulator (cost model)"),
        ("mirror_s", "rel_diff_mirror", "sim + live mechanics"),
        ("cal_s", "rel_diff_cal", "sim + mechanics + overheads"),
    ]
    cols = [c for c in cols if v["rows"] and c[0] in v["rows"][0]]
    head = "| metric | live (router + sim workers) ms |" + "".join(
        f" {name} ms | vs live |" for _, _, name in cols
    )
    out = [head, "|---|---:|" + "---:|---:|" * len(cols)]
    for r in v["rows"]:
        out.append(
            f"| {r['metric']} | {1e3 * (r['live_s'] or 0):.1f} |"
            + "".join(f" {1e3 * r[k]:.1f} | {pct(r.get(d))} |" for k, d, _ in cols)
        )
    return "\n".join(out)
