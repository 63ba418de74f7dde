"""disagg-router bench: a client that replays request traces against any OpenAI-compatible
endpoint and reports latency, SLO attainment and goodput. It imports nothing of the router.

The command line and the goodput search live in `disagg_tools.bench.replay_cli` (not re-exported
here, so
that
`python -m disagg_tools.bench.replay_cli` does not import itself twice)."""

from disagg_tools.bench.replay import OUTCOMES, ReplayResult, RequestRecord, replay
from disagg_tools.bench.report import (
    plot_attainment_vs_rate,
    plot_latency_cdfs,
    summarize,
    to_markdown,
    to_text,
    write_report,
)
from disagg_tools.bench.traces import (
    TraceFormatError,
    TraceRequest,
    load_trace,
    prompt_text,
    scale_arrivals,
)

__all__ = [
    "OUTCOMES",
    "ReplayResult",
    "RequestRecord",
    "TraceFormatError",
    "TraceRequest",
    "load_trace",
    "plot_attainment_vs_rate",
    "plot_latency_cdfs",
    "prompt_text",
    "replay",
    "scale_arrivals",
    "summarize",
    "to_markdown",
    "to_text",
    "write_report",
]
