"""The overhead benchmark's `ours_tenants` target (issue 33): what configuring tenants costs.

    python -m disagg_tools.overhead --targets baseline,ours_redis,ours_tenants [--tenants 8]

`ours_tenants` is `ours_redis` (the same command, the Redis store in the path) with `--tenants`
tenants configured: weights 1, 2, 4, 1, 2, 4, ..., one key each, `admission.fairness: vtc` and
`admission.fair_cluster: true` (one fair share for the cluster, synced through Redis). The load
generator's stream slot i sends with tenant i mod N's key, so every tenant has requests in
flight. The decode room is unbounded (the ladder's workers), so nothing waits: what is measured
is the per-request cost of a tenant — the key lookup, the tenant's limits, the fairness charge
at admission and its settlement at release, the fair-share sync — against the same run without
tenants.

`tenants_markdown` puts the two targets side by side per rung: router CPU per 1,000 tokens and
per request, added TTFT p50 / p99 against the baseline, and the ratio with / without (issue 33's
target: within 10 %).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["TENANTS_TARGET", "tenant_keys", "tenant_settings", "tenants_markdown"]

TENANTS_TARGET = "ours_tenants"
_WITHOUT = "ours_redis"  # the same router and store, no tenants
_WEIGHTS = (1, 2, 4)


def tenant_keys(n: int) -> tuple[str, ...]:
    """The plain keys of the `n` tenants, tenant i's at index i (a benchmark's keys guard
    nothing; the configuration hashes them at load)."""
    return tuple(f"sk-overhead-tenant-{i}" for i in range(n))


def tenant_settings(n: int) -> dict[str, Any]:
    """The settings `ours_tenants` adds to `ours_redis`'s configuration."""
    if n < 1:
        raise ValueError(f"--tenants must be >= 1, got {n}")
    tenants = [
        {"name": f"tenant-{i}", "weight": _WEIGHTS[i % len(_WEIGHTS)],
         "keys": [{"id": f"k{i}", "key": key}]}
        for i, key in enumerate(tenant_keys(n))
    ]  # fmt: skip
    return {"tenants": tenants, "admission": {"fairness": "vtc", "fair_cluster": True}}


def _by_rung(runs: Sequence[dict[str, Any]], target: str) -> dict[tuple[Any, int], dict[str, Any]]:
    return {(r.get("max_tokens"), r["concurrency"]): r for r in runs if r["target"] == target}


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b <= 0 else a / b


def _num(x: float | None, fmt: str) -> str:
    return "–" if x is None else format(x, fmt)


def tenants_comparison(runs: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per rung both targets ran: the two CPU figures and added TTFTs, and with / without."""
    without, with_ = _by_rung(runs, _WITHOUT), _by_rung(runs, TENANTS_TARGET)
    rows: list[dict[str, Any]] = []
    for rung in sorted(set(without) & set(with_), key=lambda k: (k[0] or 0, k[1])):
        a, b = without[rung], with_[rung]
        row: dict[str, Any] = {"max_tokens": rung[0], "concurrency": rung[1]}
        for key in ("cpu_s_per_1k_tokens", "cpu_ms_per_request"):
            row[key] = (a.get(key), b.get(key))
            row[key + "_ratio"] = _ratio(b.get(key), a.get(key))
        for q in ("p50", "p99"):
            row[f"added_ttft_{q}_ms"] = (
                a.get("added_ttft_ms", {}).get(q),
                b.get("added_ttft_ms", {}).get(q),
            )
        row["complete"] = (f"{a['complete']}/{a['requests']}", f"{b['complete']}/{b['requests']}")
        rows.append(row)
    return rows


def tenants_markdown(runs: Sequence[dict[str, Any]]) -> str:
    """The side-by-side table (empty when the run lacks either target)."""
    rows = tenants_comparison(runs)
    if not rows:
        return ""
    lines = [
        f"#### Tenants configured ({_WITHOUT} without, {TENANTS_TARGET} with)",
        "",
        "| streams | answer tokens | ok / sent (without, with) | router CPU-s / 1k tokens "
        "(without → with) | **ratio** | router CPU-ms / request (without → with) | ratio "
        "| added TTFT p50 ms (without → with) | added TTFT p99 ms (without → with) |",
        "|---:|---:|---|---|---:|---|---:|---|---|",
    ]
    for r in rows:
        cpu, req = r["cpu_s_per_1k_tokens"], r["cpu_ms_per_request"]
        p50, p99 = r["added_ttft_p50_ms"], r["added_ttft_p99_ms"]
        lines.append(
            f"| {r['concurrency']} | {r['max_tokens']} | {r['complete'][0]}, {r['complete'][1]} "
            f"| {_num(cpu[0], '.4f')} → {_num(cpu[1], '.4f')} "
            f"| {_num(r['cpu_s_per_1k_tokens_ratio'], '.3f')} "
            f"| {_num(req[0], '.3f')} → {_num(req[1], '.3f')} "
            f"| {_num(r['cpu_ms_per_request_ratio'], '.3f')} "
            f"| {_num(p50[0], '+.2f')} → {_num(p50[1], '+.2f')} "
            f"| {_num(p99[0], '+.2f')} → {_num(p99[1], '+.2f')} |"
        )
    return "\n".join(lines) + "\n"
