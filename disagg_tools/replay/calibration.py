"""Pieces of the simulator's validation against the live cluster that need no live cluster:
the simulator settings that mirror the live mechanics, and the calibration workload.
`disagg_tools.launcher.validate` runs the live side and compares.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from disagg_tools.replay.replayer import RequestRecord
from disagg_tools.simcluster.metrics import GapHistogram, percentile
from disagg_tools.traces import TraceRequest

__all__ = ["N_ISOLATED", "calibration_requests", "live_metrics", "live_mirror"]


def live_mirror(
    time_scale: float, router_overhead_s: float = 0.0, step_overhead_s: float = 0.0
) -> dict[str, Any]:
    """ClusterConfig overrides that make the simulator run the live simulated cluster's
    mechanics at `time_scale` (see `disagg_tools.simcluster.config.ClusterConfig`): every sleep
    of the simulated workers rounded to uvloop's 1 ms (× time scale in simulated time), a sequence
    joins a decode batch mid-step, no extra link latency (the live KV pull has none beyond its
    HTTP hop, which the router overhead covers), plus the two measured overheads."""
    return {
        "timer_quantum_s": 0.001 * time_scale,
        "join_mid_step": True,
        "link_latency_s": 0.0,
        "router_overhead_s": router_overhead_s,
        "step_overhead_s": step_overhead_s,
    }


def calibration_requests(time_scale: float) -> list[TraceRequest]:
    """A synthetic workload, from no trace: 12 isolated requests (one in flight at a time,
    prompts 64/512/2048, 48 output tokens), then 3 bursts of 8 at once (256 in, 96 out)."""
    reqs: list[TraceRequest] = []
    t = 0.0
    for i in range(12):
        reqs.append(TraceRequest(t, (64, 512, 2048)[i % 3], 48, index=len(reqs)))
        t += 0.6 * time_scale  # wall gap 0.6 s: the previous request is done by then
    for _ in range(3):
        reqs += [TraceRequest(t, 256, 96, index=len(reqs) + k) for k in range(8)]
        t += 2.0 * time_scale
    return reqs


N_ISOLATED = 12


def live_metrics(records: Iterable[RequestRecord]) -> dict[str, float | None]:
    """A live replay's latencies under the simulator's summary keys, computed as the simulator
    computes them, so validation compares like with like: TTFT and TPOT percentiles with the one
    `percentile` over the requests that finished (TPOT where there are two tokens or more), ITL
    from the same log-bucket `GapHistogram` the simulator streams its gaps into (it keeps no
    list of gaps, so the live side is binned the same way instead)."""
    ok = [r for r in records if r.outcome == "ok" and r.ttft_s is not None]
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    tpot = [t for t in (r.tpot_s for r in ok) if t is not None]
    gaps = GapHistogram()
    for r in ok:
        for g in r.itl_s:
            gaps.add(g)
    return {
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p90_s": percentile(ttft, 90),
        "tpot_p50_s": percentile(tpot, 50),
        "itl_p50_s": gaps.quantile(0.5) if gaps.count else None,
        "itl_p90_s": gaps.quantile(0.9) if gaps.count else None,
    }
