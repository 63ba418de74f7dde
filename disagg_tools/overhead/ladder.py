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
from disagg_tools.overhead.private_redis import redis_for_run
from disagg_tools.overhead.targets import (
    StartedRouter,
    Workers,
    client_keys,
    start_router,
    start_workers,
)
from disagg_tools.procs import HOST
from disagg_tools.progress import bar, note

__all__ = ["machine_notes", "run"]


def _progress(r: dict[str, Any], phase: str = "ladder") -> None:
    # One rung's numbers: a line that stays, above any bar on a terminal
    # (disagg_tools/progress.py).
    note(
        f"[{phase}] {r['target']:>11} tokens={r['max_tokens']:<5} c={r['concurrency']:<5} "
        f"ok={r['complete']}/{r['requests']} ttft p50={r['ttft_ms']['p50']} "
        f"p99={r['ttft_ms']['p99']} p99.9={r['ttft_ms']['p99.9']} "
        f"itl p50={r['itl_ms']['p50']} p99={r['itl_ms']['p99']} tok/s={r['tokens_per_s']} "
        f"router cpu/1k={r['cpu_s_per_1k_tokens']} ms/req={r['cpu_ms_per_request']} "
        f"util={r['router_cpu_util']} "
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


def _rungs(ns: argparse.Namespace, saturation: bool) -> list[tuple[int, int]]:
    """(answer tokens, concurrency) of every rung of a phase, in the order they are run: the
    whole concurrency ladder for each answer length (`--tokens 16,128`)."""
    if saturation:
        return [(ns.sat_tokens, ns.sat_concurrency)]
    return [(tokens, c) for tokens in ns.tokens for c in ns.concurrency]


def _load_spec(
    ns: argparse.Namespace,
    workers: Workers,
    addr: tuple[str, int] | None,
    tokens: int,
    concurrency: int,
    saturation: bool,
    api_keys: tuple[str, ...] = (),
) -> LoadSpec:
    """One rung's load: `concurrency` keep-alive streams of `tokens` tokens, slots staggered
    over one stream's length so that answers do not all start at once."""
    if saturation:
        per_slot = ns.sat_requests
        stream_s = tokens * ns.sat_interval_ms / 1e3
    else:
        per_slot = ns.requests_c1 if concurrency == 1 else ns.requests
        first_s = (ns.first_token_ms or ns.interval_ms) / 1e3
        stream_s = first_s + tokens * ns.interval_ms / 1e3
    return LoadSpec(
        concurrency,
        per_slot + ns.warmup,
        warmup_per_slot=ns.warmup,
        target=addr,
        prefill=(HOST, workers.prefill_port),
        decode=(HOST, workers.decode_port),
        model=ns.model,
        max_tokens=tokens,
        chat=ns.chat,
        stagger_s=stream_s if concurrency > 1 else 0.0,
        api_keys=api_keys,
    )


# One measured (target, answer tokens, concurrency).
RunKey = tuple[str, int, int]


async def _phase(
    ns: argparse.Namespace, log_dir: Path, commands: dict[str, str], *, saturation: bool
) -> list[dict[str, Any]]:
    """Every target against one pair of workers, interleaved: for each round, for each
    rung, every target in turn (the order rotates), so that a noisy neighbour on a
    shared machine hits all targets alike rather than whichever ran during its burst.
    `commands` gets each router's command line (`<target>@<phase>`)."""
    tag = "sat" if saturation else "ladder"
    interval = ns.sat_interval_ms if saturation else ns.interval_ms
    workers = await start_workers(ns, log_dir, interval, tag)
    routers: dict[str, StartedRouter] = {}
    segs: dict[RunKey, list[Segment]] = {}
    specs: dict[RunKey, LoadSpec] = {}
    rungs = _rungs(ns, saturation)
    try:
        for name in ns.targets:
            if name != "baseline":
                routers[name] = await start_router(name, ns, workers, log_dir, tag)
                commands[f"{name}@{tag}"] = routers[name].command
        # One tick per measured (round, rung, target): drawn on a terminal only.
        ticks = bar(
            sys.stderr, desc=tag, total=ns.rounds * len(rungs) * len(ns.targets), unit="rung"
        )
        for rnd in range(ns.rounds):
            for tokens, c in rungs:
                k = rnd % len(ns.targets)
                for name in ns.targets[k:] + ns.targets[:k]:
                    started = routers.get(name)
                    proc = started.proc if started else None
                    addr = started.addr if started else None
                    keys = client_keys(name, ns)
                    spec = _load_spec(ns, workers, addr, tokens, c, saturation, keys)
                    if proc is not None and not proc.alive():
                        raise RuntimeError(f"{proc.name} died:\n{proc.tail()}")
                    seg = await measure(spec, proc, workers, saturation=saturation)
                    segs.setdefault((name, tokens, c), []).append(seg)
                    specs[(name, tokens, c)] = spec
                    _progress(
                        combine(name, spec, [seg], proc is not None, saturation),
                        f"{tag} round {rnd + 1}",
                    )
                    ticks.update(1)
        ticks.close()
    finally:
        for started in routers.values():
            started.proc.stop()
        workers.stop()
    return [
        combine(name, specs[key], segs[key], name != "baseline", saturation)
        for name in ns.targets
        for tokens, c in rungs
        if (key := (name, tokens, c)) in segs
    ]


async def run(ns: argparse.Namespace, log_dir: Path) -> dict[str, Any]:
    result: dict[str, Any] = {
        "params": {k: v for k, v in vars(ns).items() if not k.endswith("_")},
        "command": " ".join(["python -m disagg_tools.overhead", *ns.argv_]),
        "machine": machine_notes(ns),
        "runs": [],
        "saturation": [],
        "router_commands": {},
        "log_dir": str(log_dir),
    }
    t0 = time.monotonic()
    async with redis_for_run(ns, log_dir):
        result["redis_url"] = ns.redis_url
        result["runs"] = await _phase(ns, log_dir, result["router_commands"], saturation=False)
        add_deltas(result["runs"])
        if ns.saturation:
            commands = result["router_commands"]
            result["saturation"] = await _phase(ns, log_dir, commands, saturation=True)
        if ns.idle_s > 0:
            result["idle"] = await idle_phase(ns, log_dir)
    result["machine"]["loadavg_at_end"] = os.getloadavg()
    result["elapsed_s"] = round(time.monotonic() - t0, 1)
    return result
