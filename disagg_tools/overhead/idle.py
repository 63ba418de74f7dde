"""What a router costs when nobody asks it anything: CPU ms per second with 4 workers, idle.

    python -m disagg_tools.overhead.idle [--targets ours,ours_dropin,vllm,sglang] [--idle-s 20]
        [--per-role 1]

Four `disagg_tools.overhead.fixed_worker` processes (two prefill, two decode), then each
router in turn: started against all four, one short stream through it (it is up and has
probed them), `--settle-s` of quiet (start-up work done), then `--idle-s` of no traffic at
all, over which the router process's CPU (the scheduler's run time of every thread and child,
from /proc) is read. What is left is its background work: health probes, load polls, store
refreshes, lease and budget ticks. Also run by `python -m disagg_tools.overhead --idle-s N`.
`ours_dropin` (the deployed command line: no file, `--prefill`/`--decode` twice each,
`--redis-url`) shows what the Redis store's background round trips cost on top.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from disagg_tools import uvrun
from disagg_tools.overhead.idle_threads import thread_delta, thread_readings
from disagg_tools.overhead.targets import (
    fixed_worker_command,
    router_command,
    wait_listening,
    wait_ready,
)
from disagg_tools.procs import HOST, Child, free_port, process_tree_cpu_s, process_tree_run_s

__all__ = ["idle_markdown", "idle_phase", "main"]


def _readings(pid: int) -> tuple[float, float, float]:
    """(now, CPU in 10 ms ticks, CPU from the scheduler's nanosecond run time) of a router and
    its descendants: an idle router spends ~1 ms/s, which ticks over 20 s read only to ±0.5,
    so the run time is the number reported and the ticks a cross-check."""
    return time.perf_counter(), process_tree_cpu_s(pid), process_tree_run_s(pid)


async def _workers(
    ns: argparse.Namespace, log_dir: Path
) -> tuple[list[Child], list[str], list[str]]:
    procs: list[Child] = []
    urls: dict[str, list[str]] = {"prefill": [], "decode": []}
    per_role = getattr(ns, "per_role", 2)  # the ladder's `--idle-s` phase: two of each
    for role in ("prefill",) * per_role + ("decode",) * per_role:
        port = free_port()
        cmd = fixed_worker_command(role, port, ns.model, interval_ms=20, prefill_ms=10)
        proc = Child(f"idle-worker-{role}-{len(procs)}", cmd, core=ns.load_core_, log_dir=log_dir)
        procs.append(proc)
        await wait_listening(port, proc)
        urls[role].append(f"http://{HOST}:{port}")
    return procs, urls["prefill"], urls["decode"]


async def idle_phase(ns: argparse.Namespace, log_dir: Path) -> list[dict[str, Any]]:
    """One router at a time against the same four idle workers."""
    targets = [t for t in ns.targets if t != "baseline"]
    workers, prefill, decode = await _workers(ns, log_dir)
    out: list[dict[str, Any]] = []
    try:
        for name in targets:
            port = free_port()
            cmd, env = router_command(
                name, ns, prefill, decode, port, log_dir, config_name=f"idle-{name}"
            )
            cwd = ns.ours_src if name == "ours_alt" else None
            proc = Child(
                f"idle-router-{name}", cmd, core=ns.router_core_, log_dir=log_dir, env=env, cwd=cwd
            )
            try:
                await wait_ready((HOST, port), proc)
                await asyncio.sleep(ns.settle_s)
                load = os.getloadavg()[0]
                t0, c0, r0 = _readings(proc.pid)
                th0 = thread_readings(proc.pid)
                await asyncio.sleep(ns.idle_s)
                t1, c1, r1 = _readings(proc.pid)
                threads = thread_delta(th0, thread_readings(proc.pid))
                if not proc.alive():
                    raise RuntimeError(f"{proc.name} died:\n{proc.tail()}")
            finally:
                proc.stop()
            r = {
                "target": name,
                "workers": len(workers),
                "idle_s": round(t1 - t0, 2),
                "router_cpu_s": round(r1 - r0, 4),
                "cpu_ms_per_s": round((r1 - r0) / (t1 - t0) * 1e3, 3),
                "tick_ms_per_s": round((c1 - c0) / (t1 - t0) * 1e3, 2),  # utime + stime
                "loadavg_1m": load,
                # Wake-ups: the scheduler's timeslices, every thread (idle_threads.py).
                "wakes_per_s": round(sum(t.wakes for t in threads) / (t1 - t0), 1),
                "threads": [
                    {
                        "name": t.name,
                        "run_ms_per_s": round(t.run_ns / 1e6 / (t1 - t0), 3),
                        "wakes_per_s": round(t.wakes / (t1 - t0), 1),
                    }
                    for t in threads
                    if t.wakes
                ],
            }
            print(
                f"[idle] {name:>10} cpu={r['cpu_ms_per_s']} ms/s over {r['idle_s']} s, "
                f"{r['wakes_per_s']} wakes/s (load {load:.2f}); threads: {r['threads']}",
                file=sys.stderr,
                flush=True,
            )
            out.append(r)
    finally:
        for w in workers:
            w.stop()
    return out


def idle_markdown(runs: list[dict[str, Any]], idle_s: float) -> str:
    if not runs:
        return ""
    workers = runs[0]["workers"]
    lines = [
        f"### Idle: {workers} workers ({workers // 2} prefill + {workers // 2} decode), "
        f"no traffic, {idle_s:g} s",
        "",
        "Router CPU from the scheduler's nanosecond run time (`/proc/<pid>/task/*/schedstat`);"
        " the utime + stime column counts 10 ms ticks, exact to "
        f"±{10 / idle_s:.2f} ms/s over the window.",
        "",
        "| target | router CPU-s | **router CPU ms/s** | (utime + stime ms/s) | wake-ups/s "
        "| load average (1 min) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in runs:
        lines.append(
            f"| {r['target']} | {r['router_cpu_s']:.4f} | {r['cpu_ms_per_s']:.3f} | "
            f"{r.get('tick_ms_per_s', float('nan')):.2f} | {r.get('wakes_per_s', float('nan'))} "
            f"| {r['loadavg_1m']:.2f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m disagg_tools.overhead.idle",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--targets",
        default="ours,ours_dropin,vllm",
        help="comma list of ours, ours_redis, ours_alt, ours_dropin, sglang, vllm",
    )
    p.add_argument("--model", default="llama-3-8b")
    p.add_argument("--adapter", default="vllm", choices=("vllm", "sim"))
    p.add_argument(
        "--redis-url", default="redis://127.0.0.1:6379/0", help="ours_redis, ours_dropin"
    )
    p.add_argument("--router-core", type=int, default=0)
    p.add_argument("--load-core", type=int, default=1)
    p.add_argument("--no-pin", dest="pin", action="store_false")
    p.add_argument("--ours-src", default=None)
    p.add_argument("--alt-redis", action="store_true", help="ours_alt with the Redis store")
    p.add_argument("--tokenizer", default=None, help="ours, ours_redis: exact prompt counts")
    p.add_argument("--alt-tokenizer", default=None, help="ours_alt: exact prompt counts")
    p.add_argument("--log-dir", default=None)
    p.add_argument("--idle-s", type=float, default=20.0, help="seconds of no traffic per router")
    p.add_argument(
        "--per-role", type=int, default=2, help="stand-in workers per role (1: one pair)"
    )
    p.add_argument(
        "--settle-s", type=float, default=3.0, help="quiet seconds after start-up before measuring"
    )
    ns = p.parse_args(argv)
    ns.targets = [t.strip() for t in ns.targets.split(",") if t.strip()]
    pin = ns.pin and len(os.sched_getaffinity(0)) >= 2
    ns.router_core_, ns.load_core_ = (ns.router_core, ns.load_core) if pin else (None, None)
    log_dir = Path(ns.log_dir or tempfile.mkdtemp(prefix="bench-idle-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    with asyncio.Runner(loop_factory=uvrun.loop_factory()) as runner:
        runs = runner.run(idle_phase(ns, log_dir))
    print(idle_markdown(runs, ns.idle_s))
    return 0


if __name__ == "__main__":
    sys.exit(main())
