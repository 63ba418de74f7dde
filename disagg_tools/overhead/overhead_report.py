"""Numbers and tables of `disagg_tools.overhead`: per-run summaries, added latency, Markdown.

A run is one target (baseline, a router) at one concurrency and one answer length. Its
summary holds TTFT (p50, p90, p99, p99.9) and inter-token-gap percentiles over the measured
answers (warm-up answers excluded), tokens/s over the measured window, and the router's CPU
during the run: seconds per 1,000 tokens it relayed (what streaming costs) and milliseconds
per request it served (what a request's fixed work costs: parsing, placement, the prefill
leg, the store's round trips), both over every answer of the run, warm-up included, as the
CPU is.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from disagg_tools.overhead.overhead_client import StreamRecord
from disagg_tools.simcluster.metrics import percentile

__all__ = [
    "percentile",
    "summarize",
    "add_deltas",
    "markdown",
    "TARGETS_256",
    "verdicts",
    "replace_between_markers",
]

BEGIN, END = "<!-- overhead:begin -->", "<!-- overhead:end -->"

# issue 6, "Router overhead": at 256 streams of 128 tokens at 20 ms per token.
TARGETS_TOKENS = 128
TARGETS_256 = {
    "added_ttft_p50_ms": 1.0,
    "added_ttft_p99_ms": 3.0,
    "cpu_s_per_1k_tokens": 0.025,
    "saturation_tokens_per_core_s": 80_000.0,
}


def _ms(x: float | None) -> float | None:
    return None if x is None else round(x * 1e3, 3)


def summarize(
    records: Iterable[StreamRecord],
    *,
    max_tokens: int,
    wall_s: float,
    window_s: float,
    router_cpu_s: float | None,
    client_cpu_s: float,
    worker_cpu_s: float,
) -> dict[str, Any]:
    records = list(records)
    measured = [r for r in records if not r.warmup]
    ok = [
        r
        for r in measured
        if r.error is None and r.status == 200 and r.done and r.tokens == max_tokens
    ]
    ttft = [r.ttft for r in ok if r.ttft is not None]
    gaps: list[float] = []
    for r in ok:
        gaps.extend(r.gaps())
    all_tokens = sum(r.tokens for r in records)
    measured_tokens = sum(r.tokens for r in measured)
    errors: dict[str, int] = {}
    ok_ids = {id(r) for r in ok}
    for r in measured:
        if id(r) not in ok_ids:
            key = (r.error or f"status={r.status} done={r.done} tokens={r.tokens}")[:80]
            errors[key] = errors.get(key, 0) + 1
    out: dict[str, Any] = {
        "requests": len(measured),
        "complete": len(ok),
        "warmup_requests": len(records) - len(measured),
        "errors": errors,
        # p99.9: the tail a user of a busy deployment meets once in a thousand answers (with
        # fewer than 1,000 answers it lies between the two slowest).
        "ttft_ms": {f"p{q}": _ms(percentile(ttft, q)) for q in (50, 90, 99, 99.9)},
        "itl_ms": {f"p{q}": _ms(percentile(gaps, q)) for q in (50, 90, 99)},
        "itl_samples": len(gaps),
        "tokens_all": all_tokens,
        "tokens_measured": measured_tokens,
        "wall_s": round(wall_s, 3),
        "window_s": round(window_s, 3),
        "tokens_per_s": round(measured_tokens / window_s, 1) if window_s > 0 else None,
        "client_cpu_s": round(client_cpu_s, 3),
        "client_cpu_util": round(client_cpu_s / wall_s, 3) if wall_s > 0 else None,
        "worker_cpu_s": round(worker_cpu_s, 3),
        "router_cpu_s": None if router_cpu_s is None else round(router_cpu_s, 3),
        "router_cpu_util": (
            None if router_cpu_s is None or wall_s <= 0 else round(router_cpu_s / wall_s, 3)
        ),
        "cpu_s_per_1k_tokens": (
            None
            if router_cpu_s is None or not all_tokens
            else round(router_cpu_s / all_tokens * 1000, 4)
        ),
        "cpu_ms_per_request": (
            None
            if router_cpu_s is None or not records
            else round(router_cpu_s / len(records) * 1000, 4)
        ),
    }
    if router_cpu_s:
        out["tokens_per_router_cpu_s"] = round(all_tokens / router_cpu_s, 0)
    return out


def _rung(r: dict[str, Any]) -> tuple[int | None, int]:
    """(answer tokens, concurrency): what a router's run is compared with the baseline at."""
    return r.get("max_tokens"), r["concurrency"]


def add_deltas(runs: list[dict[str, Any]]) -> None:
    """Added TTFT and ITL against the baseline run of the same concurrency and answer length,
    in place."""
    base = {_rung(r): r for r in runs if r["target"] == "baseline"}
    for r in runs:
        b = base.get(_rung(r))
        if b is None or r["target"] == "baseline":
            continue
        for metric in ("ttft_ms", "itl_ms"):
            r["added_" + metric] = {
                q: (
                    None
                    if r[metric][q] is None or b[metric][q] is None
                    else round(r[metric][q] - b[metric][q], 3)
                )
                for q in r[metric]
            }


def _f(x: Any, digits: int = 2) -> str:
    if x is None:
        return "–"
    if isinstance(x, float):
        return f"{x:.{digits}f}"
    return str(x)


def _signed(x: Any, digits: int = 2) -> str:
    return "–" if x is None else f"{x:+.{digits}f}"


def _pct(x: Any) -> str:
    return "–" if x is None else f"{x * 100:.0f} %"


def _ladder_heading(tokens: int | None, c: int) -> str:
    streams = f"{c} concurrent stream{'s' if c > 1 else ''}"
    return f"#### {streams}" if tokens is None else f"#### {streams}, {tokens}-token answers"


_LADDER_HEAD = [
    "| target | answer tokens | ok / sent | TTFT p50 | TTFT p99 | TTFT p99.9 "
    "| **added TTFT p50** | **added TTFT p99** | **added TTFT p99.9** | ITL p50 | ITL p99 "
    "| added ITL p50 / p99 | tokens/s | router CPU util | **router CPU-s / 1k tokens** "
    "| **router CPU-ms / request** | router CPU in the kernel |",
    "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
]


def _ladder_row(r: dict[str, Any]) -> str:
    ttft = r["ttft_ms"]
    add_t = r.get("added_ttft_ms", {})
    add_i = r.get("added_itl_ms", {})
    return (
        f"| {r['target']} | {_f(r.get('max_tokens'))} | {r['complete']} / {r['requests']} "
        f"| {_f(ttft['p50'])} | {_f(ttft['p99'])} | {_f(ttft.get('p99.9'))} "
        f"| {_signed(add_t.get('p50'))} | {_signed(add_t.get('p99'))} "
        f"| {_signed(add_t.get('p99.9'))} "
        f"| {_f(r['itl_ms']['p50'])} | {_f(r['itl_ms']['p99'])} "
        f"| {_signed(add_i.get('p50'))} / {_signed(add_i.get('p99'))} "
        f"| {_f(r['tokens_per_s'], 0)} | {_f(r['router_cpu_util'])} "
        f"| {_f(r['cpu_s_per_1k_tokens'], 4)} | {_f(r.get('cpu_ms_per_request'), 3)} "
        f"| {_pct(r.get('router_kernel_share'))} |"
    )


def markdown(result: dict[str, Any]) -> str:
    lines: list[str] = []
    runs = result["runs"]
    # One table per (answer length, concurrency): the short answers' ladder first.
    for rung in sorted({_rung(r) for r in runs}, key=lambda k: (k[0] or 0, k[1])):
        lines += [_ladder_heading(*rung), "", *_LADDER_HEAD]
        lines += [_ladder_row(r) for r in runs if _rung(r) == rung]
        lines.append("")
    sat = result.get("saturation") or []
    if sat:
        p = result["params"]
        lines += [
            "#### Saturation",
            "",
            f"{p['sat_concurrency']} streams of {p['sat_tokens']} tokens, one token every "
            f"{p['sat_interval_ms']} ms (offered "
            f"{p['sat_concurrency'] * 1000 / p['sat_interval_ms']:,.0f} tokens/s).",
            "",
            "| target | ok / sent | tokens/s relayed | router CPU util | "
            "router CPU-s / 1k tokens | **tokens per router CPU-second** | "
            "client CPU util | workers CPU util | ITL p50 | ITL p99 | "
            "router CPU-ms / request (whole run) |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for r in sat:
            lines.append(
                f"| {r['target']} | {r['complete']} / {r['requests']} "
                f"| {_f(r['tokens_per_s'], 0)} | {_f(r['router_cpu_util'])} "
                f"| {_f(r['cpu_s_per_1k_tokens'], 4)} | {_f(r.get('tokens_per_router_cpu_s'), 0)} "
                f"| {_f(r['client_cpu_util'])} "
                f"| {_f(r['worker_cpu_s'] / r['wall_s'] if r['wall_s'] else None)} "
                f"| {_f(r['itl_ms']['p50'])} | {_f(r['itl_ms']['p99'])} "
                f"| {_f(r.get('cpu_ms_per_request'), 3)} |"
            )
        lines.append("")
    v = verdicts(result)
    if v:
        lines += [
            f"#### Against the targets (256 streams, {_verdict_tokens(result['runs'])}-token "
            "answers)",
            "",
            "| target | added TTFT p50 ≤ 1 ms | added TTFT p99 ≤ 3 ms | added TTFT p99.9 | "
            "ITL p50 / p99 added | CPU-s / 1k tokens ≤ 0.025 | CPU-ms / request | "
            "≥ 80k tokens per core-s |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for name, row in v.items():
            lines.append(
                f"| {name} | {row['ttft_p50']} | {row['ttft_p99']} | {row['ttft_p999']} "
                f"| {row['itl']} | {row['cpu']} | {row['cpu_request']} | {row['sat']} |"
            )
        lines.append("")
    return "\n".join(lines)


def _mark(value: float | None, limit: float, fmt: str, higher_is_better: bool = False) -> str:
    if value is None:
        return "–"
    ok = value >= limit if higher_is_better else value <= limit
    return ("✅ " if ok else "❌ ") + fmt.format(value)


def _verdict_tokens(runs: list[dict[str, Any]]) -> int | None:
    """The answer length the targets are judged at: theirs (128 tokens) when it was run,
    else the first length of the ladder."""
    lengths = [r.get("max_tokens") for r in runs]
    return TARGETS_TOKENS if TARGETS_TOKENS in lengths else (lengths[0] if lengths else None)


def verdicts(result: dict[str, Any]) -> dict[str, dict[str, str]]:
    out: dict[str, dict[str, str]] = {}
    sat = {r["target"]: r for r in result.get("saturation") or []}
    tokens = _verdict_tokens(result["runs"])
    for r in result["runs"]:
        if r["concurrency"] != 256 or r["target"] == "baseline":
            continue
        if r.get("max_tokens") != tokens:
            continue
        add_t = r.get("added_ttft_ms", {})
        add_i = r.get("added_itl_ms", {})
        s = sat.get(r["target"], {})
        out[r["target"]] = {
            "ttft_p50": _mark(add_t.get("p50"), TARGETS_256["added_ttft_p50_ms"], "{:+.2f} ms"),
            "ttft_p99": _mark(add_t.get("p99"), TARGETS_256["added_ttft_p99_ms"], "{:+.2f} ms"),
            "ttft_p999": f"{_signed(add_t.get('p99.9'))} ms",
            "itl": f"{_signed(add_i.get('p50'))} / {_signed(add_i.get('p99'))} ms",
            "cpu": _mark(
                r.get("cpu_s_per_1k_tokens"), TARGETS_256["cpu_s_per_1k_tokens"], "{:.4f}"
            ),
            "cpu_request": _f(r.get("cpu_ms_per_request"), 3),
            "sat": _mark(
                s.get("tokens_per_router_cpu_s"),
                TARGETS_256["saturation_tokens_per_core_s"],
                "{:,.0f}",
                higher_is_better=True,
            ),
        }
    return out


def replace_between_markers(
    existing: str | None, block: str, begin: str = BEGIN, end: str = END
) -> str:
    """Put `block` between the markers (the overhead ones unless told) of `existing` (or make a
    fresh document)."""
    wrapped = f"{begin}\n{block}\n{end}"
    if existing and begin in existing and end in existing:
        head, _, rest = existing.partition(begin)
        _, _, tail = rest.partition(end)
        return head + wrapped + tail
    return (
        ("# Router overhead\n\n" + wrapped + "\n")
        if not existing
        else (existing.rstrip("\n") + "\n\n" + wrapped + "\n")
    )
