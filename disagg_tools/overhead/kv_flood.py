"""A hostile engine's KV events against a router's subscriber (issue 31, item 4).

    python -m disagg_tools.overhead.kv_flood [--blocks 1500000] [--batch-blocks 1000]
        [--capacity 25000] [--big-batch 300000] [--out FILE.json]

An 'engine' in a child process publishes on a real ZeroMQ PUB socket on loopback, and this
process runs the router's own subscriber (router/workers/kv_events.py) for one worker of
`--capacity` KV blocks, as a replica would. Measured here, in this process:

- RSS (VmRSS) before, at its highest during, and after each phase, the growth against the
  start;
- the event loop's worst gap: a coroutine that sleeps 1 ms and records the longest it was kept
  waiting past that (what any other stream of the replica waits on the events);
- what the subscriber refused and dropped (its metrics).

Phases: `flood` (`--blocks` bogus blocks in batches of `--batch-blocks`, distinct prompts of
parent None, so each is named and indexed until the bound drops the index); `big` (one batch
of `--big-batch` blocks with the batch limits raised to take it and the capacity to hold it,
then an AllBlocksCleared: the cost of a batch applied in steps and the memory given back);
`refused` (the same batch at the default limits, then one of 2.4 MiB: over the batch limit,
under what ZeroMQ is told to take), and `idle` (batches of one block: the
machine's own noise in the gaps).
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import socket
import sys
import time
from pathlib import Path
from typing import Any

import msgpack
import orjson
import zmq
import zmq.asyncio

from router.metrics import RouterMetrics
from router.workers.kv_events import KvEventSubscriber
from router.workers.kv_limits import MAX_BATCH_BLOCKS, MAX_BATCH_BYTES
from router.workers.worker_spec import KvEventsSpec

__all__ = ["main"]

BS = 16


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _batch(first: int, blocks: int) -> bytes:
    stored = {
        "type": "BlockStored",
        "block_hashes": [first + k for k in range(blocks)],
        "parent_block_hash": None,
        "token_ids": [(first + i) % 30_000 for i in range(blocks * BS)],
        "block_size": BS,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
    }
    return bytes(msgpack.packb([time.time(), [stored], 0]))


_CLEARED = bytes(msgpack.packb([0.0, [{"type": "AllBlocksCleared"}], 0]))


def _publish(endpoint: str, plan: list[tuple[str, int, int]], go: Any) -> None:
    """The child: bind, wait for the subscriber, publish the plan ('stored', first, blocks)
    or ('cleared', 0, 0) with sequence numbers from 0; nothing is dropped on its side."""
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.SNDHWM, 0)
    pub.bind(endpoint)
    go.wait()
    time.sleep(0.5)  # the slow joiner
    for seq, (kind, first, blocks) in enumerate(plan):
        payload = _CLEARED if kind == "cleared" else _batch(first, blocks)
        pub.send_multipart([b"", seq.to_bytes(8, "big"), payload])
    # Then one small batch every 0.1 s until the parent ends it: the end is seen even when a
    # batch was lost (ZeroMQ drops the connection on a message over the subscriber's limit).
    for seq in range(len(plan), len(plan) + 6000):
        time.sleep(0.1)
        pub.send_multipart([b"", seq.to_bytes(8, "big"), _batch(2**50 + seq, 1)])


class LoopGaps:
    """The longest a 1 ms sleeper was kept waiting past its 1 ms: on the wall clock (what a
    stream sees, the machine's other load included: the OS may not run this process) and in
    this thread's CPU time (what the loop itself spent before it came back: the events' own
    share, which other processes on a shared machine do not inflate)."""

    def __init__(self) -> None:
        self.worst = 0.0
        self.worst_cpu = 0.0
        self._task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            t, c = loop.time(), time.thread_time()
            await asyncio.sleep(0.001)
            self.worst = max(self.worst, loop.time() - t - 0.001)
            self.worst_cpu = max(self.worst_cpu, time.thread_time() - c)

    def start(self) -> None:
        self.worst = self.worst_cpu = 0.0
        self._task = asyncio.get_running_loop().create_task(self._run())

    def stop(self) -> tuple[float, float]:
        assert self._task is not None
        self._task.cancel()
        return self.worst, self.worst_cpu


async def phase(
    name: str,
    plan: list[tuple[str, int, int]],
    capacity: int,
    max_batch_bytes: int,
    max_batch_blocks: int,
) -> dict[str, Any]:
    with socket.socket() as probe:  # a free loopback port for the child to bind
        probe.bind(("127.0.0.1", 0))
        endpoint = f"tcp://127.0.0.1:{probe.getsockname()[1]}"
    mp = multiprocessing.get_context("spawn")
    go = mp.Event()
    child = mp.Process(target=_publish, args=(endpoint, plan, go), daemon=True)
    child.start()
    metrics = RouterMetrics()
    ctx = zmq.asyncio.Context()
    sub = KvEventSubscriber(
        "w",
        KvEventsSpec(endpoint),
        ctx,
        metrics,
        bound=lambda _bs: capacity * 2,  # capacity_bound's: (GPU + offload) x slack 2
        max_batch_bytes=max_batch_bytes,
        max_batch_blocks=max_batch_blocks,
    )
    gaps = LoopGaps()
    base = rss_mb()
    peak = base
    task = asyncio.get_running_loop().create_task(sub.run())
    try:
        go.set()
        start = time.perf_counter()
        gaps.start()
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            await asyncio.sleep(0.05)
            peak = max(peak, rss_mb())
            if sub._next is not None and sub._next >= len(plan):
                break
        elapsed = time.perf_counter() - start
        finished = sub._next is not None and sub._next >= len(plan)
        await asyncio.sleep(0.2)  # the last release
        worst, worst_cpu = gaps.stop()
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        child.kill()
        child.join()
        ctx.term()
    drops = _by_reason(metrics.kv_events_index_drops)
    out = {
        "phase": name,
        "batches_sent": len(plan),
        "blocks_sent": sum(b for _, _, b in plan),
        "capacity_blocks": capacity,
        "index_bound": capacity * 2,
        "max_batch_bytes": max_batch_bytes,
        "max_batch_blocks": max_batch_blocks,
        "batches_applied": sub.batches,
        "gaps": int(metrics.kv_events_gaps.labels(worker="w")._value.get()),
        "refused": _by_reason(metrics.kv_events_refused),
        "index_drops": drops,
        "index_blocks_at_end": len(sub.index),
        "elapsed_s": round(elapsed, 2),
        "finished": finished,
        "rss_mb": {
            "start": round(base, 1),
            "peak": round(peak, 1),
            "end": round(rss_mb(), 1),
            "growth_peak": round(peak - base, 1),
            "growth_end": round(rss_mb() - base, 1),
        },
        "worst_loop_gap_ms": round(worst * 1e3, 2),
        "worst_loop_gap_cpu_ms": round(worst_cpu * 1e3, 2),
    }
    return out


def _by_reason(metric: Any) -> dict[str, int]:
    """A {worker, reason} counter's values by reason."""
    return {k[-1]: int(v._value.get()) for k, v in metric._metrics.items()}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m disagg_tools.overhead.kv_flood",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--blocks", type=int, default=1_500_000)
    p.add_argument("--batch-blocks", type=int, default=1000)
    p.add_argument("--capacity", type=int, default=25_000, help="the worker's KV blocks")
    p.add_argument("--big-batch", type=int, default=300_000)
    p.add_argument("--phases", default="idle,flood,big,refused")
    p.add_argument("--out", type=Path, default=None)
    return p.parse_args(argv)


async def run(ns: argparse.Namespace) -> list[dict[str, Any]]:
    results = []
    phases = ns.phases.split(",")

    def done(result: dict[str, Any]) -> None:
        print(orjson.dumps(result).decode(), file=sys.stderr, flush=True)
        results.append(result)

    if "idle" in phases:
        plan = [("stored", 2**39 + i, 1) for i in range(200)]
        done(await phase("idle", plan, ns.capacity, MAX_BATCH_BYTES, MAX_BATCH_BLOCKS))
    if "flood" in phases:
        plan = [
            ("stored", 2**40 + i * ns.batch_blocks, ns.batch_blocks)
            for i in range(ns.blocks // ns.batch_blocks)
        ]
        done(await phase("flood", plan, ns.capacity, MAX_BATCH_BYTES, MAX_BATCH_BLOCKS))
    big = [("stored", 2**41, ns.big_batch), ("cleared", 0, 0)]
    if "big" in phases:
        done(await phase("big", big, ns.big_batch, 2**30, 2 * ns.big_batch))
    if "refused" in phases:
        over = [("stored", 2**41, ns.big_batch), ("stored", 2**42, MAX_BATCH_BYTES // 48 + 1000)]
        done(await phase("refused", over, ns.capacity, MAX_BATCH_BYTES, MAX_BATCH_BLOCKS))
    return results


def main(argv: list[str] | None = None) -> int:
    ns = parse_args(argv)
    results = asyncio.run(run(ns))
    text = orjson.dumps(results, option=orjson.OPT_INDENT_2).decode()
    print(text)
    if ns.out is not None:
        ns.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
