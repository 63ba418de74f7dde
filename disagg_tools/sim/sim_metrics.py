"""Prometheus metrics of one simulated worker, under vLLM's names, in a per-app registry.

A per-app CollectorRegistry (never the global one) lets many workers live in one test process.
Gauges are read at scrape time from the engine; counters are kept here and mirrored in plain ints
so `/sim/state` can report them without reaching into prometheus_client internals.
"""

from __future__ import annotations

from collections import Counter as Tally
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

__all__ = ["SimMetrics"]

# key -> (metric name without _total, help, extra label name or None)
_COUNTERS: dict[str, tuple[str, str, str | None]] = {
    "prompt_tokens": ("vllm:prompt_tokens", "Prompt tokens processed.", None),
    "generation_tokens": ("vllm:generation_tokens", "Generated tokens.", None),
    "preemptions": ("vllm:num_preemptions", "Sequences stalled on a full KV cache.", None),
    "prompt_by_source": (
        "vllm:prompt_tokens_by_source",
        "Prompt tokens by where their KV came from.",
        "source",
    ),
    "request_success": ("vllm:request_success", "Finished requests.", "finished_reason"),
    "requests": ("sim:requests", "Generation requests received, by kind.", "kind"),
    "kv_params_mismatch": (
        "sim:kv_params_mismatch",
        "Decode requests whose kv_transfer_params did not match the prefilled KV.",
        None,
    ),
    "kv_pull_failures": ("sim:kv_pull_failures", "Failed KV pulls, by reason.", "reason"),
    "kv_pulled": ("sim:kv_pulled", "KV entries pulled by a decode worker.", None),
    "kv_expired": ("sim:kv_expired", "Prefilled KV entries freed by lease expiry.", None),
    "capacity_refusals": ("sim:capacity_refusals", "Requests refused for lack of KV.", None),
    "aborted": ("sim:aborted", "Requests aborted by a client disconnect.", None),
    "faults": ("sim:faults_injected", "Injected faults, by fault.", "fault"),
    "bad_requests": ("sim:bad_requests", "Requests answered 400.", None),
    "role_switches": (
        "sim:role_switches",
        "POST /pd_role_switch answers, by outcome (sim.role_switch).",
        "outcome",
    ),
}


class SimMetrics:
    def __init__(
        self,
        model_name: str,
        running: Callable[[], float],
        waiting: Callable[[], float],
        kv_usage: Callable[[], float],
    ) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry()
        self.counts: Tally[str] = Tally()
        for name, doc, fn in (
            ("vllm:num_requests_running", "Requests in the decode batch or prefilling.", running),
            ("vllm:num_requests_waiting", "Requests queued or preempted.", waiting),
            ("vllm:kv_cache_usage_perc", "Fraction of KV blocks in use (0-1).", kv_usage),
        ):
            gauge = Gauge(name, doc, ["model_name"], registry=self.registry)
            gauge.labels(model_name=model_name).set_function(fn)
        self._counters: dict[str, Counter] = {}
        for key, (name, doc, label) in _COUNTERS.items():
            labels = ["model_name"] + ([label] if label else [])
            self._counters[key] = Counter(name, doc, labels, registry=self.registry)
            # Export zeros from the start, so a scrape before any traffic already shows them.
            if label is None:
                self._counters[key].labels(model_name=model_name)
        for source in ("external_kv_transfer", "local_compute"):
            self._counters["prompt_by_source"].labels(model_name=model_name, source=source)

    def inc(self, key: str, amount: int = 1, label: str | None = None) -> None:
        """Count `amount` on counter `key` (with its extra label value, if it has one)."""
        if amount <= 0:
            return
        _, _, label_name = _COUNTERS[key]
        values = {"model_name": self.model_name}
        if label_name is not None:
            if label is None:
                raise ValueError(f"counter {key!r} needs a {label_name!r} label")
            values[label_name] = label
        self._counters[key].labels(**values).inc(amount)
        self.counts[key if label is None else f"{key}:{label}"] += amount

    def export_cache_config(self, num_gpu_blocks: int, block_size: int) -> None:
        """vLLM's `vllm:cache_config_info`: its cache settings as labels on a constant 1
        (routers read the KV capacity from it)."""
        labels = {"num_gpu_blocks": str(num_gpu_blocks), "block_size": str(block_size)}
        info = Gauge(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            list(labels),
            registry=self.registry,
        )
        info.labels(**labels).set(1)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def __repr__(self) -> str:
        return f"SimMetrics(model={self.model_name!r}, counts={dict(self.counts)})"
