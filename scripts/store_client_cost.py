"""What the store client costs the router per request (issue 24): redis-py's path against the
lean connection (state/lean_redis.py), on uvloop, against a real Redis.

One "request" is the store traffic of one disaggregated request: `reserve` with its stranded-KV
intent, `mark_ready`, then `finish` (release, unstrand, two histogram classes) — 6 commands in
3 round trips. N of them run at concurrency 1 and 256 through each path; reported per path and
concurrency: CPU µs per request in this process (time.process_time: Redis's own CPU is not in
it), requests per second, and wall p50/p99 per call. Rounds alternate the paths so that a
neighbour's load on a shared machine falls on both; the median round is shown.

    .venv/bin/python scripts/store_client_cost.py [--url redis://127.0.0.1:6379/0] [--n 4000]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
import uuid
from dataclasses import dataclass, field

import redis.asyncio as aioredis
import uvloop

from state import RedisStore
from state.base import StrandIntent

CALLS = ("reserve", "mark_ready", "finish")


@dataclass
class Round:
    cpu_us_per_request: float
    requests_per_s: float
    latencies_ms: dict[str, list[float]] = field(default_factory=dict)


async def one_request(store: RedisStore, rid: str, lat: dict[str, list[float]]) -> None:
    t0 = time.perf_counter()
    held = await store.reserve("d0", rid, 4, 30.0, intent=StrandIntent("p0", rid, 4096, 60.0))
    t1 = time.perf_counter()
    assert held.held, "the benchmark's worker has room for every request"
    await store.mark_ready("p0", rid, 0.0)
    t2 = time.perf_counter()
    done = await store.finish(("d0", rid), ("p0", rid), (["c0", "c1"], 3))
    t3 = time.perf_counter()
    assert done.released_blocks == 4 and done.unstranded_bytes == 4096, done
    lat["reserve"].append((t1 - t0) * 1e3)
    lat["mark_ready"].append((t2 - t1) * 1e3)
    lat["finish"].append((t3 - t2) * 1e3)


async def run_round(store: RedisStore, n: int, concurrency: int, tag: str) -> Round:
    lat: dict[str, list[float]] = {call: [] for call in CALLS}

    async def worker(w: int) -> None:
        for i in range(w, n, concurrency):
            await one_request(store, f"{tag}-{i}", lat)

    cpu0, wall0 = time.process_time(), time.perf_counter()
    await asyncio.gather(*(worker(w) for w in range(concurrency)))
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    return Round(cpu / n * 1e6, n / wall, lat)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def report(path: str, concurrency: int, rounds: list[Round]) -> None:
    middle = sorted(rounds, key=lambda r: r.cpu_us_per_request)[len(rounds) // 2]
    cpus = ", ".join(f"{r.cpu_us_per_request:.0f}" for r in rounds)
    calls = "  ".join(
        f"{call} p50 {percentile(middle.latencies_ms[call], 0.5):.2f} / "
        f"p99 {percentile(middle.latencies_ms[call], 0.99):.2f} ms"
        for call in CALLS
    )
    print(
        f"{path:8} c={concurrency:<4} CPU {middle.cpu_us_per_request:6.0f} µs/request "
        f"(rounds: {cpus})  {middle.requests_per_s:7.0f} req/s  {calls}"
    )


async def main(url: str, n: int, rounds: int, levels: list[int]) -> None:
    prefix = f"bench:{uuid.uuid4().hex[:8]}:"
    stores = {
        "redis-py": RedisStore.from_url(url, prefix, lean=False),
        "lean": RedisStore.from_url(url, prefix),
    }
    print(f"load average {os.getloadavg()}, {os.cpu_count()} CPUs, n={n} per round")
    try:
        await stores["lean"].set_capacity("d0", 10_000_000)
        for store in stores.values():  # connect and load the scripts outside the timing
            await run_round(store, 300, 16, "warm")
        for concurrency in levels:
            results: dict[str, list[Round]] = {path: [] for path in stores}
            for r in range(rounds):
                for path, store in stores.items():
                    results[path].append(await run_round(store, n, concurrency, f"{path}{r}"))
            for path, done in results.items():
                report(path, concurrency, done)
        print(f"load average {os.getloadavg()}")
    finally:
        for store in stores.values():
            await store.close()
        client = aioredis.from_url(url)
        keys = [k async for k in client.scan_iter(match=prefix + "*", count=1000)]
        if keys:
            await client.delete(*keys)
        await client.aclose()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--n", type=int, default=4000, help="requests per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 256])
    args = parser.parse_args()
    uvloop.run(main(args.url, args.n, args.rounds, args.concurrency))
