"""Two router replicas, one Redis, a flood (docs/scaling.md).

Two `disagg-router serve --config FILE` processes share one key prefix on the real Redis (in
the "cluster" variant, on the private 3-node Redis Cluster) and front the same small decode
pool (simulated workers in this process, a few dozen KV blocks each). A few hundred streaming
requests go to both at once, half each, while a sampler reads every decode worker's reserved
sum and capacity from Redis every ~20 ms. The reservations the two replicas make must never
add up past a worker's capacity (answers stay within the estimate: the `max_tokens` estimator,
so nothing grows past it); every request ends in 200 with the exact text or a clean 429;
afterwards nothing is reserved, leased or stranded.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import redis.asyncio as aioredis
import yaml
from redis.asyncio.cluster import RedisCluster

from disagg_tools.sim.textgen import expected_answer
from disagg_tools.sim.worker import WorkerConfig, running_worker
from state import Keys
from tests.conftest import MODEL, REDIS_URL, free_port, sim_cluster
from tests.redis_cluster import die_with_parent, redis_cluster
from tests.redis_server import PrivateRedis

__all__ = ["redis_cluster"]  # the session fixture

CHAT = "/v1/chat/completions"
DECODE = ("d0", "d1")
PREFILL = ("p0", "p1")
KV_BLOCKS = 40  # per decode worker: ~6 requests' worth, so the flood contends
REQUESTS = 300
TIME_SCALE = 100.0


def _router_argv(config: Path) -> list[str]:
    script = Path(sys.executable).parent / "disagg-router"
    if script.exists():
        return [str(script), "serve", "--config", str(config)]
    entry = "from router.edge.serve_cli import main; raise SystemExit(main())"
    return [sys.executable, "-c", entry, "serve", "--config", str(config)]


def _tail(log: Path) -> str:
    return log.read_text(errors="replace")[-3000:]


@contextlib.asynccontextmanager
async def _router_process(config: Path, log: Path) -> AsyncIterator[asyncio.subprocess.Process]:
    with log.open("wb") as out:
        proc = await asyncio.create_subprocess_exec(
            *_router_argv(config),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=die_with_parent,
            env={**os.environ, "DISAGG_ROUTER_LOG_LEVEL": "WARNING"},
        )
    try:
        yield proc
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGTERM)  # graceful: drains, releases what it holds
            try:
                await asyncio.wait_for(proc.wait(), 15.0)
            except TimeoutError:
                proc.kill()
                await asyncio.wait_for(proc.wait(), 10.0)


async def _wait_ready(url: str, proc: asyncio.subprocess.Process, log: Path) -> None:
    deadline = time.monotonic() + 30.0
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            if proc.returncode is not None:
                raise AssertionError(f"router exited {proc.returncode}:\n{_tail(log)}")
            with contextlib.suppress(aiohttp.ClientError):
                async with session.get(url + "/ready") as resp:
                    if resp.status == 200:
                        return
            await asyncio.sleep(0.1)
    raise AssertionError(f"router at {url} never became ready:\n{_tail(log)}")


@dataclass
class Sampler:
    """Reads every decode worker's `:sum` and `:cap` every `period_s` until stopped."""

    client: aioredis.Redis | RedisCluster
    keys: Keys
    period_s: float = 0.02
    samples: int = 0
    max_reserved: dict[str, int] = field(default_factory=lambda: dict.fromkeys(DECODE, 0))
    over: list[tuple[str, int, int]] = field(default_factory=list)  # (worker, sum, cap)

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            for w in DECODE:
                # Both keys of a worker share its tag: one MGET, on a cluster too.
                names = [self.keys.decode_sum(w), self.keys.decode_capacity(w)]
                values = await self.client.mget(names)
                reserved, cap = int(values[0] or 0), int(values[1] or 0)
                self.max_reserved[w] = max(self.max_reserved[w], reserved)
                if reserved > cap:
                    self.over.append((w, reserved, cap))
            self.samples += 1
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.period_s)


def _sse_text(raw: bytes) -> tuple[str, bool]:
    """The content deltas of an SSE chat stream, and whether it ended in [DONE]."""
    pieces: list[str] = []
    done = False
    for line in raw.decode().splitlines():
        if not line.startswith("data: "):
            continue
        data = line[len("data: ") :]
        if data == "[DONE]":
            done = True
            continue
        event = json.loads(data)
        assert "error" not in event, event
        for choice in event["choices"]:
            pieces.append(choice["delta"].get("content") or "")
    return "".join(pieces), done


@contextlib.asynccontextmanager
async def _workers() -> AsyncIterator[list[dict[str, Any]]]:
    entries: list[dict[str, Any]] = []
    async with contextlib.AsyncExitStack() as stack:
        for role, ids in (("prefill", PREFILL), ("decode", DECODE)):
            for wid in ids:
                cfg = WorkerConfig(
                    role=role,
                    worker_id=wid,
                    model=MODEL,
                    kv_blocks=KV_BLOCKS if role == "decode" else 4096,
                    time_scale=TIME_SCALE,
                    kv_lease_s=30.0 * TIME_SCALE,
                )
                url = await stack.enter_async_context(running_worker(cfg))
                entry: dict[str, Any] = {"id": wid, "url": url, "role": role, "adapter": "sim"}
                if role == "decode":
                    entry["kv_blocks"] = KV_BLOCKS
                entries.append(entry)
        yield entries


async def _leftovers(client: aioredis.Redis | RedisCluster, keys: Keys) -> dict[str, int]:
    out: dict[str, int] = {}
    for w in DECODE:
        out[f"{w} sum"] = int(await client.get(keys.decode_sum(w)) or 0)
        out[f"{w} res"] = int(await client.hlen(keys.decode_blocks(w)))
        out[f"{w} lease"] = int(await client.zcard(keys.decode_leases(w)))
    for p in PREFILL:
        out[f"{p} stranded"] = int(await client.get(keys.stranded_sum(p)) or 0)
        out[f"{p} entries"] = int(await client.hlen(keys.stranded_bytes(p)))
    return out


async def _delete_prefix(client: aioredis.Redis | RedisCluster, prefix: str) -> None:
    keys = [k async for k in client.scan_iter(match=prefix + "*", count=1000)]
    if keys:
        await client.delete(*keys)


@pytest.mark.parametrize("where", ["redis", "cluster"])
async def test_two_router_processes_never_overbook_a_small_decode_pool(
    where: str, redis_prefix: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    keys = Keys(redis_prefix)
    client: aioredis.Redis | RedisCluster
    if where == "redis":
        url, client = REDIS_URL, aioredis.Redis.from_url(REDIS_URL)
    else:  # the same on the private 3-node cluster: the decode workers' tags on their nodes
        cluster = request.getfixturevalue("redis_cluster")
        host, port = cluster.seed
        url, client = cluster.url, RedisCluster(host=host, port=port)
    async with _workers() as workers, contextlib.AsyncExitStack() as stack:
        stack.push_async_callback(client.aclose)
        if where == "cluster":
            stack.push_async_callback(_delete_prefix, client, redis_prefix)
        urls = []
        for i in range(2):
            port = free_port()
            config = tmp_path / f"router{i}.yaml"
            raw = {
                "server": {"host": "127.0.0.1", "port": port},
                "store": {"url": url, "key_prefix": redis_prefix},
                "estimates": {"estimator": "max_tokens"},  # no answer outgrows its reservation
                "loops": {"health_interval_s": 0.5, "state_refresh_s": 0.05, "load_poll_s": 0},
                "model": MODEL,
                "perf": {"model": MODEL, "gpu": "h100"},
                "workers": workers,
                "admission": {"max_wait_s": 2.0},  # past that, a clean 429
            }
            config.write_text(yaml.safe_dump(raw))
            log = tmp_path / f"router{i}.log"
            proc = await stack.enter_async_context(_router_process(config, log))
            urls.append((f"http://127.0.0.1:{port}", proc, log))
        for url, proc, log in urls:
            await _wait_ready(url, proc, log)

        sampler = Sampler(client, keys)
        stop = asyncio.Event()
        sampling = asyncio.create_task(sampler.run(stop))

        statuses: dict[int, int] = {}

        async def one(i: int, session: aiohttp.ClientSession) -> None:
            content = f"flood {i}: " + "tell me more " * (i % 9)
            body = {
                "model": MODEL,
                "messages": [{"role": "user", "content": content}],
                "max_tokens": 16 + i % 48,
                "stream": True,
            }
            want, _, _ = expected_answer(CHAT, body)
            async with session.post(urls[i % 2][0] + CHAT, json=body) as resp:
                raw = await resp.read()
                statuses[resp.status] = statuses.get(resp.status, 0) + 1
                if resp.status == 429:
                    error = json.loads(raw)["error"]  # an OpenAI-style error body
                    assert error["code"] or error["type"], error
                    return
                assert resp.status == 200, (resp.status, raw[:300])
            text, done = _sse_text(raw)
            assert done and text == want, (i, text[:80], want[:80])

        timeout = aiohttp.ClientTimeout(total=90)
        connector = aiohttp.TCPConnector(limit=0)
        try:
            async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
                await asyncio.gather(*(one(i, session) for i in range(REQUESTS)))
        finally:
            stop.set()
            await sampling

        # Releases run as each handler unwinds; the last ones land a moment after the answers.
        for _ in range(100):
            left = await _leftovers(client, keys)
            if not any(left.values()):
                break
            await asyncio.sleep(0.05)
        caps = [int(await client.get(keys.decode_capacity(w)) or 0) for w in DECODE]
        capacity = dict(zip(DECODE, caps, strict=True))
        report = (
            f"{where}: {REQUESTS} requests: {statuses}; {sampler.samples} samples; "
            f"max reserved {sampler.max_reserved} of capacity {capacity}"
        )
        print(report)
        assert caps == [KV_BLOCKS, KV_BLOCKS]
        assert sampler.over == [], report
        assert sum(statuses.values()) == REQUESTS and set(statuses) <= {200, 429}, report
        assert statuses.get(200, 0) >= 20, report  # the pool was kept busy, not refused
        assert max(sampler.max_reserved.values()) > KV_BLOCKS // 2, report  # it did contend
        assert sampler.samples > 10, report
        assert not any(left.values()), left


# -- what one request costs the store (docs/scaling.md §2) ------------------------------------


def _calls(ports: list[int]) -> dict[str, int]:
    import redis as sync_redis  # the sync client: a snapshot between two awaits

    total: dict[str, int] = {}
    for port in ports:
        with sync_redis.Redis(port=port) as client:
            for name, row in client.info("commandstats").items():
                command = name.removeprefix("cmdstat_")
                total[command] = total.get(command, 0) + int(row["calls"])
    return total


@pytest.mark.parametrize("where", ["redis", "cluster"])
async def test_a_request_costs_three_or_four_scripts_and_a_statistic_per_class(
    where: str, request: pytest.FixtureRequest
) -> None:
    """reserve with the stranded-KV intent (one script on one server, two on a cluster: the
    ledger is another slot), unstrand, release: three EVALSHA per request on one server, four on
    a cluster, plus one HINCRBY per statistics class (three for a request without a hint); no
    SCRIPT EXISTS round trips. The
    background loops are slowed down so that only the requests count (the retry-budget tally,
    four times a second, is the one left: at most a few more)."""
    if where == "redis":
        server = PrivateRedis()
        server.start()
        request.addfinalizer(server.kill)
        url, ports = server.url, [server.port]
    else:
        cluster = request.getfixturevalue("redis_cluster")
        url, ports = cluster.url, cluster.ports
    prefix = f"test:{uuid.uuid4().hex[:12]}:"
    n = 30
    async with sim_cluster(
        redis_prefix=prefix,
        store={"url": url},
        loops={
            "state_refresh_s": 30.0,
            "registry_refresh_s": 30.0,
            "histogram_refresh_s": 30.0,
            "stranded_reap_s": 30.0,
            "load_poll_s": 0,
        },
    ) as c:
        async with aiohttp.ClientSession() as session:
            body = {"model": MODEL, "messages": [{"role": "user", "content": "warm"}]}
            async with session.post(c.router_url + CHAT, json={**body, "max_tokens": 8}) as r:
                assert r.status == 200  # the statistics classes are cached from here on
            before = _calls(ports)
            for i in range(n):
                payload = {**body, "max_tokens": 8 + i % 5, "stream": i % 2 == 0}
                async with session.post(c.router_url + CHAT, json=payload) as r:
                    assert r.status == 200
                    await r.read()
            await asyncio.sleep(0.1)  # the last finish runs as its handler unwinds
            after = _calls(ports)
        assert await c.reserved_blocks() == {"d0": 0}
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    scripts = 3 if where == "redis" else 4
    assert scripts * n <= delta["evalsha"] <= scripts * n + n // 2, delta
    assert 3 * n <= delta["hincrby"] <= 3 * n + n // 2, delta  # + the tally's, inside its script
    assert delta.get("script|exists", 0) == 0, delta
