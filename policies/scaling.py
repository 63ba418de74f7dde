"""How many replicas each pool needs: demand ÷ what one replica serves at the SLO.

Prefill and decode are separate queueing systems with separate signals (docs/design.md §1):

- **prefill** is compute-bound and its load is prompt tokens. Within the TTFT SLO a pool must
  take the tokens arriving per second and also clear the tokens already queued:
  `need = (arriving/s + queued / ttft_slo_s) / (one replica's prompt tokens/s × utilization)`.
  A replica's rate is the cost model's (`PerfModel.prefill_tokens_per_s`) at a typical prompt.
- **decode** is bandwidth-bound and its load is resident sequences and their KV. One replica
  can hold as many sequences as fit in its KV blocks, and as many as keep a step within the
  ITL SLO (the step time grows with the batch's KV: `PerfModel.decode_step_s`); the pool must
  hold every resident sequence, every reserved block and produce the output tokens per second
  asked of it, each at `utilization` of the replica's limit.

`utilization` (< 1) is the headroom that keeps queueing delay bounded: a pool run at 100 % of
its rate has an unbounded queue. The functions are pure (no clock, no I/O), so they are tested
alone and the router, the simulator or a capacity-planning script call them alike.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from policies.costmodel import PerfModel

__all__ = [
    "ScalingSLO",
    "PrefillDemand",
    "DecodeDemand",
    "Recommendation",
    "recommend_prefill",
    "recommend_decode",
    "max_batch_at_itl",
]


@dataclass(frozen=True, slots=True)
class ScalingSLO:
    # Each field's `doc` is its line in the settings reference (docs/configuration.md).
    ttft_slo_s: float = field(
        default=2.0, metadata={"doc": "time to first token the prefill pool is sized for"}
    )
    itl_slo_s: float = field(
        default=0.05,
        metadata={"doc": "inter-token latency (one decode step) the decode pool is sized for"},
    )
    utilization: float = field(
        default=0.8, metadata={"doc": "run each replica at most this fraction of its limit"}
    )
    typical_prompt_tokens: int = field(
        default=1024, metadata={"doc": "the prompt size a prefill replica's rate is taken at"}
    )
    typical_seq_tokens: int = field(
        default=1024, metadata={"doc": "KV tokens per sequence when no sequence is resident"}
    )
    window_s: float = field(
        default=10.0, metadata={"doc": "rates (tokens/s) are averaged over this long"}
    )
    min_replicas: int = field(default=1, metadata={"doc": "never recommend fewer replicas"})

    def __post_init__(self) -> None:
        for name in ("ttft_slo_s", "itl_slo_s", "window_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"scaling.{name} must be > 0")
        if not 0 < self.utilization <= 1:
            raise ValueError("scaling.utilization must be in (0, 1]")
        if self.typical_prompt_tokens < 1 or self.typical_seq_tokens < 1:
            raise ValueError("scaling.typical_*_tokens must be >= 1")
        if self.min_replicas < 0:
            raise ValueError("scaling.min_replicas must be >= 0")


@dataclass(frozen=True, slots=True)
class PrefillDemand:
    arriving_tokens_per_s: float  # prompt tokens arriving for prefill
    queued_tokens: int  # prompt tokens dispatched, prefill not answered yet
    replicas: int  # in rotation now


@dataclass(frozen=True, slots=True)
class DecodeDemand:
    resident_seqs: int  # sequences holding decode room
    reserved_blocks: int  # KV blocks they hold
    capacity_blocks: int  # KV blocks of the replicas in rotation, together
    output_tokens_per_s: float
    replicas: int  # in rotation now


@dataclass(frozen=True, slots=True)
class Recommendation:
    pool: str  # "prefill" | "decode"
    current: int
    recommended: int
    need: float  # replicas' worth of demand before rounding up
    per_replica: dict[str, float]  # what one replica serves at the SLO, by resource
    bound_by: str  # the resource that set the count

    def as_dict(self) -> dict[str, object]:
        return {
            "pool": self.pool,
            "current": self.current,
            "recommended": self.recommended,
            "need": round(self.need, 3),
            "per_replica": {k: round(v, 3) for k, v in self.per_replica.items()},
            "bound_by": self.bound_by,
        }


def _count(need: float, slo: ScalingSLO) -> int:
    # A hair of tolerance so that float noise on an exact multiple does not add a replica.
    return max(slo.min_replicas, math.ceil(need - 1e-9))


def recommend_prefill(demand: PrefillDemand, perf: PerfModel, slo: ScalingSLO) -> Recommendation:
    rate = perf.prefill_tokens_per_s(slo.typical_prompt_tokens) * slo.utilization
    asked = demand.arriving_tokens_per_s + demand.queued_tokens / slo.ttft_slo_s
    need = asked / rate
    return Recommendation(
        pool="prefill",
        current=demand.replicas,
        recommended=_count(need, slo),
        need=need,
        per_replica={"prompt_tokens_per_s": rate},
        bound_by="prompt_tokens",
    )


def max_batch_at_itl(perf: PerfModel, seq_tokens: int, itl_s: float) -> int:
    """The largest batch of `seq_tokens`-long sequences whose decode step fits in `itl_s`
    (0 if even one does not). The step time grows with the batch: a binary search."""
    if perf.decode_step_s(seq_tokens, 1) > itl_s:
        return 0
    lo, hi = 1, 1
    while perf.decode_step_s(seq_tokens * hi * 2, hi * 2) <= itl_s and hi < 1 << 20:
        hi *= 2
    lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if perf.decode_step_s(seq_tokens * mid, mid) <= itl_s:
            lo = mid
        else:
            hi = mid
    return lo


def recommend_decode(demand: DecodeDemand, perf: PerfModel, slo: ScalingSLO) -> Recommendation:
    block = perf.block_size
    if demand.resident_seqs > 0:
        seq_tokens = max(1, demand.reserved_blocks * block // demand.resident_seqs)
    else:
        seq_tokens = slo.typical_seq_tokens
    blocks = (
        demand.capacity_blocks / demand.replicas if demand.replicas else perf.kv_capacity_blocks
    )
    batch = max_batch_at_itl(perf, seq_tokens, slo.itl_slo_s)
    seqs_by_kv = blocks / max(1, math.ceil(seq_tokens / block))
    seqs = min(float(batch), seqs_by_kv)
    step = perf.decode_step_s(int(seq_tokens * max(1.0, seqs)), max(1, int(seqs)))
    per_replica = {
        "kv_blocks": blocks * slo.utilization,
        "sequences": seqs * slo.utilization,
        "output_tokens_per_s": (seqs / step if step > 0 else 0.0) * slo.utilization,
    }
    needs = {
        "kv_blocks": demand.reserved_blocks / per_replica["kv_blocks"]
        if per_replica["kv_blocks"] > 0
        else math.inf,
        "sequences": demand.resident_seqs / per_replica["sequences"]
        if per_replica["sequences"] > 0
        else math.inf,
        "output_tokens_per_s": demand.output_tokens_per_s / per_replica["output_tokens_per_s"]
        if per_replica["output_tokens_per_s"] > 0
        else math.inf,
    }
    bound_by = max(needs, key=lambda k: needs[k])
    need = needs[bound_by]
    if math.isinf(need):  # the SLO cannot be met by any number of these replicas
        need = float(max(demand.replicas, slo.min_replicas))
        bound_by = "itl_slo_unreachable"
    return Recommendation(
        pool="decode",
        current=demand.replicas,
        recommended=_count(need, slo),
        need=need,
        per_replica=per_replica,
        bound_by=bound_by,
    )
