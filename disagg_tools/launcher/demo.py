"""`disagg-router demo`: a local cluster, real trace traffic, a report — in one command.

Starts Redis (REDIS_URL, else a private redis-server, else the in-process store), 2 prefill and
2 decode simulated workers and the router; replays a slice of the Azure conversation trace
through the router (time-scaled), with a progress bar on a terminal; prints the report; shuts
everything down. `--plot FILE` also writes the TTFT and ITL distributions
(disagg_tools/launcher/demo_plot.py).
The router places on the workers' own facts: their KV events and exact prompt token ids (the
demo tokenizer, disagg_tools/launcher/demo_tokenizer.py), and the report says so from the
router's /admin/state; `--no-kv-events` runs it on the estimated affinity and the character
estimate instead.
With `--serve` it keeps the cluster up for curl or the `openai` client until Ctrl-C.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
from pathlib import Path
from typing import Any

import aiohttp

from disagg_tools.launcher.demo_plot import plot_problem, write_latency_plot
from disagg_tools.launcher.localcluster import ClusterShape, local_cluster
from disagg_tools.progress import ReplayBar
from disagg_tools.replay.replay_report import summarize, to_text
from disagg_tools.replay.replayer import replay
from disagg_tools.traces import TRACE_DIR, TraceRequest, load_trace

__all__ = ["add_demo_arguments", "run_demo", "default_trace", "facts_line"]

TRACE_NAME = "AzureLLMInferenceTrace_conv.csv"


def default_trace() -> Path | None:
    """The Azure conversation trace in ../shared/traces, looked for beside the cwd and beside
    the repository (`disagg_tools.traces.TRACE_DIR`, or $DISAGG_TRACES)."""
    for where in (Path.cwd().parent / "shared" / "traces", TRACE_DIR):
        candidate = where / TRACE_NAME
        if candidate.is_file():
            return candidate
    return None


def _synthetic_trace(n: int) -> list[TraceRequest]:
    """A stand-in when no trace file is at hand: conversation-like lengths, 5 req/s."""
    import random

    rng = random.Random(0)
    out, t = [], 0.0
    for i in range(n):
        t += rng.expovariate(5.0)
        out.append(
            TraceRequest(
                arrival_s=t,
                prompt_tokens=int(rng.lognormvariate(6.7, 0.8)) + 16,
                output_tokens=max(1, int(rng.lognormvariate(4.9, 0.9))),
                prefix_hash_ids=(),
                index=i,
            )
        )
    return out


def add_demo_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--requests", type=int, default=200, help="trace requests to replay")
    parser.add_argument("--trace", help=f"trace file (default: ../shared/traces/{TRACE_NAME})")
    parser.add_argument(
        "--time-scale",
        type=float,
        default=10.0,
        help="run the simulated GPUs (and the arrivals) this much faster",
    )
    parser.add_argument("--rate-scale", type=float, default=1.0, help="multiply the arrival rate")
    parser.add_argument("--prefill", type=int, default=2)
    parser.add_argument("--decode", type=int, default=2)
    parser.add_argument("--model", default="llama-3-8b")
    parser.add_argument("--gpu", default="h100")
    parser.add_argument("--policy", default="two_sided")
    parser.add_argument("--estimator", default="online_quantile")
    parser.add_argument("--slo-ttft", type=float, default=2.0, help="seconds")
    parser.add_argument("--slo-tpot", type=float, default=0.1, help="seconds")
    parser.add_argument(
        "--serve", action="store_true", help="keep the cluster up (no replay) until Ctrl-C"
    )
    parser.add_argument("--port", type=int, default=0, help="router port with --serve")
    parser.add_argument(
        "--no-kv-events",
        dest="kv_events",
        action="store_false",
        help="no KV events and no tokenizer: the router's estimated affinity and character counts",
    )
    parser.add_argument(
        "--plot",
        metavar="FILE",
        help="also write the TTFT and ITL distributions to FILE (.png or .svg; needs matplotlib)",
    )


def _load(ns: argparse.Namespace) -> tuple[list[TraceRequest], str]:
    path = Path(ns.trace) if ns.trace else default_trace()
    if path is None:
        return _synthetic_trace(ns.requests), "synthetic conversation-like trace (no trace file)"
    return load_trace(path, limit=ns.requests), str(path)


async def _serve_until_signal(url: str) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    print(f"router: {url}   (OpenAI base URL {url}/v1; Ctrl-C stops the cluster)", flush=True)
    await stop.wait()


async def _admin_state(url: str) -> dict[str, Any]:
    async with aiohttp.ClientSession() as s, s.get(url + "/admin/state") as resp:
        state: dict[str, Any] = await resp.json()
    return state


def facts_line(state: dict[str, Any], model: str) -> str:
    """What placement stood on, from the router's /admin/state: each worker's prefix-cache source
    ("events": its KV events, else "estimated") and how the model's prompts were counted."""
    workers = state["workers"]
    events = [w for w in workers if w["prefix_cache"]["source"] == "events"]
    caches = f"events on {len(events)}/{len(workers)} workers"
    if events:
        blocks = sum(w["prefix_cache"]["kv_events"]["blocks"] for w in events)
        caches += f" ({blocks} blocks indexed)"
    if len(events) < len(workers):
        caches += f", estimated on {len(workers) - len(events)}"
    mode = state["prompt_tokens"].get(model, {})
    if mode.get("source") == "tokenizer":
        tokens = "exact (tokenizer)" if mode.get("loaded") else "estimated (tokenizer not loaded)"
    else:
        tokens = f"estimated ({mode.get('chars_per_token', '?')} characters a token)"
    return f"prefix caches: {caches}; prompt tokens: {tokens}"


def _plot_refused(ns: argparse.Namespace) -> str | None:
    """Why `--plot` cannot be honoured, checked before any cluster starts."""
    if not getattr(ns, "plot", None):
        return None
    if ns.serve:
        return "disagg-router demo: --plot needs a replay to plot; it does not go with --serve"
    return plot_problem(ns.plot)


async def run_demo(ns: argparse.Namespace) -> int:
    refused = _plot_refused(ns)
    if refused is not None:
        print(refused, file=sys.stderr)
        return 2
    shape = ClusterShape(
        n_prefill=ns.prefill,
        n_decode=ns.decode,
        model=ns.model,
        gpu=ns.gpu,
        time_scale=ns.time_scale,
        policy=ns.policy,
        estimator=ns.estimator,
        router_port=ns.port,
        prefix_facts=ns.kv_events,
    )
    requests, source = ([], "") if ns.serve else _load(ns)
    print(
        f"starting {ns.prefill} prefill + {ns.decode} decode simulated {ns.gpu} workers "
        f"({ns.model}, time scale {ns.time_scale:g}x) and the router ...",
        flush=True,
    )
    async with local_cluster(shape, redis_url=os.environ.get("REDIS_URL")) as cluster:
        print(f"state: {cluster.redis_note}", flush=True)
        if ns.serve:
            await _serve_until_signal(cluster.router_url)
            return 0
        cap = max(r.output_tokens for r in requests)
        print(
            f"replaying {len(requests)} requests from {source} (max_tokens cap {cap}) ...",
            flush=True,
        )
        bar = ReplayBar(sys.stderr, desc="demo")  # drawn on a terminal only
        try:
            result = await replay(
                cluster.router_url,
                requests,
                model=ns.model,
                endpoint="chat",
                max_tokens_cap=cap,
                time_scale=ns.time_scale,
                rate_scale=ns.rate_scale,
                timeout_s=600.0,
                progress=bar,
            )
        finally:
            bar.close()
        summary = summarize(result, slo_ttft_s=ns.slo_ttft, slo_tpot_s=ns.slo_tpot)
        await asyncio.sleep(0.2)  # let the last releases land before reading the state
        state = await _admin_state(cluster.router_url)
    reserved = sum(w["reserved_blocks"] for w in state["workers"])
    print()
    print(
        f"disagg-router demo — policy {ns.policy}, estimator {ns.estimator}, "
        f"{ns.prefill}P:{ns.decode}D {ns.gpu} {ns.model}"
    )
    print(to_text(summary), end="")
    print(f"decode blocks still reserved after the run: {reserved}")
    print(facts_line(state, ns.model))
    if ns.plot:
        written = write_latency_plot(
            result, ns.plot, slo_ttft_s=ns.slo_ttft, slo_tpot_s=ns.slo_tpot
        )
        print(f"plot: {written}")
    req = summary["requests"]
    ok = req["accounted"] and reserved == 0 and req["ok"] > 0
    if not ok:
        print(
            "demo FAILED: requests unaccounted for, no success, or reservations leaked",
            file=sys.stderr,
        )
    return 0 if ok else 1
