"""Figures of the hostile scenarios, computed from what was measured outside the router.

reservations(samples)   per decode worker: peak reserved blocks vs capacity (the store's kept
                        sum, sampled every ~100 ms), time over capacity, and growth past
                        capacity per reservation: a reservation whose blocks went up between
                        two samples while its worker's sum was above capacity was grown past
                        it (forced). It is a *late* one when it was first seen after its
                        worker had already been above capacity once: admission put it there
                        after forced growth had shown that worker's estimates short (not a
                        sequence resident when the worker first filled up).
clients(results, t0)    ok / 429 / other, TTFT p50/p99, the first 429's time after t0 and
                        how long the 429s made their clients wait
format_report(report)   the text the command prints
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

from disagg_tools.loadgen.hostile_cluster import StoreSample
from disagg_tools.loadgen.loadclient import (
    Result,
    failure_examples,
    failure_kinds,
    outcome_counts,
    percentiles,
)

__all__ = ["clients", "format_report", "reservations"]


def _r(value: float | None, digits: int = 3) -> float | None:
    return None if value is None else round(value, digits)


def reservations(samples: Sequence[StoreSample], t_from: float = 0.0) -> dict[str, Any]:
    samples = [s for s in samples if s.t >= t_from]
    if not samples:
        return {"samples": 0, "workers": {}}
    gaps = sorted(b.t - a.t for a, b in zip(samples, samples[1:], strict=False)) or [0.0]
    workers: dict[str, Any] = {}
    for wid in samples[0].reserved:
        cap = max(s.capacity.get(wid, 0) for s in samples)
        peak = max(samples, key=lambda s: s.reserved.get(wid, 0))
        over = [s for s in samples if s.reserved.get(wid, 0) > cap]
        first_over = next((i for i, s in enumerate(samples) if s.reserved.get(wid, 0) > cap), None)
        first_seen: dict[str, int] = {}  # reservation id -> index of its first sample
        grown_over: set[str] = set()
        late: set[str] = set()
        for i, s in enumerate(samples):
            holds = s.holds.get(wid, {})
            prev = samples[i - 1].holds.get(wid, {}) if i else {}
            for rid, blocks in holds.items():
                if rid not in first_seen:
                    first_seen[rid] = i
                if rid in prev and blocks > prev[rid] and s.reserved.get(wid, 0) > cap:
                    grown_over.add(rid)
                    if first_over is not None and first_seen[rid] > first_over:
                        late.add(rid)
        workers[wid] = {
            "capacity": cap,
            "peak_reserved": peak.reserved.get(wid, 0),
            "peak_ratio": round(peak.reserved.get(wid, 0) / cap, 3) if cap else None,
            "peak_at_s": round(peak.t, 1),
            "peak_reservations": len(peak.holds.get(wid, {})),
            "s_over_capacity": round(len(over) * gaps[len(gaps) // 2], 1),
            "reservations_seen": len(first_seen),
            "grown_past_capacity": len(grown_over),
            "late_grown_past_capacity": len(late),
        }
    return {
        "samples": len(samples),
        "sample_gap_s": {"p50": round(gaps[len(gaps) // 2], 3), "max": round(gaps[-1], 3)},
        "workers": workers,
    }


def clients(results: Sequence[Result], t0: float, in_flight: int = 0) -> dict[str, Any]:
    ok = [r for r in results if r.outcome == "ok"]
    shed = [r for r in results if r.outcome == "shed"]
    counts = outcome_counts(list(results))
    return {
        "requests": len(results),
        "in_flight_at_end": in_flight,  # cut short by the end of the phase, not counted
        "ok": len(ok),
        "shed_429": len(shed),
        "other": len(results) - len(ok) - len(shed),
        "outcomes": counts,
        "ttft_s": {k: _r(v) for k, v in percentiles([r.ttft_s for r in ok if r.ttft_s]).items()},
        "first_429_after_s": _r(min(r.t_end for r in shed) - t0, 2) if shed else None,
        "429_wait_s": {
            k: _r(v, 2) for k, v in percentiles([r.t_end - r.t_send for r in shed]).items()
        },
        "failure_kinds": failure_kinds(list(results), ("ok",)),
        "failure_examples": failure_examples(list(results), ("ok",), per_kind=2),
    }


def hogs(results: Sequence[Any]) -> dict[str, Any]:
    statuses = Counter(str(h.status) for h in results)
    heads = [h.head_s for h in results if h.status == 200 and h.head_s is not None]
    return {
        "clients": len(results),
        "statuses": dict(statuses),
        "admitted": len(heads),
        "head_s": {k: _r(v, 2) for k, v in percentiles(heads, (50, 100)).items()},
        "details": dict(Counter(h.detail[:60] for h in results if h.detail).most_common(4)),
    }


def _workers_lines(res: dict[str, Any]) -> list[str]:
    lines = []
    for wid, w in res.get("workers", {}).items():
        ratio = "-" if w["peak_ratio"] is None else format(w["peak_ratio"], ".0%")
        lines.append(
            f"    {wid:<4} peak {w['peak_reserved']:>6} / {w['capacity']} blocks "
            f"({ratio}) at t={w['peak_at_s']} s with {w['peak_reservations']} "
            f"reservations; over capacity {w['s_over_capacity']} s; grown past capacity "
            f"{w['grown_past_capacity']} reservations ({w['late_grown_past_capacity']} late) of "
            f"{w['reservations_seen']}"
        )
    return lines


def _client_line(name: str, c: dict[str, Any]) -> str:
    return (
        f"  {name:<15} {c['requests']} requests (+{c['in_flight_at_end']} in flight at the end): "
        f"ok {c['ok']}, 429 {c['shed_429']}, other "
        f"{c['other']}; TTFT p50/p99 {c['ttft_s'].get('p50')} / {c['ttft_s'].get('p99')} s; "
        f"first 429 at +{c['first_429_after_s']} s, 429 wait p50/p99 "
        f"{c['429_wait_s'].get('p50')} / {c['429_wait_s'].get('p99')} s"
    )


def format_report(rep: dict[str, Any]) -> str:
    lines = [
        f"disagg_tools.loadgen.hostile {rep['scenario']} commit={rep['commit']} "
        f"time_scale={rep['time_scale']} "
        f"wall={rep['wall_s']} s loadavg(1m, end)={rep['loadavg_1m']}",
        f"  spec            {rep['spec']}",
    ]
    for phase, res in rep["reservations"].items():
        lines.append(
            f"  reserved ({phase}): {res['samples']} store samples, gap {res.get('sample_gap_s')}"
        )
        lines.extend(_workers_lines(res))
    for name, c in rep["clients"].items():
        lines.append(_client_line(name, c))
        for kind, count in c["failure_kinds"].items():
            lines.append(f"      {count:6d} x {kind}")
    if "hogs" in rep:
        lines.append(f"  non-readers     {rep['hogs']}")
    if "operator" in rep:
        lines.append(f"  operator        role moves by answer: {rep['operator']}")
    for name, value in rep.get("extra", {}).items():
        lines.append(f"  {name:<15} {value}")
    lines.append(f"  router metrics  {rep['router']}")
    lines.append(f"  sim workers     {rep['sim']}")
    lines.append("  targets")
    for name, (ok, what) in rep["targets"].items():
        lines.append(f"    {'PASS' if ok else 'FAIL'}  {name}: {what}")
    for v in rep["violations"]:
        if not v.startswith("target"):
            lines.append(f"  violation       {v}")
    lines.append(
        "  RESULT          "
        + ("every target holds" if not rep["violations"] else f"{len(rep['violations'])} FAILED")
    )
    return "\n".join(lines)
