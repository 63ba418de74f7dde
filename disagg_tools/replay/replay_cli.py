"""`disagg-router bench`: replay a trace against an endpoint and report, or search for goodput.

    disagg-router bench --url http://127.0.0.1:8000 --trace AzureLLMInferenceTrace_conv.csv \
        --requests 500 --rate-scale 2 --slo-ttft 1 --slo-tpot 0.1 --out results/

`disagg_tools.launcher.main` mounts this with `add_bench_arguments(subparser)` and runs
`await run_bench(ns)`; `python -m disagg_tools.replay.replay_cli` runs it standalone.
`--search` finds the goodput (DistServe: the highest rate at which at least 90 % of requests
meet both SLOs) with `disagg_tools.goodput`, the search the simulator experiments use too.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import orjson

from disagg_tools.goodput import goodput_search
from disagg_tools.progress import ReplayBar, note
from disagg_tools.replay.replay_report import (
    PLOTS_UNAVAILABLE,
    plot_attainment_vs_rate,
    summarize,
    to_markdown,
    to_text,
    write_report,
)
from disagg_tools.replay.replayer import ReplayResult, replay
from disagg_tools.traces import TraceFormatError, TraceRequest, load_trace

__all__ = ["add_bench_arguments", "main", "run_bench"]


# ── command line ───────────────────────────────────────────────────────────────────────────────


def add_bench_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the `bench` options to `parser` (a subcommand parser or a fresh one)."""
    p = parser
    p.add_argument("--url", required=True, help="OpenAI-compatible base URL (with or without /v1)")
    p.add_argument(
        "--trace",
        required=True,
        type=Path,
        help="Azure CSV, Mooncake JSONL or length-only CSV (format detected from the header)",
    )
    p.add_argument("--requests", type=int, default=None, metavar="N", help="replay N requests")
    p.add_argument("--start", type=int, default=0, metavar="K", help="skip the first K rows")
    p.add_argument(
        "--rate-scale",
        type=float,
        default=1.0,
        metavar="X",
        help="multiply the trace's request rate by X (start of a --goodput-search)",
    )
    p.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        metavar="S",
        help="run S times faster on the wall clock (simulated workers must be "
        "started with the same speed-up); reported times are real-cluster seconds",
    )
    p.add_argument(
        "--poisson-rate",
        type=float,
        default=None,
        metavar="R",
        help="replace arrivals with a Poisson process at R req/s (required for length-only traces)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of --poisson-rate arrivals")
    p.add_argument("--slo-ttft", type=float, default=2.0, metavar="S", help="TTFT SLO, seconds")
    p.add_argument("--slo-tpot", type=float, default=0.1, metavar="S", help="TPOT SLO, seconds")
    p.add_argument("--model", default="sim", help="model name sent in the body")
    p.add_argument("--endpoint", choices=("chat", "completions"), default="chat")
    p.add_argument(
        "--max-tokens-cap",
        type=int,
        default=None,
        metavar="N",
        help="max_tokens sent with every request (default: the largest output "
        "length among the replayed requests)",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=600.0,
        metavar="S",
        help="per-request timeout, real-cluster seconds",
    )
    p.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer ...'")
    p.add_argument(
        "--no-oracle-header",
        action="store_true",
        help="do not send the true output length as X-Sim-Output-Tokens",
    )
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        metavar="DIR",
        help="write summary.json, report.md and PNG plots here",
    )
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    p.add_argument(
        "--goodput-search",
        action="store_true",
        help="search the highest rate scale with >= 90%% SLO attainment",
    )
    p.add_argument("--search-steps", type=int, default=8, help="replays a search may run")
    return p


async def run_bench(ns: argparse.Namespace) -> int:
    """Run the bench described by `ns`: 0 done, 1 no request succeeded, 2 bad input."""
    err = sys.stderr
    try:
        reqs = load_trace(
            ns.trace, limit=ns.requests, start=ns.start, poisson_rate=ns.poisson_rate, seed=ns.seed
        )
    except (OSError, TraceFormatError, ValueError) as exc:
        print(f"bench: {exc}", file=err)
        return 2
    if not reqs:
        print(f"bench: no requests selected from {ns.trace}", file=err)
        return 2
    cap = ns.max_tokens_cap or max(1, max(r.output_tokens for r in reqs))

    async def once(rate_scale: float) -> ReplayResult:
        bar = ReplayBar(err, desc=f"bench rate x{rate_scale:g}")
        try:
            return await replay(
                ns.url,
                reqs,
                model=ns.model,
                endpoint=ns.endpoint,
                max_tokens_cap=cap,
                time_scale=ns.time_scale,
                rate_scale=rate_scale,
                oracle_header=not ns.no_oracle_header,
                api_key=ns.api_key,
                timeout_s=ns.timeout,
                progress=bar,
            )
        finally:
            bar.close()

    if ns.goodput_search:
        return await _search(ns, reqs, once)
    result = await once(ns.rate_scale)
    slo = {"slo_ttft_s": ns.slo_ttft, "slo_tpot_s": ns.slo_tpot}
    if ns.out is not None:
        summary = write_report(result, ns.out, plots=not ns.no_plots, **slo)
        print(f"bench: wrote {ns.out}/summary.json and report.md", file=err)
    else:
        summary = summarize(result, **slo)
    print(to_text(summary), end="")
    return 0 if summary["requests"]["ok"] else 1


async def _search(
    ns: argparse.Namespace,
    reqs: list[TraceRequest],
    once: Callable[[float], Awaitable[ReplayResult]],
) -> int:
    summaries: list[dict[str, Any]] = []

    async def attainment_at(rate_scale: float) -> float:
        summary = summarize(await once(rate_scale), slo_ttft_s=ns.slo_ttft, slo_tpot_s=ns.slo_tpot)
        summaries.append(summary)
        att = summary["slo"]["attainment"] or 0.0
        note(f"bench: rate x{rate_scale:g}: attainment {att:.1%}")  # above the bars
        return float(att)

    found = await goodput_search(
        attainment_at, start=ns.rate_scale, max_steps=ns.search_steps, progress=sys.stderr
    )
    if found.rate_scale is None:
        print(f"goodput: no probed rate scale met {found.target:.0%} attainment", end="\n")
    else:
        span = max(r.arrival_s for r in reqs)
        rps = f" = {(len(reqs) - 1) / span * found.rate_scale:.2f} req/s" if span > 0 else ""
        print(f"goodput: rate scale x{found.rate_scale:g}{rps} at {found.attainment:.1%}")
    if ns.out is not None:
        ns.out.mkdir(parents=True, exist_ok=True)
        doc = {
            "goodput_rate_scale": found.rate_scale,
            "attainment": found.attainment,
            "target": found.target,
            "points": found.points,
            "runs": summaries,
        }
        (ns.out / "goodput.json").write_bytes(orjson.dumps(doc, option=orjson.OPT_INDENT_2))
        (ns.out / "goodput.md").write_text(
            "\n\n".join(f"## rate x{s['rate_scale']:g}\n\n{to_markdown(s)}" for s in summaries),
            encoding="utf-8",
        )
        if not ns.no_plots and not plot_attainment_vs_rate(
            found.points, ns.out / "attainment_vs_rate.png"
        ):
            print(PLOTS_UNAVAILABLE, file=sys.stderr)
    return 0 if found.rate_scale is not None else 1


def main(argv: list[str] | None = None) -> int:
    """Standalone entry: `python -m disagg_tools.replay.replay_cli --url ... --trace ...`."""
    parser = add_bench_arguments(argparse.ArgumentParser(prog="disagg-router bench"))
    return asyncio.run(run_bench(parser.parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
