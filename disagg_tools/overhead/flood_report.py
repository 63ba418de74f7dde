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

Across replicas (issue 33; disagg_tools/overhead/flood_placement.py): `tenant_stats` per tenant
of a closed-loop run (every answer checked against the simulated worker's text), `placement_row`
a flood run against the victim's solo run and the aggressor's run alone with the issue's
targets met or not, `placement_table` the rows as markdown.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import TYPE_CHECKING, Any

from disagg_tools.loadgen.loadclient import Result
from disagg_tools.overhead.flood_load import Shot

if TYPE_CHECKING:
    from disagg_tools.overhead.flood_placement import RunResult

__all__ = [
    "markdown",
    "placement_row",
    "placement_table",
    "summarise",
    "tenant_stats",
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


# -- across replicas (issue 33): closed-loop clients, every answer checked ---------------------

# A mid-answer pause longer than this is counted: a preempted stream's (it waits for room and a
# prefill again before it resumes) or a stall (the simulated worker's tokens come every ~8 ms).
RESUME_GAP_S = 0.5


def tenant_stats(
    results: list[Result], t0: float, warmup_s: float, duration_s: float
) -> dict[str, Any]:
    """One tenant's requests sent in [warmup, duration) of a closed-loop run (each followed to
    its end): answers exact per second, TTFT, output tokens per second, every outcome, 5xx,
    429s and their Retry-After, texts not exact, streams paused mid-answer (and of them exact)."""
    window = max(1e-9, duration_s - warmup_s)
    mine = [r for r in results if warmup_s <= r.t_send - t0 < duration_s]
    ok = [r for r in mine if r.outcome == "ok"]
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    refused = [r for r in mine if r.status == 429]
    retry = sorted(float(r.retry_after or 0) for r in refused if _retry_after_ok(r.retry_after))
    paused = [r for r in mine if r.itl_s and max(r.itl_s) > RESUME_GAP_S]
    return {
        "requests": len(mine),
        "ok": len(ok),
        "ok_per_s": len(ok) / window,
        "tokens_per_s": sum(r.tokens for r in ok) / window,
        "ttft_p50_s": _pct(ttfts, 0.50),
        "ttft_p99_s": _pct(ttfts, 0.99),
        "outcomes": dict(sorted(Counter(r.outcome for r in mine).items())),
        "http_5xx": sum(1 for r in mine if (r.status or 0) >= 500),
        "rejected_429": len(refused),
        "rejected_429_with_retry_after": len(retry),
        "retry_after_s": {"min": retry[0] if retry else None, "max": retry[-1] if retry else None},
        "not_exact": sum(1 for r in mine if r.outcome in ("wrong_text", "cut")),
        "paused_streams": len(paused),
        "paused_streams_exact": sum(1 for r in paused if r.outcome == "ok"),
    }


def _stats(run: RunResult, tenant: str) -> dict[str, Any]:
    spec = run.spec
    return tenant_stats(run.results.get(tenant, []), run.t0, spec.warmup_s, spec.duration_s)


def placement_row(flood: RunResult, solo: RunResult, alone: RunResult) -> dict[str, Any]:
    """One row of the table: the flood run (flood_placement.RunResult) against the victim's solo
    run and the aggressor's run alone, and the issue's targets met or not:

        victim_goodput     victim answers/s >= 0.95 × solo
        victim_ttft_p99    victim TTFT p99 <= 1.5 × solo + 150 ms
        work_conserving    both tenants' output tokens/s >= 0.95 × the aggressor's alone
        aggressor_no_5xx   no 5xx to either tenant
        honest_429         every 429 carried a Retry-After
        texts_exact        no answer's text or end wrong (a preempted and resumed one's included)
    """
    v, a = _stats(flood, "victim"), _stats(flood, "aggressor")
    vs, aa = _stats(solo, "victim"), _stats(alone, "aggressor")
    requests = v["requests"] + a["requests"]
    ok_ratio = _ratio(v["ok_per_s"], vs["ok_per_s"])
    p99, solo_p99 = v["ttft_p99_s"], vs["ttft_p99_s"]
    p99_bound = None if solo_p99 is None else 1.5 * solo_p99 + 0.150
    work = _ratio(v["tokens_per_s"] + a["tokens_per_s"], aa["tokens_per_s"])
    spec = flood.spec
    targets = {
        "victim_goodput": ok_ratio is not None and ok_ratio >= 0.95,
        "victim_ttft_p99": p99 is not None and p99_bound is not None and p99 <= p99_bound,
        "work_conserving": work is not None and work >= 0.95,
        "aggressor_no_5xx": v["http_5xx"] == 0 and a["http_5xx"] == 0,
        "honest_429": all(s["rejected_429"] == s["rejected_429_with_retry_after"] for s in (v, a)),
        "texts_exact": v["not_exact"] == 0 and a["not_exact"] == 0,
    }
    return {
        "placement": spec.placement,
        "fairness": spec.fairness,
        "victim_mode": spec.victim_mode,
        "victim": v,
        "aggressor": a,
        "victim_solo": vs,
        "aggressor_alone": aa,
        "victim_ok_ratio": ok_ratio,
        "victim_ttft_p50_ratio": _ratio(v["ttft_p50_s"], vs["ttft_p50_s"]),
        "victim_ttft_p99_ratio": _ratio(p99, solo_p99),
        "victim_ttft_p99_bound_s": p99_bound,
        "work_ratio": work,
        "preemptions": flood.preemptions,
        "preemptions_per_1k": 1000.0 * flood.preemptions / max(1, requests),
        "dead_processes": flood.dead,
        "targets": targets,
    }


_PLACED = {
    "one": "one replica",
    "spread": "both tenants spread over both replicas",
    "split": "victim on replica 1, aggressor on replica 2",
}


def _met(ok: bool) -> str:
    return "met" if ok else "**not met**"


def placement_table(rows: list[dict[str, Any]]) -> str:
    """The issue's table, measured: one line per row, then the targets met or not per row."""
    head = [
        "| fairness, where the tenants' requests land | victim | victim ok/s (solo) | ratio "
        "| victim TTFT p50 / p99 s (solo) | p99 vs solo | aggressor ok/s (alone) "
        "| aggressor 5xx | 429s with Retry-After | preemptions / 1k req | total work vs "
        "aggressor alone | texts exact (streams paused > 0.5 s) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    lines = list(head)
    for r in rows:
        v, vs, a, aa = r["victim"], r["victim_solo"], r["aggressor"], r["aggressor_alone"]
        refused = v["rejected_429"] + a["rejected_429"]
        with_ra = v["rejected_429_with_retry_after"] + a["rejected_429_with_retry_after"]
        exact = v["not_exact"] + a["not_exact"] == 0
        paused = v["paused_streams"] + a["paused_streams"]
        lines.append(
            f"| {r['fairness']}, {_PLACED[r['placement']]} | {r['victim_mode']} "
            f"| {v['ok_per_s']:.2f} ({vs['ok_per_s']:.2f}) | {_f(r['victim_ok_ratio'], '{:.2f}')} "
            f"| {_f(v['ttft_p50_s'], '{:.2f}')} / {_f(v['ttft_p99_s'], '{:.2f}')} "
            f"({_f(vs['ttft_p50_s'], '{:.2f}')} / {_f(vs['ttft_p99_s'], '{:.2f}')}) "
            f"| ×{_f(r['victim_ttft_p99_ratio'], '{:.1f}')} "
            f"| {a['ok_per_s']:.2f} ({aa['ok_per_s']:.2f}) | {v['http_5xx'] + a['http_5xx']} "
            f"| {with_ra}/{refused} | {r['preemptions_per_1k']:.1f} "
            f"| {_f(r['work_ratio'], '{:.2f}')} | {'yes' if exact else '**NO**'} ({paused}) |"
        )
    lines += [
        "",
        "| row | victim ok/s ≥ 0.95 × solo | TTFT p99 ≤ 1.5 × solo + 150 ms | total work ≥ 0.95 "
        "× aggressor alone | no 5xx | every 429 with Retry-After | texts exact |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        t = r["targets"]
        bound = _f(r["victim_ttft_p99_bound_s"], "{:.2f}")
        lines.append(
            f"| {r['fairness']}, {r['placement']}, victim {r['victim_mode']} "
            f"| {_met(t['victim_goodput'])} ({_f(r['victim_ok_ratio'], '{:.2f}')}) "
            f"| {_met(t['victim_ttft_p99'])} ({_f(r['victim']['ttft_p99_s'], '{:.2f}')} vs "
            f"{bound} s) | {_met(t['work_conserving'])} ({_f(r['work_ratio'], '{:.2f}')}) "
            f"| {_met(t['aggressor_no_5xx'])} | {_met(t['honest_429'])} "
            f"| {_met(t['texts_exact'])} |"
        )
    return "\n".join(lines) + "\n"
