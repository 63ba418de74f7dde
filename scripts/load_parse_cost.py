"""What reading a vLLM worker's load costs the router: the full Prometheus parser against the
load poll's own reading of four gauges (router/workers/prom_samples.py), on a text shaped as
vLLM's /metrics (its gauges, counters and latency histograms, bucket by bucket, and the
process collectors), per engine count.

    python scripts/load_parse_cost.py [--engines 1,4] [--repeat 200] \
        [--text tests/router/workers/texts/vllm-0.32-metrics.txt]

Prints, per engine count (and for the real engine's text given with `--text`), the text's size
and the CPU µs per parse of each reader (the mean over `--repeat` parses, after a warm-up).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from router.workers.discovery import parse_vllm_metrics

# vLLM's histograms (v1 engine, 0.10-0.11) and the number of buckets each reports.
_HISTOGRAMS = {
    "vllm:iteration_tokens_total": 17,
    "vllm:time_to_first_token_seconds": 21,
    "vllm:time_per_output_token_seconds": 17,
    "vllm:inter_token_latency_seconds": 17,
    "vllm:e2e_request_latency_seconds": 15,
    "vllm:request_queue_time_seconds": 15,
    "vllm:request_inference_time_seconds": 15,
    "vllm:request_prefill_time_seconds": 15,
    "vllm:request_decode_time_seconds": 15,
    "vllm:request_prompt_tokens": 12,
    "vllm:request_generation_tokens": 12,
    "vllm:request_max_num_generation_tokens": 12,
    "vllm:request_params_n": 12,
    "vllm:request_params_max_tokens": 12,
}
_COUNTERS = (
    "vllm:num_preemptions",
    "vllm:prompt_tokens",
    "vllm:generation_tokens",
    "vllm:prefix_cache_queries",
    "vllm:prefix_cache_hits",
)


def vllm_like_text(engines: int, model: str = "meta-llama/Llama-3.1-8B-Instruct") -> str:
    registry = CollectorRegistry(auto_describe=True)
    labels = ["engine", "model_name"]
    gauges = {
        name: Gauge(name, name, labels, registry=registry)
        for name in (
            "vllm:num_requests_running",
            "vllm:num_requests_waiting",
            "vllm:kv_cache_usage_perc",
        )
    }
    info = Gauge(
        "vllm:cache_config_info",
        "cache config",
        ["block_size", "cache_dtype", "engine", "num_gpu_blocks", "prefix_caching"],
        registry=registry,
    )
    counters = {name: Counter(name, name, labels, registry=registry) for name in _COUNTERS}
    success = Counter(
        "vllm:request_success", "finished", [*labels, "finished_reason"], registry=registry
    )
    hists = {
        name: Histogram(
            name, name, labels, buckets=[0.001 * 2**i for i in range(n)], registry=registry
        )
        for name, n in _HISTOGRAMS.items()
    }
    for e in range(engines):
        engine = str(e)
        for i, gauge in enumerate(gauges.values()):
            gauge.labels(engine, model).set(i + e)
        info.labels("16", "auto", engine, "27000", "True").set(1)
        for counter in counters.values():
            counter.labels(engine, model).inc(1000)
        for reason in ("stop", "length", "abort"):
            success.labels(engine, model, reason).inc(10)
        for hist in hists.values():
            hist.labels(engine, model).observe(0.05)
    return generate_latest(registry).decode()


def _full_parser(text: str) -> None:
    for family in text_string_to_metric_families(text):
        for _ in family.samples:
            pass


def _cpu_us(parse: Callable[[str], object], text: str, repeat: int) -> float:
    for _ in range(max(repeat // 10, 1)):
        parse(text)
    start = time.process_time()
    for _ in range(repeat):
        parse(text)
    return (time.process_time() - start) / repeat * 1e6


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", default="1,4", help="engine counts, comma-separated")
    parser.add_argument("--repeat", type=int, default=200)
    parser.add_argument("--text", type=Path, help="a real engine's /metrics text, one more row")
    ns = parser.parse_args(argv)
    print("| text | bytes | full parser µs | load poll's reading µs | ratio |")
    print("|---|---:|---:|---:|---:|")
    texts = [
        (f"vLLM-shaped, {n} engine(s)", vllm_like_text(n)) for n in map(int, ns.engines.split(","))
    ]
    if ns.text is not None:
        texts.append((ns.text.name, ns.text.read_text()))
    for name, text in texts:
        full = _cpu_us(_full_parser, text, ns.repeat)
        ours = _cpu_us(lambda t: parse_vllm_metrics(t, 0.0), text, ns.repeat)
        print(f"| {name} | {len(text):,} | {full:.0f} | {ours:.0f} | {full / ours:.0f} × |")


if __name__ == "__main__":
    main()
