"""`disagg-router demo --plot FILE`: the demo's TTFT and ITL distributions, one figure.

Two panels of empirical CDFs, milliseconds on the x axis, each with its SLO as a vertical line
(TTFT against `--slo-ttft`; the gaps between tokens against `--slo-tpot`, the per-token SLO),
written as PNG or SVG by FILE's extension. matplotlib is the `bench` extra: `plot_problem`
says, before any cluster starts, why a plot could not be written.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from disagg_tools.replay.replayer import ReplayResult

if TYPE_CHECKING:  # matplotlib is an optional extra: imported where a plot is drawn
    from matplotlib.axes import Axes

__all__ = ["FORMATS", "plot_problem", "write_latency_plot"]

FORMATS = (".png", ".svg")
_MISSING = "disagg-router demo --plot needs matplotlib: pip install -e '.[bench]'"


def plot_problem(path: str) -> str | None:
    """The one-line reason `path` cannot be plotted to (None when it can)."""
    if Path(path).suffix.lower() not in FORMATS:
        return f"disagg-router demo --plot: {path!r} must end in .png or .svg"
    try:
        import matplotlib  # noqa: F401  (only whether it is there)
    except ImportError:
        return _MISSING
    return None


def _cdf(values: list[float]) -> tuple[list[float], list[float]]:
    data = sorted(values)
    return data, [(i + 1) / len(data) for i in range(len(data))]


def _panel(ax: Axes, values_ms: list[float], slo_ms: float, title: str, slo_label: str) -> None:
    if values_ms:
        xs, ys = _cdf(values_ms)
        ax.step(xs, ys, where="post", label=f"{len(values_ms)} samples")
    else:
        ax.text(0.5, 0.5, "no samples", transform=ax.transAxes, ha="center")
    ax.axvline(slo_ms, color="tab:red", linestyle="--", label=f"{slo_label} {slo_ms:g} ms")
    positive = [v for v in values_ms if v > 0]
    if positive and max(positive) > 100 * min(positive):
        # Sub-millisecond gaps and a tail of hundreds: linear below 1 ms, logarithmic above.
        ax.set_xscale("symlog", linthresh=1.0)
        ax.set_xlim(left=0)
    ax.set_title(title)
    ax.set_xlabel("milliseconds")
    ax.set_ylabel("fraction at or below")
    ax.set_ylim(0, 1.02)
    ax.grid(True, alpha=0.3)
    ax.legend(loc="lower right")


def write_latency_plot(
    result: ReplayResult, path: str | Path, *, slo_ttft_s: float, slo_tpot_s: float
) -> Path:
    """Write the figure of `result`'s successful requests to `path` (format by extension)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    ok = [r for r in result.records if r.outcome == "ok"]
    ttft = [r.ttft_s * 1000 for r in ok if r.ttft_s is not None]
    itl = [gap * 1000 for r in ok for gap in r.itl_s]
    fig = Figure(figsize=(11, 4.2), layout="constrained")
    FigureCanvasAgg(fig)
    left, right = fig.subplots(1, 2)
    _panel(left, ttft, slo_ttft_s * 1000, "Time to first token (CDF)", "TTFT SLO")
    _panel(right, itl, slo_tpot_s * 1000, "Inter-token latency (CDF)", "per-token SLO")
    fig.suptitle(
        f"disagg-router demo: {len(ok)} of {len(result.records)} requests ok "
        f"(time scale {result.time_scale:g}, rate scale {result.rate_scale:g})"
    )
    out = Path(path)
    fig.savefig(out, format=out.suffix.lower().lstrip("."), dpi=100)
    return out
