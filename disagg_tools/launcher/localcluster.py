"""A local cluster in child processes: Redis, simulated GPU workers and the router.

Used by `disagg-router demo`. Every process binds to 127.0.0.1 and is stopped (SIGTERM, then
SIGKILL) when the context exits, whatever happened.

With `prefix_facts` (the default) the router places on the workers' own facts: each worker
publishes its KV events (`--kv-events-endpoint`, `--kv-events-replay-endpoint`, loopback ports)
and names text prompts' blocks with the demo tokenizer (`--tokenizer`, built into the workdir by
demo_tokenizer.py), and the router subscribes to each (`kv_events`) and counts prompts with the
same directory (`tokenizers`), so both name a prompt's blocks by the same token ids
(docs/kv-events.md). Without it, the estimated affinity and the character estimate.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import sys
import tempfile
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from disagg_tools.launcher.demo_tokenizer import build_demo_tokenizer
from disagg_tools.procs import free_port
from policies.costmodel import perf_model
from router.redact import mask_url

__all__ = ["ClusterShape", "LocalCluster", "local_cluster"]


@dataclass(frozen=True, slots=True)
class ClusterShape:
    n_prefill: int = 2
    n_decode: int = 2
    model: str = "llama-3-8b"
    gpu: str = "h100"
    time_scale: float = 10.0
    kv_blocks: int | None = None  # None = what the cost model gives the GPU
    policy: str = "two_sided"
    estimator: str = "online_quantile"
    router_port: int = 0  # 0 = any free port
    # KV events from every worker and exact prompt tokens (the demo tokenizer): placement on the
    # engines' facts; False = the estimated affinity and the character estimate
    prefix_facts: bool = True


@dataclass(slots=True)
class LocalCluster:
    shape: ClusterShape
    workdir: Path
    redis_url: str | None = None
    redis_note: str = ""
    router_url: str = ""
    worker_urls: dict[str, str] = field(default_factory=dict)
    procs: list[asyncio.subprocess.Process] = field(default_factory=list)
    tokenizer_dir: Path | None = None  # the demo tokenizer, with prefix_facts

    def __repr__(self) -> str:
        return f"LocalCluster({self.router_url}, workers={list(self.worker_urls)})"


async def _wait_http(
    url: str, proc: asyncio.subprocess.Process, what: str, timeout_s: float = 30.0
) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    async with aiohttp.ClientSession() as session:
        while True:
            if proc.returncode is not None:
                raise RuntimeError(f"{what} exited with code {proc.returncode} while starting")
            try:
                async with session.get(url, timeout=aiohttp.ClientTimeout(total=1)) as resp:
                    if resp.status < 500:
                        return
            except (TimeoutError, aiohttp.ClientError):
                pass
            if asyncio.get_running_loop().time() > deadline:
                raise RuntimeError(
                    f"{what} did not come up at {mask_url(url)} within {timeout_s:.0f} s"
                )
            await asyncio.sleep(0.1)


async def _spawn(
    cluster: LocalCluster, args: Sequence[str], log_name: str
) -> asyncio.subprocess.Process:
    log = open(cluster.workdir / log_name, "wb")  # noqa: ASYNC230 - a local file, opened once
    try:
        proc = await asyncio.create_subprocess_exec(
            *args, stdout=log, stderr=asyncio.subprocess.STDOUT, stdin=asyncio.subprocess.DEVNULL
        )
    finally:
        log.close()
    cluster.procs.append(proc)
    return proc


async def _start_redis(cluster: LocalCluster, env_url: str | None) -> None:
    if env_url:
        # The note is printed (demo, validate): the URL's password is not.
        cluster.redis_url, cluster.redis_note = env_url, f"Redis at REDIS_URL ({mask_url(env_url)})"
        return
    binary = shutil.which("redis-server")
    if binary is None:
        cluster.redis_note = "in-process state store (no REDIS_URL and no redis-server binary)"
        return
    port = free_port()
    proc = await _spawn(
        cluster,
        [
            binary,
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(cluster.workdir),
        ],
        "redis.log",
    )
    import redis.asyncio as aioredis

    client = aioredis.Redis(host="127.0.0.1", port=port)
    try:
        for _ in range(100):
            if proc.returncode is not None:
                raise RuntimeError(f"redis-server exited with code {proc.returncode}")
            try:
                if await client.ping():
                    break
            except (OSError, aioredis.ConnectionError):
                await asyncio.sleep(0.05)
        else:
            raise RuntimeError("the private redis-server did not answer within 5 s")
    finally:
        await client.aclose()
    cluster.redis_url = f"redis://127.0.0.1:{port}/0"
    cluster.redis_note = f"private redis-server on 127.0.0.1:{port}"


async def _start_workers(cluster: LocalCluster, kv_blocks: int) -> list[dict[str, object]]:
    shape = cluster.shape
    entries: list[dict[str, object]] = []
    starting = []
    roles = [("prefill", i) for i in range(shape.n_prefill)] + [
        ("decode", i) for i in range(shape.n_decode)
    ]
    for role, i in roles:
        wid = f"{role[0]}{i}"
        port = free_port()
        args = [
            sys.executable,
            "-m",
            "disagg_tools.sim.worker",
            "--log-level",
            "WARNING",
            "--role",
            role,
            "--port",
            str(port),
            "--worker-id",
            wid,
            "--model",
            shape.model,
            "--gpu",
            shape.gpu,
            "--time-scale",
            str(shape.time_scale),
            "--kv-blocks",
            str(kv_blocks),
            # vLLM's 30 s KV lease, in real seconds whatever the time scale
            "--kv-lease-s",
            str(30.0 * shape.time_scale),
        ]
        events: dict[str, str] | None = None
        if cluster.tokenizer_dir is not None:
            events = {
                "endpoint": f"tcp://127.0.0.1:{free_port()}",
                "replay_endpoint": f"tcp://127.0.0.1:{free_port()}",
            }
            args += ["--kv-events-endpoint", events["endpoint"]]
            args += ["--kv-events-replay-endpoint", events["replay_endpoint"]]
            args += ["--tokenizer", str(cluster.tokenizer_dir)]
        proc = await _spawn(cluster, args, f"worker-{wid}.log")
        url = f"http://127.0.0.1:{port}"
        cluster.worker_urls[wid] = url
        starting.append(_wait_http(url + "/health", proc, f"worker {wid}"))
        entry: dict[str, object] = {"id": wid, "url": url, "role": role, "adapter": "sim"}
        if events is not None:
            entry["kv_events"] = events
        if role == "decode":
            entry["kv_blocks"] = kv_blocks
        entries.append(entry)
    await asyncio.gather(*starting)
    return entries


@contextlib.asynccontextmanager
async def local_cluster(
    shape: ClusterShape, *, redis_url: str | None = None, keep_logs: bool = False
) -> AsyncIterator[LocalCluster]:
    workdir = Path(tempfile.mkdtemp(prefix="disagg-demo-"))
    cluster = LocalCluster(shape=shape, workdir=workdir)
    try:
        await _start_redis(cluster, redis_url)
        if shape.prefix_facts:
            cluster.tokenizer_dir = build_demo_tokenizer(workdir / "tokenizer")
        perf = perf_model(shape.model, shape.gpu)
        kv_blocks = shape.kv_blocks or perf.kv_capacity_blocks
        workers = await _start_workers(cluster, kv_blocks)
        port = shape.router_port or free_port()
        config: dict[str, Any] = {
            "server": {"host": "127.0.0.1", "port": port},
            "model": shape.model,
            "perf": {"model": shape.model, "gpu": shape.gpu},
            "store": {"url": cluster.redis_url, "key_prefix": f"demo:{os.getpid()}:"},
            "policy": shape.policy,
            "estimates": {"estimator": shape.estimator},
            "workers": workers,
            # The workers run time_scale x faster than real GPUs: scale the deadlines with them.
            "loops": {"health_interval_s": 1.0},
        }
        if cluster.tokenizer_dir is not None:
            config["estimates"]["tokenizers"] = {shape.model: str(cluster.tokenizer_dir)}
        (workdir / "cluster.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
        proc = await _spawn(
            cluster,
            [
                sys.executable,
                "-m",
                "router.edge.serve_cli",
                "--log-level",
                "WARNING",
                "serve",
                "--config",
                str(workdir / "cluster.yaml"),
            ],
            "router.log",
        )
        cluster.router_url = f"http://127.0.0.1:{port}"
        await _wait_http(cluster.router_url + "/v1/models", proc, "router")
        yield cluster
    finally:
        for proc in reversed(cluster.procs):
            if proc.returncode is None:
                proc.terminate()
        for proc in reversed(cluster.procs):
            try:
                await asyncio.wait_for(proc.wait(), 10)
            except TimeoutError:
                proc.kill()
                await proc.wait()
        if not keep_logs:
            shutil.rmtree(workdir, ignore_errors=True)
