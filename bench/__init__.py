"""disagg-router bench: a client that replays request traces against any OpenAI-compatible
endpoint and reports latency, SLO attainment and goodput. It imports nothing of the router."""

from bench.cli import (
    GoodputResult,
    GoodputSearch,
    add_bench_arguments,
    goodput_search,
    goodput_search_sync,
    run_bench,
)
from bench.replay import OUTCOMES, ReplayResult, RequestRecord, replay
from bench.report import (
    plot_attainment_vs_rate,
    plot_latency_cdfs,
    summarize,
    to_markdown,
    to_text,
    write_report,
)
from bench.traces import TraceFormatError, TraceRequest, load_trace, prompt_text, scale_arrivals

__all__ = [
    "OUTCOMES",
    "GoodputResult",
    "GoodputSearch",
    "ReplayResult",
    "RequestRecord",
    "TraceFormatError",
    "TraceRequest",
    "add_bench_arguments",
    "goodput_search",
    "goodput_search_sync",
    "load_trace",
    "plot_attainment_vs_rate",
    "plot_latency_cdfs",
    "prompt_text",
    "replay",
    "run_bench",
    "scale_arrivals",
    "summarize",
    "to_markdown",
    "to_text",
    "write_report",
]
