"""Numbers, tables and plots from a replay.

Latencies (TTFT, TPOT, ITL, end-to-end) are taken over requests whose outcome is `ok`; the SLO
attainment counts every request sent, so rejections, errors, timeouts and cut streams are all
misses (DistServe's definition). A request meets the SLO iff it is ok, its TTFT ≤ `slo_ttft_s`
and its TPOT ≤ `slo_tpot_s` (a one-token answer has no TPOT and passes that half). A `None` SLO
is not checked. Percentiles are `disagg_tools.simcluster.metrics.percentile` (linear between order
statistics), the one definition the simulator reports with too.

Plots use matplotlib's Agg canvas directly (no pyplot, no global backend switch) and are
skipped, with a note, when matplotlib is not installed (`pip install 'disagg-router[bench]'`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import orjson

from disagg_tools.replay.replayer import OUTCOMES, ReplayResult, RequestRecord
from disagg_tools.simcluster.metrics import percentile, percentile_sorted

__all__ = [
    "PLOTS_UNAVAILABLE",
    "meets_slo",
    "percentile",
    "plot_attainment_vs_rate",
    "plot_latency_cdfs",
    "summarize",
    "tbt_worst_mean",
    "to_markdown",
    "to_text",
    "write_report",
]

PLOTS_UNAVAILABLE = (
    "plots skipped: matplotlib is not installed (pip install 'disagg-router[bench]')"
)
_CDF_POINTS = 2000  # a CDF of millions of gaps is drawn from this many quantiles


def tbt_worst_mean(gaps: Sequence[float], worst_fraction: float = 0.10) -> float | None:
    """Mooncake's TBT: the mean of the worst `worst_fraction` of token gaps (at least one)."""
    if not gaps:
        return None
    k = max(1, math.ceil(len(gaps) * worst_fraction))
    worst = sorted(gaps, reverse=True)[:k]
    return sum(worst) / k


def meets_slo(rec: RequestRecord, slo_ttft_s: float | None, slo_tpot_s: float | None) -> bool:
    if rec.outcome != "ok" or rec.ttft_s is None:
        return False
    if slo_ttft_s is not None and rec.ttft_s > slo_ttft_s:
        return False
    tpot = rec.tpot_s
    return slo_tpot_s is None or tpot is None or tpot <= slo_tpot_s


def summarize(
    result: ReplayResult,
    *,
    slo_ttft_s: float | None = None,
    slo_tpot_s: float | None = None,
) -> dict[str, Any]:
    """A JSON-able summary of one run (seconds are real-cluster seconds)."""
    recs = result.records
    ok = [r for r in recs if r.outcome == "ok"]
    counts = result.counts()
    sent = len(recs)
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    tpot = [t for t in (r.tpot_s for r in ok) if t is not None]
    e2e = [r.e2e_s for r in ok if r.e2e_s is not None]
    gaps = [g for r in ok for g in r.itl_s]
    met = sum(meets_slo(r, slo_ttft_s, slo_tpot_s) for r in recs)
    duration = result.duration_s
    tokens = sum(r.tokens for r in recs)
    lags = [r.send_s - r.arrival_s for r in recs if r.send_s is not None]
    retry_after = [r.retry_after_s for r in recs if r.retry_after_s is not None]
    last_arrival = max((r.arrival_s for r in recs), default=0.0)
    return {
        "base_url": result.base_url,
        "model": result.model,
        "endpoint": result.endpoint,
        "time_scale": result.time_scale,
        "rate_scale": result.rate_scale,
        "duration_s": duration,
        "offered_rps": _rate(sent - 1, last_arrival) if sent > 1 else None,
        "requests": {
            "sent": sent,
            **counts,
            "accounted": sum(counts[o] for o in OUTCOMES) == sent,
        },
        "ttft_s": _dist(ttft),
        "tpot_s": _dist(tpot),
        "itl_s": _dist(gaps),
        "e2e_s": _dist(e2e),
        "tbt_worst10_mean_s": tbt_worst_mean(gaps),
        "slo": {
            "ttft_s": slo_ttft_s,
            "tpot_s": slo_tpot_s,
            "met": met,
            "attainment": met / sent if sent else None,
            "goodput_rps": _rate(met, duration),
        },
        "throughput": {
            "output_tokens": tokens,
            "output_tokens_per_s": _rate(tokens, duration),
            "ok_requests_per_s": _rate(len(ok), duration),
        },
        "retry_after_s": {"count": len(retry_after), "mean": _mean(retry_after)},
        # Tokens counted by chunks vs the server's usage: a mismatch means chunks carry several
        # tokens and the ITL figures are coarser than they look.
        "usage_mismatch": sum(
            1 for r in ok if r.usage_tokens is not None and r.usage_tokens != r.tokens
        ),
        "client_send_lag_s": {"p99": percentile(lags, 99), "max": max(lags, default=None)},
    }


def to_markdown(summary: dict[str, Any]) -> str:
    """A two-column Markdown table of the headline figures."""
    rows = [("metric", "value"), ("---", "---:")]
    rows += [(name, value) for name, value in _headline(summary)]
    return "\n".join(f"| {a} | {b} |" for a, b in rows) + "\n"


def to_text(summary: dict[str, Any]) -> str:
    """A few lines for a terminal."""
    req = summary["requests"]
    slo = summary["slo"]
    lines = [
        f"requests  sent {req['sent']}  ok {req['ok']}  rejected {req['rejected']}  "
        f"error {req['error']}  timeout {req['timeout']}  cut {req['cut']}"
        + ("" if req["accounted"] else "  (ACCOUNTING MISMATCH)"),
        f"TTFT      p50 {_ms(summary['ttft_s']['p50'])}  p90 {_ms(summary['ttft_s']['p90'])}  "
        f"p99 {_ms(summary['ttft_s']['p99'])}",
        f"ITL       p50 {_ms(summary['itl_s']['p50'])}  p90 {_ms(summary['itl_s']['p90'])}  "
        f"p99 {_ms(summary['itl_s']['p99'])}  TBT(worst 10%) {_ms(summary['tbt_worst10_mean_s'])}",
        f"TPOT      p50 {_ms(summary['tpot_s']['p50'])}  p99 {_ms(summary['tpot_s']['p99'])}",
        f"SLO       TTFT<={_s(slo['ttft_s'])} TPOT<={_s(slo['tpot_s'])}  attainment "
        f"{_pct(slo['attainment'])}  goodput {_num(slo['goodput_rps'])} req/s",
        f"through   {_num(summary['throughput']['output_tokens_per_s'])} tok/s over "
        f"{summary['duration_s']:.1f} s (time scale {summary['time_scale']:g}, "
        f"rate scale {summary['rate_scale']:g})",
    ]
    if "plots" in summary:
        plots = summary["plots"]
        lines.append(f"plots     {', '.join(plots)}" if isinstance(plots, list) else str(plots))
    return "\n".join(lines) + "\n"


def write_report(
    result: ReplayResult,
    out_dir: str | Path,
    *,
    slo_ttft_s: float | None = None,
    slo_tpot_s: float | None = None,
    plots: bool = True,
) -> dict[str, Any]:
    """Write summary.json (with every record), report.md and the CDF plots; return the summary."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    summary = summarize(result, slo_ttft_s=slo_ttft_s, slo_tpot_s=slo_tpot_s)
    if plots:
        written = plot_latency_cdfs(result, out)
        summary["plots"] = [p.name for p in written] if written is not None else PLOTS_UNAVAILABLE
    (out / "report.md").write_text(to_markdown(summary), encoding="utf-8")
    full = {"summary": summary, "run": result.to_dict()}
    (out / "summary.json").write_bytes(orjson.dumps(full, option=orjson.OPT_INDENT_2))
    return summary


def plot_latency_cdfs(result: ReplayResult, out_dir: str | Path) -> list[Path] | None:
    """ttft_cdf.png and itl_cdf.png in `out_dir`; None if matplotlib is not installed."""
    ok = [r for r in result.records if r.outcome == "ok"]
    series = {
        "ttft_cdf.png": ("TTFT (s)", [r.ttft_s for r in ok if r.ttft_s is not None]),
        "itl_cdf.png": ("inter-token gap (s)", [g for r in ok for g in r.itl_s]),
    }
    written: list[Path] = []
    for name, (label, values) in series.items():
        fig = _figure()
        if fig is None:
            return None
        ax = fig.add_subplot()
        xs, ys = _cdf(values)
        ax.plot(xs, ys)
        ax.set_xlabel(label + " (real-cluster seconds)")
        ax.set_ylabel("fraction of " + ("requests" if name.startswith("ttft") else "gaps"))
        ax.set_ylim(0, 1)
        ax.grid(True, alpha=0.3)
        ax.set_title(f"{label.split(' (')[0]} CDF, {len(values)} samples")
        path = Path(out_dir) / name
        fig.savefig(path, dpi=100)
        written.append(path)
    return written


def plot_attainment_vs_rate(
    points: Iterable[tuple[float, float]],
    path: str | Path,
    *,
    target: float = 0.9,
    xlabel: str = "rate scale",
) -> bool:
    """Plot SLO attainment (0..1) against rate; False if matplotlib is not installed."""
    fig = _figure()
    if fig is None:
        return False
    pts = sorted(points)
    ax = fig.add_subplot()
    ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o")
    ax.axhline(target, linestyle="--", color="grey", label=f"{target:.0%} target")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("SLO attainment")
    ax.set_ylim(0, 1.05)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.savefig(Path(path), dpi=100)
    return True


def _figure() -> Any:
    """A matplotlib Figure on an Agg canvas, or None without matplotlib (imported lazily)."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        return None
    fig = Figure(figsize=(6, 4), layout="tight")
    FigureCanvasAgg(fig)
    return fig


def _cdf(values: Sequence[float]) -> tuple[list[float], list[float]]:
    data = sorted(values)
    n = len(data)
    if n == 0:
        return [], []
    step = max(1, n // _CDF_POINTS)
    idx = list(range(0, n, step))
    if idx[-1] != n - 1:
        idx.append(n - 1)
    return [data[i] for i in idx], [(i + 1) / n for i in idx]


def _dist(values: Sequence[float]) -> dict[str, float | int | None]:
    data = sorted(values)  # once, not per percentile: ITL can be millions of gaps
    return {
        "count": len(data),
        "mean": _mean(data),
        "p50": percentile_sorted(data, 50),
        "p90": percentile_sorted(data, 90),
        "p99": percentile_sorted(data, 99),
    }


def _headline(s: dict[str, Any]) -> list[tuple[str, str]]:
    req, slo = s["requests"], s["slo"]
    return [
        ("requests sent", str(req["sent"])),
        (
            "ok / rejected / error / timeout / cut",
            f"{req['ok']} / {req['rejected']} / {req['error']} / {req['timeout']} / {req['cut']}",
        ),
        ("offered rate (req/s)", _num(s["offered_rps"])),
        (
            "TTFT p50 / p90 / p99",
            f"{_ms(s['ttft_s']['p50'])} / {_ms(s['ttft_s']['p90'])} / {_ms(s['ttft_s']['p99'])}",
        ),
        (
            "TPOT p50 / p90 / p99",
            f"{_ms(s['tpot_s']['p50'])} / {_ms(s['tpot_s']['p90'])} / {_ms(s['tpot_s']['p99'])}",
        ),
        (
            "ITL p50 / p90 / p99",
            f"{_ms(s['itl_s']['p50'])} / {_ms(s['itl_s']['p90'])} / {_ms(s['itl_s']['p99'])}",
        ),
        ("TBT (mean of worst 10 % gaps)", _ms(s["tbt_worst10_mean_s"])),
        ("SLO (TTFT, TPOT)", f"{_s(slo['ttft_s'])}, {_s(slo['tpot_s'])}"),
        ("SLO attainment", _pct(slo["attainment"])),
        ("goodput (req/s)", _num(slo["goodput_rps"])),
        ("throughput (output tok/s)", _num(s["throughput"]["output_tokens_per_s"])),
        ("duration (s)", f"{s['duration_s']:.1f}"),
        ("time scale / rate scale", f"{s['time_scale']:g} / {s['rate_scale']:g}"),
    ]


def _rate(count: float, seconds: float) -> float | None:
    return count / seconds if seconds > 0 else None


def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.1f} ms"


def _s(v: float | None) -> str:
    return "-" if v is None else f"{v:g} s"


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v:.1%}"


def _num(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"
