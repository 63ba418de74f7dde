"""A crowd through one router: every answer exact, or a clean 429 — nothing lost.

    python -m disagg_tools.loadgen.load --burst 2000             # 2,000 requests at one instant
    python -m disagg_tools.loadgen.load --ramp 2000 --ramp-s 20  # a linear ramp to 2,000 slots
    python -m disagg_tools.loadgen.load --burst 500 --no-stream  # non-streaming answers
    [--output-tokens 32] [--prompt-tokens 64] [--time-scale 20] [--redis private|shared]
    [--deadline-s 120] [--json FILE] [--keep-logs]

One router process (`disagg-router serve --config FILE`, uvloop) on loopback in front of
simulated workers (`disagg-router worker`, one process each) time-scaled so that the router is
the bottleneck, a private redis-server (or the shared one under a unique key prefix). The
client (`disagg_tools.loadgen.loadclient`, one aiohttp session, a connector as large as the crowd,
RLIMIT_NOFILE raised) knows every answer in advance from the sim's deterministic text.

Invariants (exit 1 when one fails):
    every request ends `ok` (exact text and finish reason) or `shed` (429 + Retry-After + an
    OpenAI JSON body): no 5xx, no wrong text, no cut stream, no hang, no connection error;
    once quiet: 0 reserved blocks and 0 stranded bytes in the router's view, 0 live leases and
    0 stranded entries in Redis, 0 live reservations in the router.

Reported: requests/s, tokens/s, TTFT and inter-token latency p50/p90/p99, router CPU-seconds
per 1,000 tokens (/proc/<pid>/stat), peak router RSS, Redis commands per request (INFO
commandstats delta; exact with the private Redis, polluted by other users with the shared one).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from disagg_tools.loadgen.entry import git_commit, raise_nofile, run_and_report
from disagg_tools.loadgen.load_cluster import Cluster, ClusterSpec
from disagg_tools.loadgen.loadclient import (
    LoadRequest,
    Result,
    failure_examples,
    failure_kinds,
    make_request,
    new_session,
    outcome_counts,
    percentiles,
    send,
)
from disagg_tools.loadgen.probes import (
    RssSampler,
    command_delta,
    listen_overflows,
    metric_sums,
    redis_commands,
    wait_quiet,
)
from disagg_tools.procs import process_cpu_s

__all__ = ["LoadSpec", "build_parser", "main", "run", "format_report"]

MODEL = "llama-3-8b"
_SLACK_S = 30.0


@dataclass(frozen=True, slots=True)
class LoadSpec:
    mode: str = "burst"  # burst | ramp
    n: int = 500
    ramp_s: float = 10.0
    hold_s: float = 10.0  # ramp: keep N slots busy this long after the ramp
    stream: bool = True
    chat: bool = True
    output_tokens: int = 32
    prompt_tokens: int = 64
    deadline_s: float = 120.0  # per request, wall seconds
    quiet_timeout_s: float = 40.0  # how long to wait for leftovers to clear after the traffic
    cluster: ClusterSpec = field(default_factory=ClusterSpec)
    allowed: tuple[str, ...] = ("ok", "shed")

    def __post_init__(self) -> None:
        if self.mode not in ("burst", "ramp"):
            raise ValueError("mode must be burst or ramp")
        if self.n < 1 or self.output_tokens < 1 or self.prompt_tokens < 1:
            raise ValueError("n, output_tokens and prompt_tokens must be >= 1")


def _requests(spec: LoadSpec, start: int, count: int) -> list[LoadRequest]:
    return [
        make_request(
            i,
            model=MODEL,
            prompt_tokens=spec.prompt_tokens,
            output_tokens=spec.output_tokens,
            stream=spec.stream,
            chat=spec.chat,
            mean_output_tokens=spec.cluster.mean_output_tokens,
        )
        for i in range(start, start + count)
    ]


async def _burst(session: aiohttp.ClientSession, url: str, spec: LoadSpec) -> list[Result]:
    reqs = _requests(spec, 0, spec.n)
    go = asyncio.Event()

    async def one(req: LoadRequest) -> Result:
        await go.wait()
        return await send(session, url, req, deadline_s=spec.deadline_s)

    tasks = [asyncio.create_task(one(r)) for r in reqs]
    await asyncio.sleep(0)  # every task is parked on `go`: they start in one loop iteration
    go.set()
    return await _gather_bounded(tasks, spec.deadline_s + _SLACK_S)


async def _ramp(session: aiohttp.ClientSession, url: str, spec: LoadSpec) -> list[Result]:
    """Slot i starts at i·ramp_s/N and sends back to back until ramp_s + hold_s have passed."""
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    stop_at = t0 + spec.ramp_s + spec.hold_s
    results: list[Result] = []
    counter = iter(range(10**9))
    pool = _requests(spec, 0, 64)  # bodies repeat by index mod 64: expected text is per body

    async def slot(i: int) -> None:
        await asyncio.sleep(max(0.0, t0 + i * spec.ramp_s / spec.n - loop.time()))
        while loop.time() < stop_at:
            k = next(counter)
            res = await send(session, url, pool[k % len(pool)], deadline_s=spec.deadline_s)
            res.index = k
            results.append(res)
            if res.outcome == "shed":
                await asyncio.sleep(min(2.0, float(res.retry_after or 1)))
            elif res.failed:
                await asyncio.sleep(0.1)  # a failing router must not be spun on

    tasks = [asyncio.create_task(slot(i)) for i in range(spec.n)]
    await _gather_bounded(tasks, spec.ramp_s + spec.hold_s + spec.deadline_s + _SLACK_S)
    return results


async def _gather_bounded(tasks: list[asyncio.Task[Any]], timeout_s: float) -> list[Any]:
    done, pending = await asyncio.wait(tasks, timeout=timeout_s)
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    return [t.result() for t in tasks if t in done and not t.cancelled() and not t.exception()]


def summarize(
    spec: LoadSpec,
    results: list[Result],
    wall_s: float,
    router_cpu_s: float,
    rss_peak: int,
    commands: dict[str, int],
    metrics: dict[str, float],
    left: Any,
    quiet_wait_s: float,
    sent: int,
) -> dict[str, Any]:
    ok = [r for r in results if r.outcome == "ok"]
    tokens = sum(r.tokens for r in ok)
    itl = [x for r in ok for x in r.itl_s]
    counts = outcome_counts(results)
    lost = sent - len(results)
    if lost:
        counts["hang"] = counts.get("hang", 0) + lost
    total_cmds = sum(commands.values())
    report: dict[str, Any] = {
        "mode": spec.mode,
        "n": spec.n,
        "stream": spec.stream,
        "endpoint": "chat" if spec.chat else "completions",
        "output_tokens": spec.output_tokens,
        "commit": git_commit(),
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "loadavg_1m": round(os.getloadavg()[0], 2),
        "requests": sent,
        "outcomes": counts,
        "wall_s": round(wall_s, 3),
        "requests_per_s": round(len(ok) / wall_s, 1) if wall_s else None,
        "tokens_per_s": round(tokens / wall_s, 1) if wall_s else None,
        "ttft_s": _rounded(percentiles([r.ttft_s for r in ok if r.ttft_s is not None])),
        "itl_s": _rounded(percentiles(itl)) if spec.stream else None,
        "router_cpu_s": round(router_cpu_s, 2),
        "router_cpu_s_per_1k_tokens": round(router_cpu_s / tokens * 1000, 4) if tokens else None,
        "router_rss_peak_mb": round(rss_peak / 2**20, 1),
        "redis_commands": total_cmds,
        "redis_commands_per_request": round(total_cmds / sent, 2) if sent else None,
        "redis_top_commands": dict(list(commands.items())[:8]),
        "router_5xx": sum(
            v
            for k, v in metrics.items()
            if k.startswith("disagg_router_requests_total{") and 'status="5' in k
        ),
        "leftovers": left.to_dict(),
        "quiet_wait_s": round(quiet_wait_s, 1),
        "failure_examples": failure_examples(results, spec.allowed),
        "failure_kinds": failure_kinds(results, spec.allowed),
    }
    violations = []
    bad = {k: v for k, v in counts.items() if k not in spec.allowed}
    if bad:
        violations.append(f"requests not ok/shed: {bad}")
    if not left.clean:
        violations.append(f"left over after {quiet_wait_s:.0f} s quiet: {left!r}")
    report["violations"] = violations
    return report


def _rounded(d: dict[str, float | None]) -> dict[str, float | None]:
    return {k: (None if v is None else round(v, 4)) for k, v in d.items()}


async def run(spec: LoadSpec, *, workdir: Path | None = None) -> dict[str, Any]:
    """Start the cluster, run the crowd, measure, check, stop everything; returns the report."""
    raise_nofile(max(4096, 3 * spec.n + 1024))
    own_dir = workdir is None
    workdir = workdir or Path(tempfile.mkdtemp(prefix="bench-load-"))
    cluster = Cluster(spec.cluster, workdir)
    try:
        await cluster.start()
        assert cluster.router is not None
        router = cluster.router
        url = cluster.router_url
        async with new_session(spec.n + 16) as session:
            # One request end to end first: a cold router is not what is being measured.
            warm = await send(session, url, _requests(spec, 10**6, 1)[0], deadline_s=30)
            if warm.outcome != "ok":
                raise RuntimeError(f"warm-up request failed: {warm!r}\n{router.tail()}")
            rss = RssSampler(lambda: router.pid, period_s=0.5)
            rss.start()
            cmds0 = await redis_commands(cluster.redis_url)
            cpu0, client0 = process_cpu_s(router.pid), process_cpu_s(os.getpid())
            overflows0 = listen_overflows()
            t0 = time.perf_counter()
            if spec.mode == "burst":
                results = await _burst(session, url, spec)
                sent = spec.n
            else:
                results = await _ramp(session, url, spec)
                sent = len(results)
            wall = max((r.t_end for r in results), default=t0) - t0
            cpu = process_cpu_s(router.pid) - cpu0
            client_cpu = process_cpu_s(os.getpid()) - client0
            overflows = listen_overflows() - overflows0
            commands = command_delta(cmds0, await redis_commands(cluster.redis_url))
            await rss.stop()
            left, waited = await wait_quiet(
                session, url, cluster.redis_url, cluster.key_prefix, spec.quiet_timeout_s
            )
            metrics = await metric_sums(session, url)
        report = summarize(
            spec, results, wall, cpu, rss.peak, commands, metrics, left, waited, sent
        )
        if not router.alive():
            report["violations"].append(f"the router died:\n{router.tail()}")
        report["client_cpu_s"] = round(client_cpu, 2)
        report["listen_overflows"] = overflows
        report["router_log_tail"] = router.tail(15)
        return report
    finally:
        cluster.stop()
        await cluster.cleanup_shared_keys()
        if own_dir:
            shutil.rmtree(workdir, ignore_errors=True)


def format_report(r: dict[str, Any]) -> str:
    def pct(d: dict[str, Any] | None, scale: float = 1000.0) -> str:
        if not d:
            return "-"
        return " / ".join("-" if v is None else f"{v * scale:.1f}" for v in d.values())

    left = r["leftovers"]
    lines = [
        f"disagg_tools.loadgen.load {r['mode']} n={r['n']} stream={r['stream']} "
        f"endpoint={r['endpoint']} "
        f"output_tokens={r['output_tokens']} commit={r['commit']} loadavg={r['loadavg_1m']}",
        f"  outcomes        {r['outcomes']}  (of {r['requests']} requests)",
        f"  throughput      {r['requests_per_s']} req/s, {r['tokens_per_s']} tokens/s "
        f"over {r['wall_s']} s",
        f"  TTFT ms         p50/p90/p99 {pct(r['ttft_s'])}",
        f"  ITL ms          p50/p90/p99 {pct(r['itl_s'])}",
        f"  router          {r['router_cpu_s']} CPU-s, {r['router_cpu_s_per_1k_tokens']} "
        f"CPU-s/1k tokens, peak RSS {r['router_rss_peak_mb']} MB, 5xx counted "
        f"{r['router_5xx']:.0f}; client {r.get('client_cpu_s')} CPU-s",
        f"  tcp             {r.get('listen_overflows')} listen-queue overflows on this machine "
        "during the run (TcpExt ListenOverflows)",
        f"  redis           {r['redis_commands_per_request']} commands/request "
        f"(top: {r['redis_top_commands']})",
        f"  left over       reserved_blocks={left['reserved_blocks']} "
        f"stranded_bytes={left['stranded_bytes']} live={left['live_reservations']} "
        f"redis leases={left['redis_live_leases']} "
        f"redis stranded={left['redis_stranded_entries']} (after {r['quiet_wait_s']} s)",
    ]
    for kind, count in r.get("failure_kinds", {}).items():
        lines.append(f"  failures        {count:6d} x {kind}")
    for ex in r["failure_examples"]:
        lines.append(f"  failure         {ex}")
    lines.append("  INVARIANTS      " + ("all hold" if not r["violations"] else "VIOLATED"))
    for v in r["violations"]:
        lines.append(f"  violation       {v}")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m disagg_tools.loadgen.load",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--burst", type=int, metavar="N", help="N requests in the same instant")
    mode.add_argument("--ramp", type=int, metavar="N", help="linear ramp to N concurrent")
    p.add_argument("--ramp-s", type=float, default=20.0)
    p.add_argument("--hold-s", type=float, default=10.0)
    p.add_argument("--no-stream", action="store_true")
    p.add_argument("--completions", action="store_true", help="/v1/completions, not chat")
    p.add_argument("--output-tokens", type=int, default=32)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--time-scale", type=float, default=20.0)
    p.add_argument("--prefill", type=int, default=1)
    p.add_argument("--decode", type=int, default=2)
    p.add_argument("--redis", choices=("private", "shared"), default="private")
    p.add_argument("--deadline-s", type=float, default=120.0)
    p.add_argument(
        "--router-set",
        action="append",
        default=[],
        metavar="KEY=YAML",
        help="extra router setting, e.g. admission='{max_waiters: 4096}'",
    )
    p.add_argument(
        "--router-env",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="extra environment variable of the router process",
    )
    p.add_argument("--json", type=Path, help="write the report here")
    p.add_argument("--keep-logs", action="store_true", help="keep the work directory")
    return p


def spec_from_args(ns: argparse.Namespace) -> LoadSpec:
    extra = {}
    for item in ns.router_set:
        key, _, value = item.partition("=")
        extra[key] = yaml.safe_load(value)
    cluster = ClusterSpec(
        n_prefill=ns.prefill,
        n_decode=ns.decode,
        time_scale=ns.time_scale,
        redis=ns.redis,
        router=extra,
        router_env=dict(item.partition("=")[::2] for item in ns.router_env),
    )
    return LoadSpec(
        mode="burst" if ns.burst else "ramp",
        n=ns.burst or ns.ramp,
        ramp_s=ns.ramp_s,
        hold_s=ns.hold_s,
        stream=not ns.no_stream,
        chat=not ns.completions,
        output_tokens=ns.output_tokens,
        prompt_tokens=ns.prompt_tokens,
        deadline_s=ns.deadline_s,
        cluster=cluster,
    )


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    spec = spec_from_args(ns)
    workdir = Path(tempfile.mkdtemp(prefix="bench-load-")) if ns.keep_logs else None
    return run_and_report(
        run(spec, workdir=workdir), format_report, workdir=workdir, json_path=ns.json
    )


if __name__ == "__main__":
    sys.exit(main())
