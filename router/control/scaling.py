"""Autoscaling signals: each pool's demand, and the replica count it needs at the SLOs.

The demand is measured here; the count is `policies.scaling`'s pure functions of it. Per model:

- prefill: prompt tokens/s arriving (this replica's arrivals, over `scaling.window_s`) and
  prompt tokens queued for prefill (dispatched, not answered: this replica's);
- decode: resident sequences and reserved vs capacity KV blocks (every replica's, from the
  shared store), output tokens/s (this replica's, over the window).

With several router replicas the per-replica rates add up: the Prometheus gauges are meant to
be summed across replicas (`sum by (model)`), and each replica's own recommendation counts its
own arrivals only (the KV figures are already cluster-wide).

Served on `GET /admin/scaling` and as `disagg_router_scaling_*` gauges at each scrape.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, cast

from policies.scaling import (
    DecodeDemand,
    PrefillDemand,
    recommend_decode,
    recommend_prefill,
)
from router.config import Settings
from router.workers.worker_state import WorkerState

if TYPE_CHECKING:
    from router.metrics import RouterMetrics

__all__ = ["DemandMeter", "scaling_report", "export_scaling"]


class DemandMeter:
    """Tokens per model in per-second buckets, for rates over a sliding window."""

    def __init__(self, window_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.window_s = window_s
        self._clock = clock
        self._started = clock()
        self._arrived: dict[str, dict[int, int]] = defaultdict(dict)
        self._output: dict[str, dict[int, int]] = defaultdict(dict)

    def __repr__(self) -> str:
        return f"DemandMeter(window_s={self.window_s}, models={sorted(self.models())})"

    def _add(self, table: dict[str, dict[int, int]], model: str, tokens: int) -> None:
        now = int(self._clock())
        buckets = table[model]
        buckets[now] = buckets.get(now, 0) + tokens
        if len(buckets) > 2 * self.window_s + 2:  # drop what left the window
            horizon = now - self.window_s - 1
            for second in [s for s in buckets if s < horizon]:
                del buckets[second]

    def note_arrival(self, model: str, prompt_tokens: int) -> None:
        self._add(self._arrived, model, prompt_tokens)

    def note_output(self, model: str, output_tokens: int) -> None:
        self._add(self._output, model, output_tokens)

    def _rate(self, table: dict[str, dict[int, int]], model: str) -> float:
        now = self._clock()
        horizon = now - self.window_s
        total = sum(n for s, n in table.get(model, {}).items() if s >= horizon)
        # A replica up for less than the window divides by its uptime, not the whole window.
        return total / max(1.0, min(self.window_s, now - self._started))

    def arriving_tokens_per_s(self, model: str) -> float:
        return self._rate(self._arrived, model)

    def output_tokens_per_s(self, model: str) -> float:
        return self._rate(self._output, model)

    def models(self) -> set[str]:
        return set(self._arrived) | set(self._output)


def scaling_report(
    settings: Settings, demand: DemandMeter, workers_in_pools: Iterable[WorkerState]
) -> list[dict[str, object]]:
    """Per model: each pool's demand and recommendation (None without a perf profile)."""
    s = settings
    slo = s.scaling
    default_model = s.models[0]
    models = dict.fromkeys([*s.models, *sorted(demand.models())])
    workers = list(workers_in_pools)
    for w in workers:
        models.setdefault(w.spec.layout.model or default_model)
    out: list[dict[str, object]] = []
    for model in models:
        mine = [w for w in workers if (w.spec.layout.model or default_model) == model]
        prefill = [w for w in mine if w.spec.role == "prefill"]
        decode = [w for w in mine if w.spec.is_decode]
        live_p = [w for w in prefill if w.available]
        live_d = [w for w in decode if w.available]
        p_demand = PrefillDemand(
            arriving_tokens_per_s=demand.arriving_tokens_per_s(model),
            queued_tokens=sum(w.queued_prompt_tokens for w in prefill),
            replicas=len(live_p),
        )
        d_demand = DecodeDemand(
            resident_seqs=sum(max(w.reservations, w.resident_seqs) for w in decode),
            reserved_blocks=sum(w.reserved_blocks for w in decode),
            capacity_blocks=sum(w.capacity_blocks for w in live_d),
            output_tokens_per_s=demand.output_tokens_per_s(model),
            replicas=len(live_d),
        )
        p_perf = next((w.spec.perf for w in prefill if w.spec.perf), s.default_perf)
        d_perf = next((w.spec.perf for w in decode if w.spec.perf), s.default_perf)
        out.append(
            {
                "model": model,
                "prefill": {
                    "demand": {
                        "arriving_tokens_per_s": round(p_demand.arriving_tokens_per_s, 3),
                        "queued_tokens": p_demand.queued_tokens,
                    },
                    "recommendation": None
                    if p_perf is None
                    else recommend_prefill(p_demand, p_perf, slo).as_dict(),
                },
                "decode": {
                    "demand": {
                        "resident_seqs": d_demand.resident_seqs,
                        "reserved_blocks": d_demand.reserved_blocks,
                        "capacity_blocks": d_demand.capacity_blocks,
                        "output_tokens_per_s": round(d_demand.output_tokens_per_s, 3),
                    },
                    "recommendation": None
                    if d_perf is None
                    else recommend_decode(d_demand, d_perf, slo).as_dict(),
                },
            }
        )
    return out


def export_scaling(report: list[dict[str, object]], m: RouterMetrics) -> None:
    """Set the scaling gauges from a `scaling_report`."""
    for row in report:
        model = str(row["model"])
        p = cast(dict[str, Any], row["prefill"])  # scaling_report's shape, built above
        d = cast(dict[str, Any], row["decode"])
        m.prefill_arriving_tokens.labels(model=model).set(p["demand"]["arriving_tokens_per_s"])
        m.prefill_queued_tokens.labels(model=model).set(p["demand"]["queued_tokens"])
        m.decode_resident_seqs.labels(model=model).set(d["demand"]["resident_seqs"])
        m.decode_kv_blocks.labels(model=model, kind="reserved").set(d["demand"]["reserved_blocks"])
        m.decode_kv_blocks.labels(model=model, kind="capacity").set(d["demand"]["capacity_blocks"])
        m.decode_output_tokens.labels(model=model).set(d["demand"]["output_tokens_per_s"])
        for pool, part in (("prefill", p), ("decode", d)):
            rec = part["recommendation"]
            if rec is not None:
                m.pool_replicas.labels(pool=pool, model=model).set(rec["current"])
                m.recommended_replicas.labels(pool=pool, model=model).set(rec["recommended"])
