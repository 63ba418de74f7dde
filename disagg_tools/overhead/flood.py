"""Isolation under a flood, live (issue 25): the router process, two tenants, Redis.

    python -m disagg_tools.overhead.flood [--fairness vtc|fifo] [--duration 40] [--out DIR]

Stand-in workers whose decode room (`--kv-blocks`) holds a few answers at once, so the router's
admission queue is what saturates; `disagg-router serve --config` in front of them with the
tenants `victim` and `aggressor` (weights 1 and 1, the aggressor optionally under a
`requests_per_minute` limit) and `fairness` (disagg_tools/overhead/flood_cluster.py). Then:

    capacity  the `probe` tenant alone at ~3× the nominal capacity: answers/s is the capacity
    solo      the victim alone, Poisson at its share (capacity × its weight share × --victim-x)
    flood     the victim as in solo + the aggressor at --aggressor-x × its share

and the report (disagg_tools/overhead/flood_report.py): the victim's TTFT p50/p99 and goodput
in both runs and their ratios, the aggressor's answers/s, every status, whether every 429 had a
Retry-After; `<out>/flood-<fairness>.json` and `.md`. About 2 minutes with the defaults.

Across router replicas (issue 33): disagg_tools/loadgen/flood_replicas_cli.py.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import shlex
import sys
import time
from pathlib import Path
from typing import Any

import orjson

from disagg_tools.overhead.flood_cluster import TENANT_KEYS, ClusterSpec, start_cluster
from disagg_tools.overhead.flood_load import TenantLoad, run_tenants
from disagg_tools.overhead.flood_report import markdown, summarise, verdict

__all__ = ["main", "run_flood", "parse_args"]

_BLOCK = 16
_PROMPT_TOKENS = 55  # the load's prompt at the router's 4 characters a token (an estimate)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m disagg_tools.overhead.flood",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    a = p.add_argument
    a(
        "--fairness",
        default="vtc",
        help="the router's `admission.fairness` (vtc, fifo, a dotted path)",
    )
    a("--redis-url", default="redis://127.0.0.1:6379/0")
    a("--model", default="llama-3-8b")
    a("--kv-blocks", type=int, default=60, help="the decode worker's room (blocks of 16)")
    a("--max-tokens", type=int, default=40, help="every answer's length")
    a("--interval-ms", type=float, default=20.0, help="stand-in decode: time between tokens")
    a("--prefill-ms", type=float, default=100.0, help="stand-in prefill time")
    a("--first-token-ms", type=float, default=20.0, help="stand-in decode: to its first token")
    a(
        "--max-wait-s",
        type=float,
        default=None,
        help="the router's admission.max_wait_s (2)",
    )
    a("--ttft-slo-s", type=float, default=1.0, help="goodput: answers with TTFT within this")
    a("--victim-weight", type=float, default=1.0)
    a("--aggressor-weight", type=float, default=1.0)
    a("--victim-x", type=float, default=1.0, help="the victim's rate, × its share")
    a("--aggressor-x", type=float, default=10.0, help="the aggressor's rate, × its share")
    a(
        "--aggressor-rpm-x",
        type=float,
        default=1.0,
        help="aggressor requests_per_minute = this × capacity × 60 (0: no limit)",
    )
    a("--capacity-s", type=float, default=8.0, help="the capacity run's length")
    a("--duration", type=float, default=40.0, help="each of the solo and flood runs' arrivals")
    a("--warmup", type=float, default=5.0, help="not measured at the start of each run")
    a("--tolerance", type=float, default=0.10, help="the isolation target (0.10: 10 %%)")
    a("--seed", type=int, default=0)
    a("--out", type=Path, default=Path("bench-results/flood"))
    ns = p.parse_args(argv)
    return ns


def nominal_capacity(ns: argparse.Namespace) -> tuple[int, float]:
    """Answers the decode room holds at once, and answers/s if each holds its room for the
    prefill plus the whole answer (the router holds it from before the prefill to the end)."""
    blocks = math.ceil((_PROMPT_TOKENS + ns.max_tokens) / _BLOCK)
    slots = max(1, ns.kv_blocks // blocks)
    held_s = (ns.prefill_ms + ns.first_token_ms + (ns.max_tokens - 1) * ns.interval_ms) / 1e3
    return slots, slots / held_s


async def run_flood(ns: argparse.Namespace) -> dict[str, Any]:
    slots, nominal = nominal_capacity(ns)
    log_dir = ns.out / f"logs-{_stem(ns.fairness)}"
    keys = TENANT_KEYS
    spec = ClusterSpec(
        ns.model,
        ns.redis_url,
        ns.fairness,
        ns.kv_blocks,
        ns.interval_ms,
        ns.prefill_ms,
        ns.first_token_ms,
        2.0 if ns.max_wait_s is None else ns.max_wait_s,
        ns.victim_weight,
        ns.aggressor_weight,
        0,
    )
    t_start = time.monotonic()
    deleted = 0
    # The capacity decides the aggressor's limit, so the router is started twice when it has
    # one: the capacity run on a router without limits, the measured runs on one with it.
    cluster = await start_cluster(spec, log_dir)
    try:
        cap_warm = min(2.0, ns.capacity_s / 4)
        probe = [TenantLoad("probe", keys["probe"], 3 * nominal, ns.max_tokens)]
        shots = await run_tenants(cluster.base_url, ns.model, probe, ns.capacity_s, ns.seed)
        cap = summarise(shots, "probe", cap_warm, ns.capacity_s, ns.ttft_slo_s)
        capacity = cap["answered_per_s"] or nominal
        rpm = int(round(ns.aggressor_rpm_x * capacity * 60)) if ns.aggressor_rpm_x > 0 else 0
        if rpm:
            deleted = await cluster.close()
            spec = ClusterSpec(**{**_fields(spec), "aggressor_rpm": rpm})
            cluster = await start_cluster(spec, log_dir)
        total_w = ns.victim_weight + ns.aggressor_weight
        victim_rate = ns.victim_x * capacity * ns.victim_weight / total_w
        aggr_rate = ns.aggressor_x * capacity * ns.aggressor_weight / total_w
        victim = TenantLoad("victim", keys["victim"], victim_rate, ns.max_tokens)
        aggressor = TenantLoad("aggressor", keys["aggressor"], aggr_rate, ns.max_tokens)
        runs: dict[str, dict[str, Any]] = {}
        for name, loads in (("solo", [victim]), ("flood", [victim, aggressor])):
            shots = await run_tenants(cluster.base_url, ns.model, loads, ns.duration, ns.seed + 1)
            runs[name] = {
                t: summarise(shots, t, ns.warmup, ns.duration, ns.ttft_slo_s)
                for t in ("victim", "aggressor")
            }
    finally:
        deleted += await cluster.close()
    report: dict[str, Any] = {
        "router_command": cluster.router_command,
        "router_config": cluster.config_text,
        "settings": {
            **{k: (str(v) if isinstance(v, Path) else v) for k, v in vars(ns).items()},
            "window_s": ns.duration - ns.warmup,
            "aggressor_requests_per_minute": rpm,
        },
        "capacity": {
            "slots_nominal": slots,
            "nominal_per_s": nominal,
            "measured_per_s": capacity,
            "probe": cap,
        },
        "rates": {"victim": victim_rate, "aggressor": aggr_rate},
        "runs": runs,
        "verdict": verdict(
            runs["solo"]["victim"],
            runs["flood"]["victim"],
            runs["flood"]["aggressor"],
            ns.tolerance,
        ),
        "key_prefix": cluster.key_prefix,
        "redis_keys_deleted": deleted,
        "elapsed_s": time.monotonic() - t_start,
    }
    return report


def _stem(fairness: str) -> str:
    return fairness.replace(":", "_").replace("/", "_").replace(".", "_")


def _fields(spec: ClusterSpec) -> dict[str, Any]:
    return {name: getattr(spec, name) for name in ClusterSpec.__slots__}


def write_report(report: dict[str, Any], out: Path, fairness: str) -> tuple[Path, Path]:
    out.mkdir(parents=True, exist_ok=True)
    stem = "flood-" + _stem(fairness)
    jpath, mpath = out / f"{stem}.json", out / f"{stem}.md"
    jpath.write_bytes(orjson.dumps(report, option=orjson.OPT_INDENT_2))
    mpath.write_text(f"`{report['command']}`\n\n" + markdown(report))
    return jpath, mpath


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    ns = parse_args(args)
    command = shlex.join(["python", "-m", "disagg_tools.overhead.flood", *args])
    (ns.out / f"logs-{_stem(ns.fairness)}").mkdir(parents=True, exist_ok=True)
    report = {
        "command": command,
        **asyncio.run(run_flood(ns)),
    }
    _, mpath = write_report(report, ns.out, ns.fairness)
    sys.stdout.write(mpath.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
