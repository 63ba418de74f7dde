"""A Redis of the benchmark's own, on the load core (`--private-redis`).

The shared Redis at 127.0.0.1:6379 is unpinned: on a 2-core machine the scheduler often runs
it on the router's core, where every command the router sends wakes it there and it takes the
router's core while it answers (measured at 32 streams of 16 tokens, the router on core 0: 1.31
and 1.34 CPU-ms a request with Redis free to run anywhere against 1.12 and 1.15 with Redis kept
off core 0, interleaved runs). A deployment's Redis runs on other hosts, shared by the replicas,
never on a router's core. This one is started pinned to the load core with the workers and the
client (the same niceness and scheduling class as every measured process), with persistence off
so that no fork or fsync lands in a measurement, and stopped at the end of the run. It measures
the hop, the round trip and the send, rather than where the scheduler put Redis.
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
from collections.abc import AsyncIterator
from pathlib import Path

from disagg_tools.overhead.targets import wait_listening
from disagg_tools.procs import HOST, Child, free_port

__all__ = ["private_redis_command", "redis_for_run"]


def private_redis_command(port: int) -> list[str]:
    """redis-server on loopback, nothing saved (no RDB snapshots, no AOF)."""
    server = shutil.which("redis-server")
    if server is None:
        raise SystemExit("--private-redis needs redis-server on the PATH")
    return [server, "--bind", HOST, "--port", str(port), "--save", "", "--appendonly", "no"]


@contextlib.asynccontextmanager
async def redis_for_run(ns: argparse.Namespace, log_dir: Path) -> AsyncIterator[None]:
    """With `ns.private_redis`, a Redis of the run's own on the load core, `ns.redis_url`
    pointed at it for the run's targets; else nothing (the `--redis-url` given)."""
    if not getattr(ns, "private_redis", False):
        yield
        return
    port = free_port()
    proc = Child(
        "redis-private",
        private_redis_command(port),
        log_dir,
        core=ns.load_core_,
        nice=ns.nice,
        rt_priority=ns.rt_priority,
    )
    try:
        await wait_listening(port, proc)
        ns.redis_url = f"redis://{HOST}:{port}/0"
        yield
    finally:
        proc.stop()
