"""The hostile scenarios' cluster: simulated workers, a private Redis, N router replicas on it,
and a sampler that reads the decode reservations straight from Redis.

    HostileCluster  workers of any role (`both` included, which load_cluster.Cluster has not),
                    one private redis-server (password-protected with `redis_password`: the
                    issue-31 setting), `routers` replicas of `disagg-router serve --config
                    FILE` sharing it, the admin token set (the operator moves roles)
    PasswordRedis   a private redis-server with `requirepass` (in a config file of its own,
                    so the password is on no command line)
    StoreSampler    every ~100 ms, one pipeline: each decode worker's capacity (`:cap`), kept
                    sum (`:sum`) and reservations (`:res`, id -> blocks) — the store's own
                    numbers (state/keys.py), not a router's view of them

Loopback only, every process in a session of its own (disagg_tools/procs.py), stopped in
`stop()`.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import redis.asyncio as aioredis
import yaml

from disagg_tools.loadgen.load_cluster import (
    PrivateRedis,
    over_settings,
    sim_worker_command,
    wait_http,
)
from disagg_tools.procs import HOST, Child, free_port

__all__ = [
    "ADMIN_TOKEN",
    "ClusterShape",
    "HostileCluster",
    "PasswordRedis",
    "StoreSample",
    "StoreSampler",
]

ADMIN_TOKEN = "hostile-bench-admin"
MODEL = "llama-3-8b"


@dataclass(frozen=True, slots=True)
class ClusterShape:
    workers: tuple[tuple[str, str], ...]  # (id, role): role prefill | decode | both
    routers: int = 2
    decode_blocks: int = 3000  # KV capacity of every decode / both worker (sim and router)
    prefill_blocks: int = 200_000
    time_scale: float = 1.0
    router: dict[str, Any] = field(default_factory=dict)  # extra router settings
    log_level: str = "WARNING"
    redis_password: bool = False  # requirepass on the private Redis (a random password)

    @property
    def decode_ids(self) -> list[str]:
        return [wid for wid, role in self.workers if role != "prefill"]

    @property
    def both_ids(self) -> list[str]:
        return [wid for wid, role in self.workers if role == "both"]


class PasswordRedis:
    """A private redis-server that refuses every client without its (random) password; no
    persistence. `url` carries the password, as a router's `store.url` does."""

    def __init__(self, log_dir: Path) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed: a private Redis is needed")
        self.password = secrets.token_hex(16)
        self.port = free_port()
        self.url = f"redis://:{self.password}@{HOST}:{self.port}/0"
        conf = log_dir / "redis.conf"
        conf.write_text(f"requirepass {self.password}\n")
        conf.chmod(0o600)
        cmd = [binary, str(conf), "--port", str(self.port), "--bind", HOST, "--save", ""]
        cmd += ["--appendonly", "no", "--dir", str(log_dir), "--maxclients", "20000"]
        self.child = Child("redis", cmd, log_dir)

    async def ready(self, timeout_s: float = 10.0) -> None:
        """Wait for it to answer, and check that it refuses a client without the password."""
        deadline = time.monotonic() + timeout_s
        while True:
            if not self.child.alive():
                raise RuntimeError(f"redis-server exited:\n{self.child.tail()}")
            anonymous = aioredis.Redis(host=HOST, port=self.port)
            try:
                await anonymous.ping()
                raise RuntimeError("the private redis-server answered without its password")
            except aioredis.AuthenticationError:
                break
            except (OSError, aioredis.ConnectionError):
                if time.monotonic() > deadline:
                    raise RuntimeError("the private redis-server did not answer") from None
                await asyncio.sleep(0.05)
            finally:
                await anonymous.aclose()
        client = aioredis.from_url(self.url)
        try:
            await client.ping()
        finally:
            await client.aclose()

    def stop(self) -> None:
        self.child.stop(grace_s=5.0)


class HostileCluster:
    def __init__(self, shape: ClusterShape, workdir: Path) -> None:
        self.shape = shape
        self.workdir = workdir
        self.key_prefix = "hostile:"  # the Redis is ours alone
        self.redis: PrivateRedis | PasswordRedis | None = None
        self.workers: dict[str, Child] = {}
        self.worker_urls: dict[str, str] = {}
        self.routers: list[Child] = []
        self.router_urls: list[str] = []

    @property
    def redis_url(self) -> str:
        assert self.redis is not None
        return self.redis.url

    def _worker_cmd(self, wid: str, role: str, port: int) -> list[str]:
        s = self.shape
        blocks = s.prefill_blocks if role == "prefill" else s.decode_blocks
        return sim_worker_command(
            wid,
            role,
            port,
            model=MODEL,
            time_scale=s.time_scale,
            kv_blocks=blocks,
            kv_lease_s=30.0,
            log_level=s.log_level,
        )

    def _router_config(self, port: int) -> dict[str, Any]:
        s = self.shape
        base = {
            "server": {"host": HOST, "port": port},
            "model": MODEL,
            "perf": {"model": MODEL, "gpu": "h100"},
            "store": {"url": self.redis_url, "key_prefix": self.key_prefix},
            "auth": {"admin_token": ADMIN_TOKEN},
            "loops": {"health_interval_s": 0.5},
            "workers": [
                {
                    "id": wid,
                    "url": self.worker_urls[wid],
                    "role": role,
                    "adapter": "sim",
                    **({"kv_blocks": s.decode_blocks} if role != "prefill" else {}),
                }
                for wid, role in s.workers
            ],
        }
        return over_settings(base, s.router)  # the shape's settings, group by group

    async def start(self) -> None:
        waits = []
        for wid, role in self.shape.workers:
            port = free_port()
            child = Child(f"worker-{wid}", self._worker_cmd(wid, role, port), self.workdir)
            self.workers[wid] = child
            self.worker_urls[wid] = f"http://{HOST}:{port}"
            waits.append(wait_http(self.worker_urls[wid] + "/health", child))
        if self.shape.redis_password:
            self.redis = PasswordRedis(self.workdir)
        else:
            self.redis = PrivateRedis(self.workdir)
        waits.append(self.redis.ready())
        await asyncio.gather(*waits)
        for i in range(self.shape.routers):
            port = free_port()
            cfg = self.workdir / f"router-{i}.yaml"
            cfg.write_text(yaml.safe_dump(self._router_config(port), sort_keys=False))
            cmd = [
                sys.executable,
                "-m",
                "router.edge.serve_cli",
                "--log-level",
                self.shape.log_level,
            ]
            child = Child(f"router-{i}", [*cmd, "serve", "--config", str(cfg)], self.workdir)
            self.routers.append(child)
            self.router_urls.append(f"http://{HOST}:{port}")
        await asyncio.gather(
            *(
                wait_http(u + "/health", c)
                for u, c in zip(self.router_urls, self.routers, strict=True)
            )
        )

    def stop(self) -> None:
        for child in self.routers:
            child.stop()
        for child in self.workers.values():
            child.stop(grace_s=5.0)
        if self.redis is not None:
            self.redis.stop()

    def dead(self) -> list[str]:
        """Names of the children that exited on their own (a crash is a finding)."""
        children = [*self.routers, *self.workers.values()]
        if self.redis is not None:
            children.append(self.redis.child)
        return [c.name for c in children if not c.alive()]

    # -- the operator's side -------------------------------------------------------------
    async def set_role(self, session: aiohttp.ClientSession, wid: str, role: str) -> int:
        """POST /admin/workers/{wid}/role on the first replica; the HTTP status. A 409 (a
        guard rail refusing to empty a pool) is retried with "force": true."""
        url = f"{self.router_urls[0]}/admin/workers/{wid}/role"
        auth = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
        timeout = aiohttp.ClientTimeout(total=10)
        body: dict[str, Any] = {"role": role}
        async with session.post(url, json=body, headers=auth, timeout=timeout) as resp:
            status = resp.status
            await resp.read()
        if status == 409:
            body["force"] = True
            async with session.post(url, json=body, headers=auth, timeout=timeout) as resp:
                await resp.read()
                return 4090 if resp.status == 200 else resp.status  # 4090: forced past a 409
        return status

    async def roles(self, session: aiohttp.ClientSession) -> list[dict[str, str]]:
        """Each replica's view of the `both` workers' roles."""
        out: list[dict[str, str]] = []
        for url in self.router_urls:
            async with session.get(
                url + "/admin/roles", timeout=aiohttp.ClientTimeout(total=10)
            ) as resp:
                if resp.status != 200:
                    out.append({})
                    continue
                body = await resp.json()
            out.append({w["id"]: w["role"] for w in body.get("workers", [])})
        return out

    async def until_roles(
        self, session: aiohttp.ClientSession, want: dict[str, str], timeout_s: float
    ) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            views = await self.roles(session)
            if all(all(v.get(w) == r for w, r in want.items()) for v in views):
                return True
            await asyncio.sleep(0.2)
        return False


@dataclass(slots=True)
class StoreSample:
    t: float  # seconds since the sampler's t0
    reserved: dict[str, int]  # worker -> the kept sum of its reservations
    capacity: dict[str, int]
    holds: dict[str, dict[str, int]]  # worker -> reservation id -> blocks


class StoreSampler:
    """Reads every decode worker's reservations from Redis every `period_s` (one pipeline)."""

    def __init__(self, redis_url: str, prefix: str, workers: list[str], period_s: float = 0.1):
        self.redis_url = redis_url
        self.prefix = prefix
        self.workers = workers
        self.period_s = period_s
        self.samples: list[StoreSample] = []
        self.errors = 0
        self.t0 = time.perf_counter()
        self._task: asyncio.Task[None] | None = None
        self._stopping = asyncio.Event()

    def _key(self, wid: str, part: str) -> str:
        return f"{self.prefix}{{d:{wid}}}:{part}"  # state/keys.py, Keys.decode_*

    async def _loop(self) -> None:
        client = aioredis.from_url(self.redis_url)
        try:
            while not self._stopping.is_set():
                started = time.perf_counter()
                try:
                    await self._sample(client)
                except (OSError, aioredis.RedisError):
                    self.errors += 1
                pause = max(0.0, self.period_s - (time.perf_counter() - started))
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stopping.wait(), pause)
        finally:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(2.0):
                    await client.aclose()

    async def _sample(self, client: aioredis.Redis) -> None:
        pipe = client.pipeline(transaction=False)
        for wid in self.workers:
            pipe.get(self._key(wid, "cap"))
            pipe.get(self._key(wid, "sum"))
            pipe.hgetall(self._key(wid, "res"))
        answers = await pipe.execute()
        sample = StoreSample(time.perf_counter() - self.t0, {}, {}, {})
        for i, wid in enumerate(self.workers):
            cap, total, holds = answers[3 * i : 3 * i + 3]
            sample.capacity[wid] = int(cap or 0)
            sample.reserved[wid] = int(total or 0)
            sample.holds[wid] = {k.decode(): int(v) for k, v in holds.items()}
        self.samples.append(sample)

    def start(self) -> None:
        self.t0 = time.perf_counter()
        self._task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        """Stop between two samples. Not by cancelling a sample: redis-py may turn the
        cancellation of a pipeline into a ConnectionError, which the loop counts and goes on
        after (a run hung there for 10 minutes); a cancel only if it does not stop in 5 s."""
        self._stopping.set()
        if self._task is None:
            return
        done, _ = await asyncio.wait({self._task}, timeout=5.0)
        if not done:
            self._task.cancel()
            await asyncio.wait({self._task}, timeout=5.0)
