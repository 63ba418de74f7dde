"""`python -m disagg_tools.sim.dp_worker --dp-size N [the worker's flags]`: a simulated
data-parallel server as a process (disagg_tools/sim/dp_front.py): N simulated engines behind the
one `--port`, each with the worker's flags (`--kv-blocks` is each rank's), serving until SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from collections.abc import Sequence

from disagg_tools import uvrun

from .dp_front import running_dp_worker
from .worker_config import WorkerConfig, add_worker_arguments, config_from_args

__all__ = ["main"]


async def _serve(config: WorkerConfig, dp_size: int) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with running_dp_worker(config, dp_size) as url:
        print(
            f"sim DP server {config.name} ({config.role}, {dp_size} ranks) listening on {url}",
            flush=True,
        )
        await stop.wait()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m disagg_tools.sim.dp_worker", description=__doc__
    )
    parser.add_argument("--log-level", default=os.environ.get("DISAGG_ROUTER_LOG_LEVEL", "INFO"))
    parser.add_argument("--dp-size", type=int, required=True, help="engines behind the URL")
    add_worker_arguments(parser)
    ns = parser.parse_args(argv)
    logging.basicConfig(
        level=ns.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    uvrun.run(_serve(config_from_args(ns), ns.dp_size))
    return 0


if __name__ == "__main__":
    sys.exit(main())
