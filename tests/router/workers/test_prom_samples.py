"""The load poll's reading of vLLM's /metrics (router/workers/prom_samples.py) against
`prometheus_client`'s own parser, on texts that library writes: the gauges the router reads,
among histograms that it does not, with label values a hostile or careless worker could send
(quotes, braces, commas, backslashes, newlines, a label's name and value quoted inside another)."""

from __future__ import annotations

import math
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from router.workers.discovery import LoadSnapshot, parse_vllm_metrics
from router.workers.prom_samples import label_value, samples

_RUNNING, _WAITING = "vllm:num_requests_running", "vllm:num_requests_waiting"
_USAGE, _INFO = "vllm:kv_cache_usage_perc", "vllm:cache_config_info"


def reference(text: str) -> LoadSnapshot:
    """What the load poll read before, with the full parser (the previous parse_vllm_metrics)."""
    running = waiting = 0.0
    usage: float | None = None
    blocks: int | None = None
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == _RUNNING:
                running += sample.value
            elif sample.name == _WAITING:
                waiting += sample.value
            elif sample.name in (_USAGE, "vllm:gpu_cache_usage_perc"):
                if math.isfinite(sample.value):
                    usage = sample.value if usage is None else max(usage, sample.value)
            elif sample.name == _INFO:
                raw = sample.labels.get("num_gpu_blocks")
                if raw is not None and raw.isdigit():
                    blocks = (blocks or 0) + int(raw)
    return LoadSnapshot(int(running), int(waiting), usage, blocks, 0.0)


label_text = st.lists(
    st.sampled_from(
        list('ab0}{",\\\n =') + ['num_gpu_blocks="9"', "} 99\nvllm:num_requests_running 7"]
    ),
    max_size=6,
).map("".join)
gauge_value = st.one_of(
    st.integers(0, 10_000).map(float),
    st.floats(0, 1, allow_nan=False),
    st.sampled_from([math.nan, math.inf]),
)


def vllm_text(engines: list[tuple[str, float, float, float, int]]) -> str:
    registry = CollectorRegistry()
    labels = ["engine", "model_name"]
    running = Gauge(_RUNNING, "running", labels, registry=registry)
    waiting = Gauge(_WAITING, "waiting", labels, registry=registry)
    usage = Gauge(_USAGE, "usage", labels, registry=registry)
    info = Gauge(_INFO, "info", ["block_size", "engine", "num_gpu_blocks"], registry=registry)
    ttft = Histogram("vllm:time_to_first_token_seconds", "ttft", labels, registry=registry)
    for i, (model, run, wait, use, nblocks) in enumerate(engines):
        engine = str(i)
        running.labels(engine, model).set(run)
        waiting.labels(engine, model).set(wait)
        usage.labels(engine, model).set(use)
        info.labels("16", engine, str(nblocks)).set(1)
        ttft.labels(engine, model).observe(0.05 * i)
    return generate_latest(registry).decode()


def same(a: LoadSnapshot, b: LoadSnapshot) -> bool:
    return (a.running, a.waiting, a.num_gpu_blocks) == (
        b.running,
        b.waiting,
        b.num_gpu_blocks,
    ) and (a.kv_usage == b.kv_usage)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(label_text, gauge_value, gauge_value, gauge_value, st.integers(0, 10**6)),
        min_size=1,
        max_size=4,
    )
)
def test_reads_what_the_full_parser_reads(
    engines: list[tuple[str, float, float, float, int]],
) -> None:
    text = vllm_text(engines)
    ours = parse_vllm_metrics(text, 0.0)
    try:
        theirs = reference(text)
    except (ValueError, OverflowError):  # its int() of an inf or NaN count; ours reads none
        assert any(not math.isfinite(run + wait) for _, run, wait, *_ in engines)
        return
    assert same(ours, theirs), text


def test_a_label_value_that_quotes_another_label_is_not_taken_for_it() -> None:
    labels = 'model_name="x,num_gpu_blocks=\\"5\\"",num_gpu_blocks="7"'
    assert label_value(labels, "num_gpu_blocks") == "7"
    assert label_value('a=",num_gpu_blocks=",b="1"', "num_gpu_blocks") is None
    assert label_value('model_name="a\\\\b\\"c\\nd"', "model_name") == 'a\\b"c\nd'


def test_a_count_that_is_not_finite_counts_as_none() -> None:
    text = f'{_RUNNING}{{engine="0"}} NaN\n{_RUNNING}{{engine="1"}} 4\n{_WAITING} +Inf\n'
    assert (parse_vllm_metrics(text, 0.0).running, parse_vllm_metrics(text, 0.0).waiting) == (4, 0)


def test_a_line_that_is_not_a_number_costs_only_itself() -> None:
    text = f'{_RUNNING}{{engine="0"}} 3\n{_RUNNING}{{engine="1"}} many\n{_WAITING} 2\n'
    assert parse_vllm_metrics(text, 0.0).running == 3
    assert parse_vllm_metrics(text, 0.0).waiting == 2


def test_only_whole_names_and_sample_lines_are_read() -> None:
    text = (
        f"# HELP {_RUNNING} {_RUNNING} 99\n"
        f"{_RUNNING}_total 50\n"
        f"x{_RUNNING} 40\n"
        f'{_RUNNING}{{model_name="m"}} 2 1700000000000\n'
    )
    assert [s.value for s in samples(text, frozenset((_RUNNING,)))] == [2.0]


def test_a_real_vllm_text_reads_as_the_full_parser_reads_it() -> None:
    text = (Path(__file__).parent / "texts" / "vllm-0.32-metrics.txt").read_text()
    ours = parse_vllm_metrics(text, 0.0)
    assert same(ours, reference(text))
    assert ours.num_gpu_blocks == 32768 and ours.kv_usage == 0.0
