"""The flood bench across router replicas (issue 33), its command line.

    python -m disagg_tools.loadgen.flood_replicas_cli --placement one,spread,split \
        --fairness vtc,fifo --victim paced,back-to-back --duration 60 --warmup 5

Two router replicas on one Redis in front of simulated workers (disagg_tools/loadgen/
flood_replicas.py), the victim's clients paced (or back to back) and the aggressor's back to
back, once per placement × `--fairness` × `--victim`, each against the victim's solo run and the
aggressor's run alone, with the issue's targets met or not per row
(flood_replicas_report.placement_table); `<out>/flood-placements.json` and `.md`. Each run is
`--duration` seconds of sending plus its cluster's start and its last answers (about
`--duration` + 15 s).
"""

from __future__ import annotations

import argparse
import asyncio
import shlex
import sys
import time
from pathlib import Path
from typing import Any

import orjson

from disagg_tools.loadgen.flood_replicas import PLACEMENTS, PlacementSpec, run_rows
from disagg_tools.loadgen.flood_replicas_report import placement_table

__all__ = ["main", "parse_args", "placement_specs", "run_placements"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m disagg_tools.loadgen.flood_replicas_cli",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    a = p.add_argument
    a("--fairness", default="vtc", help="comma-separated: the router's `admission.fairness`")
    a("--max-wait-s", type=float, default=30.0, help="the router's admission.max_wait_s")
    a("--duration", type=float, default=60.0, help="each run's sending, in seconds")
    a("--warmup", type=float, default=5.0, help="not measured at the start of each run")
    a("--out", type=Path, default=Path("bench-results/flood"))
    r = p.add_argument
    r(
        "--placement",
        default="one,spread,split",
        help="comma-separated, of one|spread|split: where the tenants' requests land on two "
        "replicas (one: both on replica 1; spread: each tenant's clients over both; split: "
        "victim on replica 1, aggressor on 2); runs the bench across replicas",
    )
    r(
        "--victim",
        default="paced",
        help="comma-separated, of paced|back-to-back: the victim's clients pause "
        "--victim-pause-s between requests, or do not",
    )
    r("--victim-clients", type=int, default=2)
    r("--victim-pause-s", type=float, default=1.0)
    r("--aggressor-clients", type=int, default=20, help="each back to back")
    r("--victim-tokens", type=int, default=128, help="every victim answer's length")
    r("--aggressor-tokens", type=int, default=128, help="every aggressor answer's length")
    r("--decode-blocks", type=int, default=120, help="the simulated decode worker's room")
    r("--time-scale", type=float, default=1.0, help="the simulated workers' speed")
    r("--deadline-s", type=float, default=120.0, help="the client's bound on one request")
    ns = p.parse_args(argv)
    for name in ns.placement.split(","):
        if name not in PLACEMENTS:
            p.error(f"--placement: {name!r} is not one of {', '.join(PLACEMENTS)}")
    for mode in ns.victim.split(","):
        if mode not in ("paced", "back-to-back"):
            p.error(f"--victim: {mode!r} is not paced or back-to-back")
    return ns


def placement_specs(ns: argparse.Namespace) -> list[PlacementSpec]:
    """One spec per victim mode × fairness × placement, in that order."""
    specs = []
    for mode in ns.victim.split(","):
        for fairness in ns.fairness.split(","):
            for placement in ns.placement.split(","):
                specs.append(
                    PlacementSpec(
                        placement=placement,
                        fairness=fairness,
                        victim_clients=ns.victim_clients,
                        victim_pause_s=ns.victim_pause_s if mode == "paced" else 0.0,
                        aggressor_clients=ns.aggressor_clients,
                        victim_tokens=ns.victim_tokens,
                        aggressor_tokens=ns.aggressor_tokens,
                        decode_blocks=ns.decode_blocks,
                        duration_s=ns.duration,
                        warmup_s=ns.warmup,
                        max_wait_s=ns.max_wait_s,
                        deadline_s=ns.deadline_s,
                        time_scale=ns.time_scale,
                    )
                )
    return specs


async def run_placements(ns: argparse.Namespace) -> dict[str, Any]:
    """The bench across replicas: every row of `placement_specs`, and the runs they compare to."""
    t_start = time.monotonic()
    specs = placement_specs(ns)
    rows, baselines = await run_rows(specs, ns.out / "logs-placements")
    return {
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(ns).items()},
        "router_settings": specs[0].router_settings() if specs else {},
        "rows": rows,
        "baselines": baselines,
        "elapsed_s": time.monotonic() - t_start,
    }


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    ns = parse_args(args)
    command = shlex.join(["python", "-m", "disagg_tools.loadgen.flood_replicas_cli", *args])
    placed = {"command": command, **asyncio.run(run_placements(ns))}
    ns.out.mkdir(parents=True, exist_ok=True)
    jpath, mpath = ns.out / "flood-placements.json", ns.out / "flood-placements.md"
    jpath.write_bytes(orjson.dumps(placed, option=orjson.OPT_INDENT_2))
    mpath.write_text(f"`{command}`\n\n" + placement_table(placed["rows"]))
    sys.stdout.write(mpath.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
