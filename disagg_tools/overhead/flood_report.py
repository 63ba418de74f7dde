"""What the flood benchmark reports: per tenant and run, from the client's `Shot`s; no I/O.

A run's measured window is [warmup, duration): requests *sent* in it count, each followed to
its end (the window's length is the rate's denominator).

    answered     200 with `[DONE]` and no error event
    goodput      answered with TTFT <= the TTFT SLO, per second of the window
    ttft p50/p99 over the answered
    statuses     every status ("error:<name>" for a request that got none)
    429s         by `code`, and how many carried a `Retry-After` (a number of seconds >= 0)

The verdict compares the victim's flood run with its solo run: TTFT p99 at most 1 + tol times
the solo one and goodput at least 1 - tol times it (the issue's 10 %); the aggressor never
answered 5xx and every 429 carried a Retry-After.

The bench across replicas (issue 33) is the load generator's:
disagg_tools/loadgen/flood_replicas.py.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

from disagg_tools.overhead.flood_load import Shot

__all__ = [
    "markdown",
    "summarise",
    "verdict",
]


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


def _retry_after_ok(value: str | None) -> bool:
    if value is None:
        return False
    try:
        return float(value) >= 0
    except ValueError:
        return False


def summarise(
    shots: list[Shot], tenant: str, warmup_s: float, duration_s: float, ttft_slo_s: float
) -> dict[str, Any]:
    window = max(1e-9, duration_s - warmup_s)
    mine = [s for s in shots if s.tenant == tenant and warmup_s <= s.sent < duration_s]
    answered = [s for s in mine if s.answered]
    ttfts = [s.ttft for s in answered if s.ttft is not None]
    statuses = Counter(str(s.status) if s.status else f"error:{s.error}" for s in mine)
    refused = [s for s in mine if s.status == 429]
    codes = Counter(s.code or "?" for s in refused)
    retry_values = sorted(
        float(s.retry_after) for s in refused if s.retry_after and _retry_after_ok(s.retry_after)
    )
    good = sum(1 for s in answered if s.ttft is not None and s.ttft <= ttft_slo_s)
    return {
        "sent": len(mine),
        "sent_per_s": len(mine) / window,
        "answered": len(answered),
        "answered_per_s": len(answered) / window,
        "goodput_per_s": good / window,
        "ttft_p50_s": _pct(ttfts, 0.50),
        "ttft_p99_s": _pct(ttfts, 0.99),
        "statuses": dict(sorted(statuses.items())),
        "http_5xx": sum(1 for s in mine if s.status >= 500),
        "no_status": sum(1 for s in mine if not s.status),
        "stream_errors": sum(1 for s in mine if s.status == 200 and s.error is not None),
        "rejected_429": len(refused),
        "rejected_429_by_code": dict(sorted(codes.items())),
        "rejected_429_with_retry_after": len(retry_values),
        "retry_after_s": {
            "min": retry_values[0] if retry_values else None,
            "median": _pct(retry_values, 0.5),
            "max": retry_values[-1] if retry_values else None,
        },
    }


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def verdict(
    solo: dict[str, Any], flood: dict[str, Any], aggr: dict[str, Any], tol: float
) -> dict[str, Any]:
    p99 = _ratio(flood["ttft_p99_s"], solo["ttft_p99_s"])
    p50 = _ratio(flood["ttft_p50_s"], solo["ttft_p50_s"])
    good = _ratio(flood["goodput_per_s"], solo["goodput_per_s"])
    all_runs = (solo, flood, aggr)
    return {
        "victim_ttft_p50_ratio": p50,
        "victim_ttft_p99_ratio": p99,
        "victim_goodput_ratio": good,
        "ttft_p99_within_tol": p99 is not None and p99 <= 1 + tol,
        "goodput_within_tol": good is not None and good >= 1 - tol,
        "no_5xx": all(r["http_5xx"] == 0 for r in all_runs),
        "every_429_had_retry_after": all(
            r["rejected_429"] == r["rejected_429_with_retry_after"] for r in all_runs
        ),
        "tolerance": tol,
    }


def _f(x: float | None, fmt: str = "{:.3f}") -> str:
    return "–" if x is None else fmt.format(x)


def markdown(report: dict[str, Any]) -> str:
    solo, flood = report["runs"]["solo"], report["runs"]["flood"]
    v = report["verdict"]
    cap = report["capacity"]
    lines = [
        f"fairness `{report['settings']['fairness']}`; capacity measured "
        f"{cap['measured_per_s']:.2f} answers/s (slots × 1/duration: {cap['nominal_per_s']:.2f}); "
        f"victim offered {report['rates']['victim']:.2f}/s, aggressor "
        f"{report['rates']['aggressor']:.2f}/s; window {report['settings']['window_s']:g} s; "
        f"TTFT SLO {report['settings']['ttft_slo_s']:g} s",
        "",
        "| run | tenant | sent/s | answered/s | goodput/s | TTFT p50 (s) | TTFT p99 (s) "
        "| statuses | 429 codes | 429 with Retry-After | Retry-After min–max (s) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    rows = [("solo", "victim", solo["victim"]), ("flood", "victim", flood["victim"])]
    rows.append(("flood", "aggressor", flood["aggressor"]))
    for run, tenant, s in rows:
        ra = s["retry_after_s"]
        lines.append(
            f"| {run} | {tenant} | {s['sent_per_s']:.2f} | {s['answered_per_s']:.2f} "
            f"| {s['goodput_per_s']:.2f} | {_f(s['ttft_p50_s'])} | {_f(s['ttft_p99_s'])} "
            f"| {_kv(s['statuses'])} | {_kv(s['rejected_429_by_code'])} "
            f"| {s['rejected_429_with_retry_after']}/{s['rejected_429']} "
            f"| {_f(ra['min'], '{:g}')}–{_f(ra['max'], '{:g}')} |"
        )
    lines += [
        "",
        f"Victim flood/solo: TTFT p50 ×{_f(v['victim_ttft_p50_ratio'], '{:.2f}')}, "
        f"p99 ×{_f(v['victim_ttft_p99_ratio'], '{:.2f}')} "
        f"({'within' if v['ttft_p99_within_tol'] else 'NOT within'} {v['tolerance']:.0%}), "
        f"goodput ×{_f(v['victim_goodput_ratio'], '{:.2f}')} "
        f"({'within' if v['goodput_within_tol'] else 'NOT within'} {v['tolerance']:.0%}); "
        f"5xx: {'none' if v['no_5xx'] else 'SOME'}; every 429 with Retry-After: "
        f"{'yes' if v['every_429_had_retry_after'] else 'NO'}.",
    ]
    return "\n".join(lines) + "\n"


def _kv(d: dict[str, int]) -> str:
    return ", ".join(f"{k}: {n}" for k, n in d.items()) or "–"
