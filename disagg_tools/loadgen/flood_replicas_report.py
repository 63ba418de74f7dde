"""What the bench across replicas reports (issue 33; disagg_tools/loadgen/flood_replicas.py):
`tenant_stats` per tenant of a closed-loop run (every answer checked against the simulated
worker's text), `placement_table` the rows (flood_replicas.placement_row: a flood run against
the victim's solo run and the aggressor's run alone, the issue's targets met or not) as
markdown. No I/O.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

from disagg_tools.loadgen.loadclient import Result

__all__ = ["placement_table", "ratio", "tenant_stats"]


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


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def _f(x: float | None, fmt: str = "{:.3f}") -> str:
    return "–" if x is None else fmt.format(x)


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
