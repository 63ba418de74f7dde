"""A burst that overruns the estimates, live (issue 31): the router's preemption with exact
resume against today's forced growth, on the flood bench's processes.

    python -m disagg_tools.overhead.flood_preemption [--rate 4] [--duration 15] [--out DIR]

The flood bench's cluster (disagg_tools/overhead/flood_cluster.py: the real router, Redis, one
prefill and one decode stand-in whose answers are exactly `max_tokens` long) with the router's
learning estimator (`online_quantile`, `min_samples` 5), started twice, same seed: with
`preemption: {enabled: false}` (today's forced growth) and with it on (the default). Each run:

    teach  `--teach` streamed completions under max_tokens `--short` (66): the estimator learns
           answers of ~70 tokens for the asked bucket max_tokens 65-128
    burst  Poisson at `--rate` for `--duration` s under max_tokens `--long` (128), the same
           class: each answer outgrows a reservation sized for ~70 tokens, on a decode worker
           of `--kv-blocks` that holds ~10 such answers at once

Per run, over the burst: goodput (answers complete with TTFT within `--ttft-slo-s`, per second
of the burst), its ratio to forced growth's, the answers, p99 TTFT of the streams not preempted
and of those preempted (a preempted stream's client sees one gap of at least a prefill: a gap
over `--prefill-ms` marks it; the router's own count beside it), the router's counters
(preemptions by reason, per 1,000 requests, tokens re-prefilled, forced growths, overruns).
`<out>/flood-preemption.json` and `.md`. About a minute a pair of runs; `--repeat 3` runs
off, on, off, on, off, on and adds each figure's median over the repeats (the shared machine's
load moves one run's figures by tens of per cent).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import shlex
import statistics
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from disagg_tools.overhead.flood_cluster import TENANT_KEYS, ClusterSpec, start_cluster
from disagg_tools.simcluster.metrics import percentile

__all__ = ["main", "parse_args", "run_mode"]

_clock = time.perf_counter
_PROMPT = "Summarise in one line why a router keeps tenants apart when one floods. " * 3
_METRICS = (
    "disagg_router_preemptions_total",
    "disagg_router_preempted_tokens_total",
    "disagg_router_reservation_forced_growth_total",
    "disagg_router_reservation_overruns_total",
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m disagg_tools.overhead.flood_preemption",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    a = p.add_argument
    a("--redis-url", default="redis://127.0.0.1:6379/0")
    a("--model", default="llama-3-8b")
    a("--kv-blocks", type=int, default=120, help="the decode worker's room (blocks of 16)")
    a("--short", type=int, default=66, help="the taught answers' max_tokens (= their length)")
    a("--long", type=int, default=128, help="the burst's max_tokens (= its answers' length)")
    a("--teach", type=int, default=20, help="taught answers before the burst")
    a("--rate", type=float, default=4.0, help="the burst's requests/s (Poisson)")
    a("--duration", type=float, default=15.0, help="the burst's arrivals (s)")
    a("--interval-ms", type=float, default=20.0, help="stand-in decode: time between tokens")
    a("--prefill-ms", type=float, default=100.0, help="stand-in prefill time")
    a("--first-token-ms", type=float, default=20.0, help="stand-in decode: to its first token")
    a("--max-wait-s", type=float, default=10.0, help="the router's admission.max_wait_s")
    a("--ttft-slo-s", type=float, default=2.0, help="goodput: answers with TTFT within this")
    a("--seed", type=int, default=0)
    a("--modes", default="off,on", help="preemption off (forced growth), on, or both")
    a("--repeat", type=int, default=1, help="the modes run in turn this many times (same seed)")
    a("--out", type=Path, default=Path("bench-results/flood"))
    return p.parse_args(argv)


@dataclass(slots=True)
class Stream:
    """One streamed completion as the client saw it; times in seconds from its send."""

    sent: float
    status: int = 0
    ttft: float | None = None
    tokens: int = 0
    max_gap: float = 0.0
    done: bool = False
    error: str | None = None


async def _shoot(
    session: aiohttp.ClientSession, url: str, body: bytes, stream: Stream, t0: float
) -> None:
    headers = {"Authorization": f"Bearer {TENANT_KEYS['victim']}"}
    headers["Content-Type"] = "application/json"
    start = _clock()
    last = start
    try:
        async with session.post(url, data=body, headers=headers) as resp:
            stream.status = resp.status
            if resp.status != 200:
                await resp.read()
                return
            async for line in resp.content:
                if not line.startswith(b"data: "):
                    continue
                if line.startswith(b"data: [DONE]"):
                    stream.done = True
                elif b'"error"' in line:
                    stream.error = "stream_error"
                elif b'"text":"' in line and b'"text":""' not in line:
                    now = _clock()
                    if stream.ttft is None:
                        stream.ttft = now - start
                    else:
                        stream.max_gap = max(stream.max_gap, now - last)
                    last = now
                    stream.tokens += 1
    except (TimeoutError, aiohttp.ClientError, OSError) as exc:
        stream.error = type(exc).__name__


def _body(model: str, max_tokens: int) -> bytes:
    return orjson.dumps(
        {
            "model": model,
            "prompt": _PROMPT,
            "max_tokens": max_tokens,
            "stream": True,
            "ignore_eos": True,
            "temperature": 0.0,
        }
    )


async def _load(
    base_url: str, body: bytes, rate: float, duration_s: float, seed: int
) -> list[Stream]:
    """Poisson arrivals at `rate` for `duration_s`, then until every stream has ended."""
    rng = random.Random(seed)
    streams: list[Stream] = []
    tasks: list[asyncio.Task[None]] = []
    timeout = aiohttp.ClientTimeout(total=120)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        url = f"{base_url}/v1/completions"
        t0 = _clock()
        due = rng.expovariate(rate)
        while due < duration_s:
            await asyncio.sleep(max(0.0, t0 + due - _clock()))
            stream = Stream(_clock() - t0)
            streams.append(stream)
            tasks.append(asyncio.create_task(_shoot(session, url, body, stream, t0)))
            due += rng.expovariate(rate)
        await asyncio.gather(*tasks)
    return streams


async def _scrape(base_url: str) -> dict[str, float]:
    """The router's preemption counters, summed over their labels ("<name>{reason=...}" too)."""
    async with aiohttp.ClientSession() as session:
        async with session.get(f"{base_url}/metrics") as resp:
            text = await resp.text()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        for name in _METRICS:
            if line.startswith(name):
                key, _, value = line.rpartition(" ")
                out[key] = out.get(key, 0.0) + float(value)
                if key != name:
                    out[name] = out.get(name, 0.0) + float(value)
    return out


def summarise(streams: list[Stream], ns: argparse.Namespace) -> dict[str, Any]:
    whole = [s for s in streams if s.status == 200 and s.done and s.tokens == ns.long]
    preempted_gap = ns.prefill_ms / 1e3
    cut = [s for s in whole if s.max_gap > preempted_gap]
    kept = [s for s in whole if s.max_gap <= preempted_gap]
    good = [s for s in whole if s.ttft is not None and s.ttft <= ns.ttft_slo_s]
    statuses: dict[str, int] = {}
    for s in streams:
        statuses[str(s.status or s.error)] = statuses.get(str(s.status or s.error), 0) + 1
    return {
        "requests": len(streams),
        "answered_whole": len(whole),
        "goodput_per_s": len(good) / ns.duration,
        "ttft_p50_s": percentile([s.ttft for s in whole if s.ttft is not None], 50),
        "ttft_p99_s": percentile([s.ttft for s in whole if s.ttft is not None], 99),
        "ttft_p99_not_preempted_s": percentile([s.ttft for s in kept if s.ttft is not None], 99),
        "ttft_p99_preempted_s": percentile([s.ttft for s in cut if s.ttft is not None], 99),
        "streams_with_a_resume_gap": len(cut),
        "max_gap_p99_s": percentile([s.max_gap for s in whole], 99),
        "statuses": statuses,
        "stream_errors": sum(1 for s in streams if s.error is not None),
    }


async def run_mode(ns: argparse.Namespace, enabled: bool, log_dir: Path) -> dict[str, Any]:
    extra = [
        "loops: {histogram_refresh_s: 0.2}",
        f"preemption: {{enabled: {'true' if enabled else 'false'}}}",
    ]
    spec = ClusterSpec(
        ns.model, ns.redis_url, "fifo", ns.kv_blocks, ns.interval_ms, ns.prefill_ms,
        ns.first_token_ms, ns.max_wait_s, 1.0, 1.0, 0,
    )  # fmt: skip
    spec = replace(
        spec,
        estimator="online_quantile",
        estimator_args="{min_samples: 5}",
        extra_config="\n".join(extra),
    )
    cluster = await start_cluster(spec, log_dir)
    try:
        # Taught a few at a time (the estimator learns each answer at its end).
        short = _body(ns.model, ns.short)
        await _load(cluster.base_url, short, 4.0, ns.teach / 4.0, ns.seed)
        await asyncio.sleep(1.0)  # the histogram cache refreshes (0.2 s)
        before = await _scrape(cluster.base_url)
        streams = await _load(
            cluster.base_url, _body(ns.model, ns.long), ns.rate, ns.duration, ns.seed + 1
        )
        after = await _scrape(cluster.base_url)
    finally:
        deleted = await cluster.close()
    row = summarise(streams, ns)
    counters = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    row["router"] = counters
    preemptions = counters.get("disagg_router_preemptions_total", 0.0)
    row["preemptions"] = preemptions
    row["preemptions_per_1k"] = 1000.0 * preemptions / max(1, len(streams))
    row["preempted_tokens"] = counters.get("disagg_router_preempted_tokens_total", 0.0)
    row["forced_growth"] = counters.get("disagg_router_reservation_forced_growth_total", 0.0)
    row["overruns"] = counters.get("disagg_router_reservation_overruns_total", 0.0)
    row["router_config"] = cluster.config_text
    row["redis_keys_deleted"] = deleted
    return row


_KEYS = [
        "requests", "answered_whole", "goodput_per_s", "goodput_ratio", "ttft_p50_s",
        "ttft_p99_s", "ttft_p99_not_preempted_s", "ttft_p99_preempted_s",
        "streams_with_a_resume_gap", "preemptions", "preemptions_per_1k", "preempted_tokens",
        "forced_growth", "overruns", "max_gap_p99_s", "stream_errors",
]  # fmt: skip


def markdown(report: dict[str, Any]) -> str:
    runs: dict[str, dict[str, Any]] = report["runs"]
    labels = list(runs)
    lines = ["| | " + " | ".join(labels) + " |", "|---|" + "---|" * len(labels)]
    for key in _KEYS:
        cells = []
        for label in labels:
            v = runs[label].get(key)
            cells.append(f"{v:.3f}" if isinstance(v, float) else str(v))
        lines.append(f"| {key} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    ns = parse_args(args)
    log_dir = ns.out / "logs-preemption"
    log_dir.mkdir(parents=True, exist_ok=True)
    runs: dict[str, dict[str, Any]] = {}
    names = {"off": "forced growth (off)", "on": "preemption (on)"}
    modes = [m for m in ns.modes.split(",") if m]
    for i in range(ns.repeat):
        for mode in modes:
            label = names[mode] + (f" #{i + 1}" if ns.repeat > 1 else "")
            runs[label] = asyncio.run(run_mode(ns, mode == "on", log_dir))
    if ns.repeat > 1:  # each figure's median over the repeats, per mode
        for mode in modes:
            rows = [runs[names[mode] + f" #{i + 1}"] for i in range(ns.repeat)]
            runs[names[mode] + " median"] = {
                k: statistics.median(r[k] for r in rows)
                if all(r.get(k) is not None for r in rows)
                else None
                for k in _KEYS
                if k not in ("goodput_ratio", "statuses")
            }
    base = runs.get(names["off"] + (" median" if ns.repeat > 1 else ""), {}).get("goodput_per_s")
    for row in runs.values():
        row["goodput_ratio"] = row["goodput_per_s"] / base if base else None
    command = shlex.join(["python", "-m", "disagg_tools.overhead.flood_preemption", *args])
    report = {"command": command, "settings": {k: str(v) for k, v in vars(ns).items()}}
    report["runs"] = runs
    ns.out.mkdir(parents=True, exist_ok=True)
    (ns.out / "flood-preemption.json").write_bytes(orjson.dumps(report, option=orjson.OPT_INDENT_2))
    text = f"`{command}`\n\n" + markdown(report)
    (ns.out / "flood-preemption.md").write_text(text)
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
