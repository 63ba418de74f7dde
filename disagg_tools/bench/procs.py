"""Child processes for the load and soak runs: each in a session of its own, killed by group.

    Child        one subprocess (own process group, log file, SIGTERM then SIGKILL on stop)
    Cluster      simulated workers + one router (`disagg-router serve --config FILE`) + Redis
    PrivateRedis a `redis-server --save '' --appendonly no` on a free loopback port: the only
                 Redis these tools ever kill (the shared one on 6379 is used with a unique key
                 prefix and never touched otherwise)

Readers of /proc: CPU seconds (utime + stime of all threads) and resident set size of a pid.
Nothing here imports the router: the router and the workers are subprocesses.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import json
import os
import resource
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
import weakref
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import redis.asyncio as aioredis
import yaml

from disagg_tools import uvrun

__all__ = [
    "HOST",
    "Child",
    "Cluster",
    "ClusterSpec",
    "PrivateRedis",
    "free_port",
    "proc_cpu_s",
    "proc_rss_bytes",
    "raise_nofile",
]

HOST = "127.0.0.1"
_TICK = os.sysconf("SC_CLK_TCK")
_PAGE = os.sysconf("SC_PAGE_SIZE")


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def raise_nofile(want: int = 65536) -> int:
    """Raise RLIMIT_NOFILE's soft limit towards `want` (up to the hard limit); returns it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = want if hard == resource.RLIM_INFINITY else min(want, hard)
    if soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        soft = target
    return soft


def proc_cpu_s(pid: int) -> float:
    """utime + stime of every thread of `pid`, in seconds (0 once it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / _TICK  # stat fields 14 and 15


def proc_rss_bytes(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * _PAGE
    except OSError:
        return 0


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL when the process that started it dies (Linux), so a
    run that is itself killed (a pytest timeout, ^C twice) leaves no cluster behind. Each child
    has a session of its own, so a signal to our group would not reach it. Some sandboxes
    ignore it (this one's PID 1 does): `_LIVE` and the atexit hook below are the fallback."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


# Every Child still running, killed at interpreter exit: a run cut short (a pytest timeout that
# abandons its event loop) must not leave workers, routers or a Redis behind. The one piece of
# module state here, and a safety net only: `stop()` is the normal way out.
_LIVE: weakref.WeakSet[Child] = weakref.WeakSet()


@atexit.register
def _kill_leftovers() -> None:
    for child in list(_LIVE):
        if child.alive():
            child.kill()


class Child:
    """A subprocess in its own session, logging to a file; `stop` never raises."""

    def __init__(
        self, name: str, cmd: list[str], log_dir: Path, env: dict[str, str] | None = None
    ) -> None:
        self.name = name
        self.cmd = cmd
        self.env = {**os.environ, **env} if env else None
        self.log_path = log_dir / f"{name}.log"
        self._log_dir = log_dir
        self.popen: subprocess.Popen[bytes] | None = None
        self.starts = 0
        self.start()

    def start(self) -> None:
        with open(self.log_path, "ab") as log:
            self.popen = subprocess.Popen(
                self.cmd,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                env=self.env,
                preexec_fn=_die_with_parent if sys.platform == "linux" else None,
            )
        self.starts += 1
        _LIVE.add(self)

    @property
    def pid(self) -> int:
        assert self.popen is not None
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def kill(self) -> None:
        """SIGKILL the whole group at once (a crash, not a shutdown) and reap it."""
        if self.popen is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.popen.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(10)

    def stop(self, grace_s: float = 10.0) -> None:
        try:
            if self.popen is not None and self.popen.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.popen.pid, signal.SIGTERM)
                try:
                    self.popen.wait(grace_s)
                except subprocess.TimeoutExpired:
                    self.kill()
        except Exception as exc:  # noqa: BLE001 - one stuck child must not leak the others
            print(f"disagg_tools.bench.procs: could not stop {self!r}: {exc!r}", file=sys.stderr)

    def __repr__(self) -> str:
        pid = self.popen.pid if self.popen else None
        return f"Child({self.name} pid={pid} alive={self.alive()} starts={self.starts})"


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
        return [
            sys.executable,
            "-m",
            "disagg_tools.sim.worker",
            "--log-level",
            s.log_level,
            "--role",
            role,
            "--host",
            HOST,
            "--port",
            str(port),
            "--worker-id",
            wid,
            "--model",
            s.model,
            "--gpu",
            s.gpu,
            "--time-scale",
            str(s.time_scale),
            "--kv-blocks",
            str(s.kv_blocks),
            "--mean-output-tokens",
            str(s.mean_output_tokens),
            "--kv-lease-s",
            str(s.worker_kv_lease_s * s.time_scale),
            *s.worker_args.get(wid, []),
        ]

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
        config: dict[str, Any] = {
            "host": HOST,
            "port": port,
            "model": s.model,
            "perf": {"model": s.model, "gpu": s.gpu},
            "redis_url": self.redis_url,
            "key_prefix": self.key_prefix,
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
            "health_interval_s": 0.5,
            **s.router,
        }
        cfg = self.workdir / "router.yaml"
        cfg.write_text(yaml.safe_dump(config, sort_keys=False))
        cmd = [
            sys.executable,
            "-m",
            "router.serve_cli",
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


def run_and_report(
    coro: Coroutine[Any, Any, dict[str, Any]],
    format_report: Callable[[dict[str, Any]], str],
    *,
    workdir: Path | None,
    json_path: Path | None,
) -> int:
    """The bench tools' entry: run `coro` on uvloop when it is installed (the router's own
    loop), print the report, write it as JSON if asked; the exit code says whether any
    invariant was violated."""
    report = uvrun.run(coro)
    print(format_report(report))
    if workdir is not None:
        print(f"  logs            {workdir}")
    if json_path is not None:
        json_path.write_text(json.dumps(report, indent=2))
    return 1 if report["violations"] else 0
