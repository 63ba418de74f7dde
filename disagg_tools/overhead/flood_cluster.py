"""The flood benchmark's processes: two stand-in workers and `disagg-router serve --config`.

    workers  one prefill and one decode `disagg_tools.overhead.fixed_worker` (timing fixed
             whatever the load); the decode room is the configuration's `kv_blocks`, small, so
             the router's admission queue is what saturates
    router   `disagg-router serve --config <dir>/flood.yaml`: tenants `victim`, `aggressor`
             (optionally `requests_per_minute`) and `probe` (the capacity run's, so neither
             measured tenant's counters start with it), each with one plain key; `fairness`;
             Redis under a fresh key prefix, deleted by `Cluster.close`

Everything started here is a `disagg_tools.procs.Child`, stopped by `close`.
"""

from __future__ import annotations

import asyncio
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import redis.asyncio as aioredis

from disagg_tools.overhead.targets import (
    fixed_worker_command,
    fresh_key_prefix,
    shell_line,
    wait_listening,
)
from disagg_tools.procs import HOST, Child, free_port

__all__ = ["Cluster", "ClusterSpec", "start_cluster", "TENANT_KEYS"]

# Plain keys: the configuration hashes them at load; a benchmark's keys guard nothing.
TENANT_KEYS = {t: f"sk-flood-{t}" for t in ("victim", "aggressor", "probe")}


@dataclass(frozen=True, slots=True)
class ClusterSpec:
    model: str
    redis_url: str
    fairness: str
    kv_blocks: int
    interval_ms: float
    prefill_ms: float
    first_token_ms: float
    max_wait_s: float
    victim_weight: float
    aggressor_weight: float
    aggressor_rpm: int  # 0: no limit
    # The router's estimator and its arguments (a YAML flow mapping, "" for none), and more of
    # its configuration (YAML lines in the settings' groups: the preemption bench's
    # `preemption: {enabled: false}`, disagg_tools/overhead/flood_preemption.py).
    estimator: str = "max_tokens"
    extra_config: str = ""
    estimator_args: str = ""


def router_config(spec: ClusterSpec, prefill_url: str, decode_url: str, prefix: str) -> str:
    rpm = f", requests_per_minute: {spec.aggressor_rpm}" if spec.aggressor_rpm > 0 else ""
    args = f", estimator_args: {spec.estimator_args}" if spec.estimator_args else ""
    k = TENANT_KEYS
    return "\n".join(
        [
            f"model: {spec.model}",
            "perf: {model: llama-3-8b, gpu: h100}",
            f'store: {{url: "{spec.redis_url}", key_prefix: "{prefix}"}}',
            # The answer is exactly max_tokens (the stand-in ignores EOS): reserve just that.
            f"estimates: {{estimator: {spec.estimator}{args}}}",
            *([spec.extra_config] if spec.extra_config else []),
            f"admission: {{mode: queue, max_wait_s: {spec.max_wait_s}, fairness: {spec.fairness}}}",
            "workers:",
            f"  - {{id: p0, url: {prefill_url}, role: prefill, adapter: vllm}}",
            f"  - {{id: d0, url: {decode_url}, role: decode, adapter: vllm, "
            f"kv_blocks: {spec.kv_blocks}}}",
            "tenants:",
            f"  - {{name: victim, weight: {spec.victim_weight}, "
            f"keys: [{{id: v, key: {k['victim']}}}]}}",
            f"  - {{name: aggressor, weight: {spec.aggressor_weight}{rpm}, "
            f"keys: [{{id: a, key: {k['aggressor']}}}]}}",
            f"  - {{name: probe, weight: 1, keys: [{{id: p, key: {k['probe']}}}]}}",
            "",
        ]
    )


def _router_executable() -> list[str]:
    exe = Path(sys.executable).with_name("disagg-router")
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "disagg_tools.launcher.main"]


@dataclass(slots=True)
class Cluster:
    prefill: Child
    decode: Child
    router: Child
    base_url: str
    key_prefix: str
    redis_url: str
    router_command: str
    config_text: str

    async def close(self) -> int:
        """Stop every process, then delete the run's Redis keys; how many were deleted."""
        for child in (self.router, self.decode, self.prefill):
            child.stop()
        client = aioredis.from_url(self.redis_url)
        deleted = 0
        try:
            batch: list[bytes] = []
            async for key in client.scan_iter(match=f"{self.key_prefix}*", count=500):
                batch.append(key)
                if len(batch) >= 500:
                    deleted += int(await client.delete(*batch))
                    batch.clear()
            if batch:
                deleted += int(await client.delete(*batch))
        finally:
            await client.aclose()
        return deleted


async def _wait_answering(base_url: str, model: str, proc: Child, timeout_s: float = 60.0) -> None:
    """Until one short completion comes back 200 through the router with the probe's key."""
    deadline = time.monotonic() + timeout_s
    body = {"model": model, "prompt": "ready?", "max_tokens": 2, "stream": False}
    headers = {"Authorization": f"Bearer {TENANT_KEYS['probe']}"}
    last = "not tried"
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
        while time.monotonic() < deadline:
            if not proc.alive():
                raise RuntimeError(f"{proc.name} exited:\n{proc.tail()}")
            try:
                async with session.post(
                    f"{base_url}/v1/completions", json=body, headers=headers
                ) as resp:
                    if resp.status == 200:
                        await resp.read()
                        return
                    last = f"{resp.status} {(await resp.text())[:200]}"
            except (TimeoutError, aiohttp.ClientError, OSError) as exc:
                last = repr(exc)
            await asyncio.sleep(0.3)
    raise RuntimeError(f"{proc.name} not answering after {timeout_s} s ({last}):\n{proc.tail()}")


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


async def start_cluster(spec: ClusterSpec, log_dir: Path) -> Cluster:
    """The workers, then the router (its configuration written to `log_dir`, which exists),
    once it answers."""
    started: list[Child] = []
    try:
        ports = {}
        for role in ("prefill", "decode"):
            port = free_port()
            cmd = fixed_worker_command(role, port, spec.model, spec.interval_ms, spec.prefill_ms)
            cmd += ["--first-token-ms", str(spec.first_token_ms)]
            started.append(Child(f"flood-worker-{role}", cmd, log_dir=log_dir))
            ports[role] = port
        for child, port in zip(started, ports.values(), strict=True):
            await wait_listening(port, child)
        prefix = fresh_key_prefix("flood")
        urls = {role: f"http://{HOST}:{port}" for role, port in ports.items()}
        text = router_config(spec, urls["prefill"], urls["decode"], prefix)
        cfg = _write(log_dir / "flood.yaml", text)
        port = free_port()
        cmd = [*_router_executable(), "--log-level", "WARNING", "serve", "--config", str(cfg)]
        cmd += ["--host", HOST, "--port", str(port)]
        router = Child("flood-router", cmd, log_dir=log_dir)
        started.append(router)
        base_url = f"http://{HOST}:{port}"
        await _wait_answering(base_url, spec.model, router)
    except BaseException:
        for child in started:
            child.stop()
        raise
    return Cluster(
        started[0], started[1], router, base_url, prefix, spec.redis_url, shell_line(cmd, {}), text
    )
