"""The process entry: `disagg-router serve | worker | demo | bench | simulate`.

Each subcommand belongs to its own package; this module only mounts their arguments and
dispatches. `serve` is the router's own entry (`router.edge.serve_cli`), `worker` the simulated GPU
worker
(`disagg_tools.sim.worker`), `bench` the trace replay client (`disagg_tools.replay.replay_cli`),
`simulate`
the cluster simulator
(`disagg_tools.simcluster.simulate_cli`, fed a trace parsed here by `disagg_tools.traces`),
`demo` a
local cluster
(`disagg_tools.launcher.demo`).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from disagg_tools import uvrun
from router.edge.serve_cli import add_log_level_argument, add_serve_arguments, serve

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="disagg-router", description=__doc__)
    add_log_level_argument(parser)
    sub = parser.add_subparsers(dest="command", required=True)
    add_serve_arguments(sub.add_parser("serve", help="run the router"))

    from disagg_tools.sim.worker_config import add_worker_arguments

    add_worker_arguments(sub.add_parser("worker", help="run a simulated GPU worker"))

    from disagg_tools.launcher.demo import add_demo_arguments

    add_demo_arguments(sub.add_parser("demo", help="a local cluster, real trace traffic, a report"))

    from disagg_tools.replay.replay_cli import add_bench_arguments

    add_bench_arguments(sub.add_parser("bench", help="replay a trace against an endpoint"))

    from disagg_tools.simcluster.simulate_cli import add_simulate_arguments

    add_simulate_arguments(sub.add_parser("simulate", help="discrete-event cluster simulator"))
    return parser


def _simulate(ns: argparse.Namespace) -> int:
    from disagg_tools.simcluster.simulate_cli import run_simulate
    from disagg_tools.traces import load_trace

    try:
        requests = load_trace(ns.trace, limit=ns.limit, poisson_rate=ns.poisson_rate, seed=ns.seed)
        return run_simulate(ns, requests)
    except (ValueError, OSError) as exc:  # TraceFormatError is a ValueError
        # a bad policy, trace or cluster shape: say so, no traceback
        print(f"disagg-router: {exc}", file=sys.stderr)
        return 2


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)
    from router.logs import configure_logging

    configure_logging(ns.log_level, "text")  # `serve` sets its own format once it has settings
    if ns.command == "serve":
        return serve(ns)
    if ns.command == "worker":
        from disagg_tools.sim.worker import run_worker
        from disagg_tools.sim.worker_config import config_from_args

        run_worker(config_from_args(ns))
        return 0
    if ns.command == "demo":
        from disagg_tools.launcher.demo import run_demo

        return uvrun.run(run_demo(ns))
    if ns.command == "bench":
        from disagg_tools.replay.replay_cli import run_bench

        return uvrun.run(run_bench(ns))
    if ns.command == "simulate":
        return _simulate(ns)
    parser.error(f"unknown command {ns.command}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
