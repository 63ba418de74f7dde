"""What the simulator experiments run: trace slices with their SLOs, cluster shapes, and the
policy cases (a policy run the way its router runs it), plus two experiment-only plug-ins.

The numbers are justified in docs/benchmarks.md; `disagg_tools.experiments.simruns` runs them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from disagg_tools.simcluster.config import ClusterConfig
from disagg_tools.traces import TRACE_DIR, TraceRequest, load_trace
from policies.base import Placement, Rejection, RequestInfo
from policies.two_sided import TwoSidedPolicy

__all__ = [
    "CASES",
    "SHAPES",
    "TRACES",
    "TRACE_DIR",
    "VARIANTS",
    "CaseSpec",
    "ShapeSpec",
    "TTFTGatedTwoSided",
    "TraceSpec",
    "WarmEstimator",
]


@dataclass(frozen=True, slots=True)
class TraceSpec:
    """A trace slice and the SLOs it is judged by (justified in docs/benchmarks.md)."""

    name: str
    file: str
    limit: int | None
    slo_ttft_s: float
    slo_tpot_s: float
    # The slice starts at row `start`; the rows before it warm the output-length statistics,
    # as a long-running router's shared store would be warm (0 = start cold).
    start: int = 0
    # ClusterConfig overrides every run of this trace gets (e.g. a prefix cache for Mooncake).
    config: dict[str, Any] = field(default_factory=dict)

    def load(self, limit: int | None = None) -> list[TraceRequest]:
        return load_trace(TRACE_DIR / self.file, limit=limit or self.limit, start=self.start)

    def warmup(self) -> list[TraceRequest]:
        return load_trace(TRACE_DIR / self.file, limit=self.start) if self.start else []


@dataclass(frozen=True, slots=True)
class ShapeSpec:
    name: str
    n_prefill: int
    n_decode: int
    model: str = "llama-3-8b"
    gpu: str = "h100"
    tp_size: int | None = None
    capacity_blocks: int | None = None
    decode_gpu: str | None = None
    note: str = ""

    def config(self, **kw: Any) -> Any:
        return ClusterConfig.homogeneous(
            self.n_prefill, self.n_decode, self.model, self.gpu,
            tp_size=self.tp_size, capacity_blocks=self.capacity_blocks,
            decode_gpu=self.decode_gpu, **kw,
        )  # fmt: skip


@dataclass(frozen=True, slots=True)
class CaseSpec:
    """A policy run the way its router runs it. `case` is
    `disagg_tools.simcluster.simulate_cli.parse_case`
    syntax."""

    label: str
    case: str
    estimator: str = "online_quantile"
    policy_args: dict[str, Any] = field(default_factory=dict)
    estimator_args: dict[str, Any] = field(default_factory=dict)
    baseline: bool = False


TRACES: dict[str, TraceSpec] = {
    # Chat: a person reads as it streams; 2 s to start, 10 tokens/s is reading speed.
    "conv": TraceSpec("conv", "AzureLLMInferenceTrace_conv.csv", 3000, 2.0, 0.1, 2000),
    # Code completion: an editor waits for a short answer (median 13 tokens): tighter TTFT.
    "code": TraceSpec("code", "AzureLLMInferenceTrace_code.csv", 3000, 1.0, 0.1, 2000),
    # Long context (mean 15 K, p99 66 K prompt tokens): the p99 prompt alone prefills in 4.5 s
    # (8B) / 7.6 s (70B) on an idle GPU, so TTFT must be looser.
    # Mooncake's trace exists to exercise prefix caching: each prefill worker keeps 2,000
    # 512-token blocks (~1 M tokens, a DRAM tier as in Mooncake's pool).
    "mooncake": TraceSpec(
        "mooncake",
        "mooncake_synthetic_trace.jsonl",
        1500,
        10.0,
        0.1,
        1000,
        {"prefix_cache_blocks": 2000},
    ),
}

SHAPES: dict[str, ShapeSpec] = {
    "8b-2p6d": ShapeSpec(
        "8b-2p6d",
        2,
        6,
        "llama-3-8b",
        note="8B, 2P:6D H100: ~400 K KV tokens per decode GPU, decode memory does not bind",
    ),
    "70b-4p4d": ShapeSpec(
        "70b-4p4d",
        4,
        4,
        "llama-3-70b",
        tp_size=4,
        note="70B TP4, 4P:4D H100 (32 GPUs): 320 KiB/token, ~400 K KV tokens per decode worker",
    ),
    "8b-4p4d-l40s": ShapeSpec(
        "8b-4p4d-l40s",
        4,
        4,
        "llama-3-8b",
        decode_gpu="l40s",
        note="8B, 4 H100 prefill : 4 L40S decode (48 GB): ~190 K KV "
        "tokens per decode GPU, decode memory binds on long contexts",
    ),
}

CASES: tuple[CaseSpec, ...] = (
    CaseSpec("random", "random/noreserve", baseline=True),
    CaseSpec("round_robin", "round_robin/noreserve", baseline=True),
    CaseSpec("least_loaded", "least_loaded/noreserve", baseline=True),
    CaseSpec("power_of_two", "power_of_two/noreserve", baseline=True),
    CaseSpec("least_loaded refuse", "least_loaded/noreserve/refuse", baseline=True),
    CaseSpec("two_sided+online", "two_sided"),
    CaseSpec("two_sided+oracle", "two_sided", estimator="oracle"),
)

# The investigation of docs/benchmarks.md: reservation quantile and admission, same policy.
VARIANTS: tuple[CaseSpec, ...] = (
    CaseSpec("two_sided+online q0.5", "two_sided", estimator_args={"quantile": 0.5}),
    CaseSpec("two_sided+online q0.7", "two_sided", estimator_args={"quantile": 0.7}),
    CaseSpec("two_sided+online predictive", "two_sided/predictive"),
    CaseSpec(
        "two_sided+online q0.7 predictive", "two_sided/predictive", estimator_args={"quantile": 0.7}
    ),
    CaseSpec("two_sided+online ttft-gate", "disagg_tools.experiments.specs:TTFTGatedTwoSided"),
    CaseSpec(
        "two_sided+online ttft-gate q0.7 predictive",
        "disagg_tools.experiments.specs:TTFTGatedTwoSided/predictive",
        estimator_args={"quantile": 0.7},
    ),
)


class WarmEstimator:
    """An estimator whose statistics start from earlier traffic (`warm`: class key -> bucket ->
    count) instead of empty, as a router with a shared, long-lived store would."""

    def __init__(self, inner: Any, warm: dict[str, dict[int, int]]) -> None:
        self.inner = inner
        self.name = inner.name
        self.warm = warm

    def class_keys(self, request: Any) -> tuple[str, ...]:
        return tuple(self.inner.class_keys(request))

    def estimate(self, request: Any, histograms: Any) -> Any:
        merged = {}
        for key in self.class_keys(request):
            h = dict(self.warm.get(key, {}))
            for b, c in histograms.get(key, {}).items():
                h[b] = h.get(b, 0) + c
            merged[key] = h
        return self.inner.estimate(request, merged)

    def bucket_of(self, n: int) -> int:
        return int(self.inner.bucket_of(n))

    @classmethod
    def from_requests(cls, inner: Any, warmup: Sequence[TraceRequest], model: str,
                      max_tokens: int) -> WarmEstimator:  # fmt: skip
        warm: dict[str, dict[int, int]] = {}
        for r in warmup:
            cap = r.max_tokens or max_tokens
            info = RequestInfo(str(r.index), model, max(1, r.prompt_tokens), cap)
            b = inner.bucket_of(max(1, min(r.output_tokens, cap)))
            for key in inner.class_keys(info):
                h = warm.setdefault(key, {})
                h[b] = h.get(b, 0) + 1
        return cls(inner, warm)


class TTFTGatedTwoSided:
    """EXPERIMENT (not a shipped policy): two_sided, but candidates whose predicted TTFT is over
    the request's TTFT SLO (× `slack`) are dropped, and a request with none left is rejected
    (it waits in the admission queue and is retried until its deadline). Sheds requests that
    would miss anyway instead of letting them lengthen the prefill queues for everyone."""

    name = "two_sided_ttft_gate"

    def __init__(self, slack: float = 1.0, **kwargs: Any) -> None:
        self.inner = TwoSidedPolicy(**kwargs)
        self.slack = slack

    def place(self, request: Any, view: Any) -> Any:
        decision = self.inner.place(request, view)
        if not isinstance(decision, Placement) or request.slo_ttft_s is None:
            return decision
        limit = request.slo_ttft_s * self.slack
        kept = tuple(c for c in decision.candidates if c.predicted_ttft_s <= limit)
        if kept:
            return Placement(kept)
        best = min(c.predicted_ttft_s for c in decision.candidates)
        return Rejection(f"predicted TTFT {best:.2f} s over the SLO", 0.5)
