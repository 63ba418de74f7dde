"""The ladder and the saturation phase: every target against one pair of workers, round by
round, at every concurrency (`disagg_tools.overhead.overhead_cli` parses the command line; the
idle phase is `disagg_tools.overhead.idle`)."""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Any

from disagg_tools.overhead.idle import idle_phase
from disagg_tools.overhead.measure import Segment, combine, measure
from disagg_tools.overhead.overhead_client import LoadSpec
from disagg_tools.overhead.overhead_report import add_deltas
from disagg_tools.overhead.targets import start_router, start_workers
from disagg_tools.procs import HOST, Child
from disagg_tools.progress import bar, note

__all__ = ["machine_notes", "run"]


def _progress(r: dict[str, Any], phase: str = "ladder") -> None:
    # One rung's numbers: a line that stays, above any bar on a terminal
    # (disagg_tools/progress.py).
    note(
        f"[{phase}] {r['target']:>10} c={r['concurrency']:<5} ok={r['complete']}/"
        f"{r['requests']} ttft p50={r['ttft_ms']['p50']} p99={r['ttft_ms']['p99']} "
        f"itl p50={r['itl_ms']['p50']} p99={r['itl_ms']['p99']} tok/s={r['tokens_per_s']} "
        f"router cpu/1k={r['cpu_s_per_1k_tokens']} util={r['router_cpu_util']} "
        f"client util={r['client_cpu_util']}",
        sys.stderr,
    )


def machine_notes(ns: argparse.Namespace) -> dict[str, Any]:
    model = ""
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    versions: dict[str, str | None] = {}
    for pkg in ("aiohttp", "uvloop", "orjson", "sglang-router", "vllm-router", "disagg-router"):
        try:
            versions[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            versions[pkg] = None
    return {
        "cpus": os.cpu_count(),
        "cpu_model": model,
        "kernel": platform.release(),
        "python": platform.python_version(),
        "versions": versions,
        "router_core": ns.router_core_,
        "load_core": ns.load_core_,
        "loadavg_at_start": os.getloadavg(),
    }


async def _phase(
    ns: argparse.Namespace, log_dir: Path, *, saturation: bool
) -> list[dict[str, Any]]:
    """Every target against one pair of workers, interleaved: for each round, for each
    concurrency, every target in turn (the order rotates), so that a noisy neighbour on a
    shared machine hits all targets alike rather than whichever ran during its burst."""
    tag = "sat" if saturation else "ladder"
    interval = ns.sat_interval_ms if saturation else ns.interval_ms
    workers = await start_workers(ns, log_dir, interval, tag)
    routers: dict[str, tuple[Child, tuple[str, int]]] = {}
    segs: dict[tuple[str, int], list[Segment]] = {}
    specs: dict[tuple[str, int], LoadSpec] = {}
    try:
        for name in ns.targets:
            if name != "baseline":
                routers[name] = await start_router(name, ns, workers, log_dir, tag)
        if saturation:
            levels = [ns.sat_concurrency]
            tokens, stream_s = ns.sat_tokens, ns.sat_tokens * ns.sat_interval_ms / 1e3
        else:
            levels = ns.concurrency
            tokens = ns.tokens
            stream_s = (ns.first_token_ms or ns.interval_ms) / 1e3 + tokens * interval / 1e3
        # One tick per measured (round, concurrency, target): drawn on a terminal only.
        rungs = bar(
            sys.stderr, desc=tag, total=ns.rounds * len(levels) * len(ns.targets), unit="rung"
        )
        for rnd in range(ns.rounds):
            for c in levels:
                k = rnd % len(ns.targets)
                for name in ns.targets[k:] + ns.targets[:k]:
                    if saturation:
                        per_slot = ns.sat_requests
                    else:
                        per_slot = ns.requests_c1 if c == 1 else ns.requests
                    proc, addr = routers.get(name, (None, None))
                    spec = LoadSpec(
                        c,
                        per_slot + ns.warmup,
                        warmup_per_slot=ns.warmup,
                        target=addr,
                        prefill=(HOST, workers.prefill_port),
                        decode=(HOST, workers.decode_port),
                        model=ns.model,
                        max_tokens=tokens,
                        chat=ns.chat,
                        stagger_s=stream_s if c > 1 else 0.0,
                    )
                    if proc is not None and not proc.alive():
                        raise RuntimeError(f"{proc.name} died:\n{proc.tail()}")
                    seg = await measure(spec, proc, workers, saturation=saturation)
                    segs.setdefault((name, c), []).append(seg)
                    specs[(name, c)] = spec
                    _progress(
                        combine(name, spec, [seg], proc is not None, saturation),
                        f"{tag} round {rnd + 1}",
                    )
                    rungs.update(1)
        rungs.close()
    finally:
        for proc, _ in routers.values():
            proc.stop()
        workers.stop()
    runs = [
        combine(name, specs[(name, c)], segs[(name, c)], name != "baseline", saturation)
        for name in ns.targets
        for c in (levels if segs else [])
        if (name, c) in segs
    ]
    return runs


async def run(ns: argparse.Namespace, log_dir: Path) -> dict[str, Any]:
    result: dict[str, Any] = {
        "params": {k: v for k, v in vars(ns).items() if not k.endswith("_")},
        "command": " ".join(["python -m disagg_tools.overhead", *ns.argv_]),
        "machine": machine_notes(ns),
        "runs": [],
        "saturation": [],
        "log_dir": str(log_dir),
    }
    t0 = time.monotonic()
    result["runs"] = await _phase(ns, log_dir, saturation=False)
    add_deltas(result["runs"])
    if ns.saturation:
        result["saturation"] = await _phase(ns, log_dir, saturation=True)
    if ns.idle_s > 0:
        result["idle"] = await idle_phase(ns, log_dir)
    result["machine"]["loadavg_at_end"] = os.getloadavg()
    result["elapsed_s"] = round(time.monotonic() - t0, 1)
    return result
