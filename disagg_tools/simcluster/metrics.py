"""What a cluster simulation measured: per-request records, a streaming gap histogram, the summary.

Memory stays bounded by the number of requests, not tokens: each request keeps its TTFT, e2e and
its own mean/max token gap; the cluster-wide distribution of token gaps goes into a log-bucketed
histogram (1 % wide buckets, each with its count and sum), weighted so that one decode step adds
its duration once per sequence that emitted a non-first token in it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal, TypedDict

from policies.base import Role

__all__ = [
    "GapHistogram",
    "RequestRecord",
    "SimResult",
    "percentile",
    "Outcome",
    "RoleSwitchLog",
    "RolesSummary",
]

Outcome = Literal["ok", "rejected", "failed"]

# One role switch of an elastic run, as it went: started at `t`, drained at `drained_t`, serving
# in its new role at `active_t` (None until then), with the sequences it resumed elsewhere.
RoleSwitchLog = TypedDict(
    "RoleSwitchLog",
    {
        "t": float,
        "worker": str,
        "from": Role,  # a keyword, hence the functional form
        "to": Role,
        "reason": str,
        "drained_t": float | None,
        "active_t": float | None,
        "migrated": int,
    },
)


class RolesSummary(TypedDict):
    """What the role controller of an elastic run recorded (`SimResult.roles`)."""

    switches: list[RoleSwitchLog]
    # Per role tick: time, prefill workers, decode workers, the policy's two pressures.
    timeline: list[tuple[float, int, int, float, float]]
    migrated: int  # sequences resumed on another decode worker past a drain deadline
    retargeted: int  # reservations moved off a worker leaving decode before their KV landed
    redispatched: int  # prompts moved off a worker leaving prefill before they started


_INV_LOG_STEP = 1.0 / math.log(1.01)


class GapHistogram:
    """Weighted streaming histogram of positive durations, exact to ~1 % in value."""

    __slots__ = ("_buckets", "count", "total")

    def __init__(self) -> None:
        self._buckets: dict[int, list[float]] = {}  # index -> [count, sum]
        self.count = 0
        self.total = 0.0

    def add(self, value: float, weight: int = 1) -> None:
        if weight <= 0:
            return
        idx = int(math.log(value) * _INV_LOG_STEP) if value > 0 else -(10**6)
        b = self._buckets.get(idx)
        if b is None:
            self._buckets[idx] = [weight, value * weight]
        else:
            b[0] += weight
            b[1] += value * weight
        self.count += weight
        self.total += value * weight

    def _sorted(self) -> list[tuple[int, list[float]]]:
        return sorted(self._buckets.items())

    def quantile(self, q: float) -> float:
        """Value below which a fraction q of the weight lies (bucket mean at the crossing)."""
        if self.count == 0:
            return 0.0
        target = q * self.count
        seen = 0.0
        for _, (c, s) in self._sorted():
            seen += c
            if seen >= target:
                return s / c
        return 0.0

    def worst_mean(self, fraction: float = 0.1) -> float:
        """Mean of the largest `fraction` of the weight: Mooncake's TBT with fraction 0.1."""
        if self.count == 0:
            return 0.0
        want = fraction * self.count
        taken = 0.0
        acc = 0.0
        for _, (c, s) in reversed(self._sorted()):
            take = min(c, want - taken)
            acc += s / c * take
            taken += take
            if taken >= want:
                break
        return acc / taken if taken else 0.0

    @property
    def mean(self) -> float:
        return self.total / self.count if self.count else 0.0

    def __repr__(self) -> str:
        return f"GapHistogram(n={self.count}, mean={self.mean:.4g}s)"


@dataclass(frozen=True, slots=True)
class RequestRecord:
    """One request's fate. Times are simulated seconds; -1.0 where it never happened."""

    index: int
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    outcome: Outcome
    ttft_s: float = -1.0
    e2e_s: float = -1.0
    mean_gap_s: float = 0.0  # TPOT: (last token - first token) / (tokens - 1)
    max_gap_s: float = 0.0
    queued_s: float = 0.0  # time waiting in the admission queue
    preemptions: int = 0
    refusals: int = 0  # handoffs D refused while the KV waited on P
    reason: str = ""
    tenant: str = ""  # who it was for (a run with tenants: disagg_tools.simcluster.tenants)
    # What its reservation took, as the fairness policy was settled with it (0 if never admitted).
    decode_block_s: float = 0.0
    # Times the router preempted it (ClusterConfig.preemption), and the prefill tokens redone
    # to resume it (its prompt + its answer so far, at each preemption).
    router_preemptions: int = 0
    redone_tokens: int = 0
    # Of those, the ones that took its room back for the cluster's fair share or for a more
    # urgent class (disagg_tools/simcluster/fair_takeback.py); the rest were growths'.
    fair_share_preemptions: int = 0
    priority_preemptions: int = 0

    def meets(self, slo_ttft_s: float, slo_tpot_s: float) -> bool:
        return (
            self.outcome == "ok"
            and self.ttft_s <= slo_ttft_s
            and (self.output_tokens <= 1 or self.mean_gap_s <= slo_tpot_s)
        )


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (q in 0..100) of `values` (any order); None when empty.

    The project's one definition, used by the simulator's summaries and every bench report:
    linear interpolation between the closest order statistics (numpy's default, "linear", as
    vLLM's and SGLang's benchmark scripts report). It lives here, in the lowest layer that
    reports percentiles; the replay and overhead reports import it
    (tests/architecture/test_layering.py)."""
    return percentile_sorted(sorted(values), q)


def percentile_sorted(data: Sequence[float], q: float) -> float | None:
    """`percentile` of data already in ascending order (sort a million gaps once, not thrice)."""
    if not data:
        return None
    pos = (len(data) - 1) * min(100.0, max(0.0, q)) / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(data) - 1)
    return data[lo] + (data[hi] - data[lo]) * (pos - lo)


def _preemption_summary(recs: Sequence[RequestRecord]) -> dict[str, float | int]:
    """The router's preemptions (issue 31): how many, per 1,000 requests, the prefill tokens
    redone, and the TTFT of the requests preempted apart from the others' (a preempted
    request's TTFT is its first token's, before it was preempted)."""
    cut = sum(r.router_preemptions for r in recs)
    ok = [r for r in recs if r.outcome == "ok"]
    return {
        "router_preemptions": cut,
        "router_preemptions_per_1k": 1000.0 * cut / len(recs) if recs else 0.0,
        "fair_share_preemptions": sum(r.fair_share_preemptions for r in recs),
        "priority_preemptions": sum(r.priority_preemptions for r in recs),
        "redone_prefill_tokens": sum(r.redone_tokens for r in recs),
        "preempted_requests": sum(1 for r in recs if r.router_preemptions),
        "ttft_p99_not_preempted_s": _pct([r.ttft_s for r in ok if not r.router_preemptions], 99),
        "ttft_p99_preempted_s": _pct([r.ttft_s for r in ok if r.router_preemptions], 99),
    }


def _pct(values: Sequence[float], q: float) -> float:
    """`percentile`, 0.0 when empty: the summary is a flat dict of numbers."""
    v = percentile(values, q)
    return 0.0 if v is None else v


@dataclass(slots=True)
class SimResult:
    """Everything one `simulate` run measured. `summary()` is deterministic under the seed."""

    records: list[RequestRecord]
    gaps: GapHistogram
    slo_ttft_s: float
    slo_tpot_s: float
    sim_end_s: float
    counters: dict[str, float] = field(default_factory=dict)
    events: int = 0
    wall_s: float = 0.0  # host time; never part of the deterministic summary
    # Elastic runs: the switch log, the split and pressures per role tick
    # (simcluster.role_switching).
    roles: RolesSummary | None = None

    def attainment_by_window(
        self, window_s: float, *, first_index: int = 0
    ) -> list[tuple[float, int, float]]:
        """(window start, requests, fraction meeting both SLOs) per `window_s` of arrival time,
        over the requests with trace position >= `first_index` (to leave out a warm-up)."""
        if window_s <= 0:
            raise ValueError("window_s must be > 0")
        n: dict[int, int] = {}
        good: dict[int, int] = {}
        for r in self.records:
            if r.index < first_index:
                continue
            k = int(r.arrival_s // window_s)
            n[k] = n.get(k, 0) + 1
            good[k] = good.get(k, 0) + r.meets(self.slo_ttft_s, self.slo_tpot_s)
        return [(k * window_s, n[k], good[k] / n[k]) for k in sorted(n)]

    @property
    def events_per_s(self) -> float:
        return self.events / self.wall_s if self.wall_s > 0 else 0.0

    def summary(self, *, timing: bool = False) -> dict[str, float | int]:
        recs = self.records
        ok = [r for r in recs if r.outcome == "ok"]
        ttft = [r.ttft_s for r in ok]
        tpot = [r.mean_gap_s for r in ok if r.output_tokens > 1]
        good = sum(1 for r in recs if r.meets(self.slo_ttft_s, self.slo_tpot_s))
        span = max((r.arrival_s for r in recs), default=0.0) - min(
            (r.arrival_s for r in recs), default=0.0
        )
        out: dict[str, float | int] = {
            "requests": len(recs),
            "ok": len(ok),
            "rejected": sum(1 for r in recs if r.outcome == "rejected"),
            "failed": sum(1 for r in recs if r.outcome == "failed"),
            "slo_attainment": good / len(recs) if recs else 0.0,
            # Requests/s that met both SLOs over the arrival span; the DistServe goodput is the
            # highest *offered* rate with attainment >= 0.9 (see disagg_tools.goodput).
            "slo_met_rps": good / span if span > 0 else float(good),
            "ttft_p50_s": _pct(ttft, 50),
            "ttft_p90_s": _pct(ttft, 90),
            "ttft_p99_s": _pct(ttft, 99),
            "tpot_p50_s": _pct(tpot, 50),
            "tpot_p99_s": _pct(tpot, 99),
            "itl_p50_s": self.gaps.quantile(0.5),
            "itl_p90_s": self.gaps.quantile(0.9),
            "itl_p99_s": self.gaps.quantile(0.99),
            "itl_max_s": max((r.max_gap_s for r in ok), default=0.0),
            "tbt_mooncake_s": self.gaps.worst_mean(0.1),
            "preemptions": sum(r.preemptions for r in recs),
            **_preemption_summary(recs),
            "sim_end_s": self.sim_end_s,
            "events": self.events,
        }
        out.update(self.counters)
        if timing:
            out["wall_s"] = self.wall_s
            out["events_per_s"] = self.events_per_s
        return out

    def __repr__(self) -> str:
        s = self.summary()
        return (
            f"SimResult(requests={s['requests']}, ok={s['ok']}, rejected={s['rejected']}, "
            f"slo={s['slo_attainment']:.3f}, events={self.events})"
        )
