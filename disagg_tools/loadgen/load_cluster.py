"""The cluster of a load or soak run: simulated workers, one router, a Redis.

    ClusterSpec  its shape: workers per role, model, time scale, which Redis, router settings
    Cluster      simulated workers (one process each, so one can be SIGKILLed), then Redis,
                 then the router (`python -m router.edge.serve_cli serve --config FILE`)
    PrivateRedis a `redis-server --save '' --appendonly no` on a free loopback port: the only
                 Redis these tools ever kill (the shared one on 6379 is used with a unique key
                 prefix and never touched otherwise)

Every process is a `disagg_tools.procs.Child`; nothing here imports the router.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import sys
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import redis.asyncio as aioredis
import yaml

from disagg_tools.procs import HOST, Child, free_port

__all__ = ["Cluster", "ClusterSpec", "PrivateRedis", "wait_http"]


async def wait_http(url: str, child: Child, timeout_s: float = 60.0) -> None:
    """Until `url` answers below 500 (the child must stay alive meanwhile)."""
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as session:
        while True:
            if not child.alive():
                raise RuntimeError(f"{child.name} exited while starting:\n{child.tail()}")
            try:
                async with session.get(url, timeout=aiohttp.ClientTimeout(total=2)) as resp:
                    if resp.status < 500:
                        return
            except (TimeoutError, aiohttp.ClientError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{child.name} not up at {url} in {timeout_s:.0f} s")
            await asyncio.sleep(0.1)


class PrivateRedis:
    """A redis-server of our own: no persistence, so a restart comes back EMPTY."""

    def __init__(self, log_dir: Path) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed: a private Redis is needed")
        self.port = free_port()
        self.url = f"redis://{HOST}:{self.port}/0"
        cmd = [
            binary,
            "--port",
            str(self.port),
            "--bind",
            HOST,
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(log_dir),
            "--maxclients",
            "20000",
        ]
        self.child = Child("redis", cmd, log_dir)

    async def ready(self, timeout_s: float = 10.0) -> None:
        client = aioredis.Redis(host=HOST, port=self.port)
        deadline = time.monotonic() + timeout_s
        try:
            while True:
                if not self.child.alive():
                    raise RuntimeError(f"redis-server exited:\n{self.child.tail()}")
                try:
                    if await client.ping():
                        return
                except (OSError, aioredis.ConnectionError):
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError("the private redis-server did not answer")
                await asyncio.sleep(0.05)
        finally:
            await client.aclose()

    async def crash_and_restart(self, down_s: float = 0.5) -> None:
        """SIGKILL it, stay down `down_s`, start it again on the same port, empty."""
        self.child.kill()
        await asyncio.sleep(down_s)
        self.child.start()
        await self.ready()

    def stop(self) -> None:
        self.child.stop(grace_s=5.0)


def sim_worker_command(
    wid: str,
    role: str,
    port: int,
    *,
    model: str,
    time_scale: float,
    kv_blocks: int,
    kv_lease_s: float,
    log_level: str = "WARNING",
    gpu: str | None = None,
    mean_output_tokens: int | None = None,
    extra: Sequence[str] = (),
) -> list[str]:
    """The command line of one simulated worker on loopback. `kv_lease_s` is in real seconds:
    a prefilled KV waits that long for its decode whatever the time scale."""
    cmd = [
        sys.executable,
        "-m",
        "disagg_tools.sim.worker",
        "--log-level",
        log_level,
        "--role",
        role,
        "--host",
        HOST,
        "--port",
        str(port),
        "--worker-id",
        wid,
        "--model",
        model,
        "--time-scale",
        str(time_scale),
        "--kv-blocks",
        str(kv_blocks),
        "--kv-lease-s",
        str(kv_lease_s * time_scale),
    ]
    if gpu is not None:
        cmd += ["--gpu", gpu]
    if mean_output_tokens is not None:
        cmd += ["--mean-output-tokens", str(mean_output_tokens)]
    return [*cmd, *extra]


@dataclass(frozen=True, slots=True)
class ClusterSpec:
    n_prefill: int = 1
    n_decode: int = 2
    model: str = "llama-3-8b"
    gpu: str = "h100"
    time_scale: float = 20.0
    kv_blocks: int = 200_000
    mean_output_tokens: int = 128
    redis: str = "private"  # "private" | "shared" (127.0.0.1:6379, a unique key prefix)
    shared_redis_url: str = "redis://127.0.0.1:6379/0"
    worker_kv_lease_s: float = 30.0  # real seconds (scaled to simulated for the worker)
    router: dict[str, Any] = field(default_factory=dict)  # extra router settings
    worker_args: dict[str, list[str]] = field(default_factory=dict)  # worker id -> extra flags
    log_level: str = "WARNING"
    key_prefix: str | None = None  # None: a fresh `load:<pid>:<hex>:` prefix
    router_env: dict[str, str] = field(default_factory=dict)  # extra environment of the router


class Cluster:
    """Workers (one process each, so one can be SIGKILLed), then Redis, then the router."""

    def __init__(self, spec: ClusterSpec, workdir: Path) -> None:
        self.spec = spec
        self.workdir = workdir
        self.redis: PrivateRedis | None = None
        self.redis_url = ""
        self.key_prefix = spec.key_prefix or f"load:{os.getpid()}:{uuid.uuid4().hex[:8]}:"
        self.workers: dict[str, Child] = {}
        self.worker_urls: dict[str, str] = {}
        self.router: Child | None = None
        self.router_url = ""

    def _worker_cmd(self, wid: str, role: str, port: int) -> list[str]:
        s = self.spec
        return sim_worker_command(
            wid,
            role,
            port,
            model=s.model,
            time_scale=s.time_scale,
            kv_blocks=s.kv_blocks,
            kv_lease_s=s.worker_kv_lease_s,
            log_level=s.log_level,
            gpu=s.gpu,
            mean_output_tokens=s.mean_output_tokens,
            extra=s.worker_args.get(wid, ()),
        )

    async def start(self) -> None:
        s = self.spec
        roles = [(f"p{i}", "prefill") for i in range(s.n_prefill)]
        roles += [(f"d{i}", "decode") for i in range(s.n_decode)]
        waits = []
        for wid, role in roles:
            port = free_port()
            child = Child(f"worker-{wid}", self._worker_cmd(wid, role, port), self.workdir)
            self.workers[wid] = child
            self.worker_urls[wid] = f"http://{HOST}:{port}"
            waits.append(wait_http(self.worker_urls[wid] + "/health", child))
        if s.redis == "private":
            self.redis = PrivateRedis(self.workdir)
            waits.append(self.redis.ready())
            self.redis_url = self.redis.url
        else:
            self.redis_url = s.shared_redis_url
        await asyncio.gather(*waits)
        port = free_port()
        base: dict[str, Any] = {
            "server": {"host": HOST, "port": port},
            "model": s.model,
            "perf": {"model": s.model, "gpu": s.gpu},
            "store": {"url": self.redis_url, "key_prefix": self.key_prefix},
            "workers": [
                {
                    "id": wid,
                    "url": self.worker_urls[wid],
                    "role": role,
                    "adapter": "sim",
                    **({"kv_blocks": s.kv_blocks} if role == "decode" else {}),
                }
                for wid, role in roles
            ],
            "loops": {"health_interval_s": 0.5},
        }
        config = over_settings(base, s.router)  # the spec's settings, group by group
        cfg = self.workdir / "router.yaml"
        cfg.write_text(yaml.safe_dump(config, sort_keys=False))
        cmd = [
            sys.executable,
            "-m",
            "router.edge.serve_cli",
            "--log-level",
            s.log_level,
            "serve",
            "--config",
            str(cfg),
        ]
        self.router = Child("router", cmd, self.workdir, env=s.router_env)
        self.router_url = f"http://{HOST}:{port}"
        await wait_http(self.router_url + "/health", self.router)

    def role(self, wid: str) -> str:
        return "prefill" if wid.startswith("p") else "decode"

    async def restart_worker(self, wid: str) -> None:
        child = self.workers[wid]
        child.start()
        await wait_http(self.worker_urls[wid] + "/health", child)

    def stop(self) -> None:
        if self.router is not None:
            self.router.stop()
        for child in self.workers.values():
            child.stop(grace_s=5.0)
        if self.redis is not None:
            self.redis.stop()

    async def cleanup_shared_keys(self) -> None:
        """Delete our prefix's keys from the shared Redis (never anything else)."""
        if self.spec.redis != "shared":
            return
        client = aioredis.from_url(self.redis_url)
        try:
            keys = [k async for k in client.scan_iter(match=self.key_prefix + "*", count=1000)]
            if keys:
                await client.delete(*keys)
        finally:
            await client.aclose()


def over_settings(base: dict[str, Any], extra: Mapping[str, Any]) -> dict[str, Any]:
    """`extra`'s settings over `base`'s: a group's (a mapping's) given settings replace only
    their own (router/config.py merged_settings; the tools do not import the router)."""
    out = dict(base)
    for key, value in extra.items():
        below = out.get(key)
        both = isinstance(below, Mapping) and isinstance(value, Mapping)
        out[key] = {**below, **value} if both else value  # type: ignore[dict-item]
    return out
