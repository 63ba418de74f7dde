"""What the load and soak runs read from outside the router: its admin state, its metrics, the
Redis it uses, and its process in /proc. No import of the router: HTTP, Redis and /proc only.

Left-over state is read twice, independently:
    the router's view   GET /admin/state: reserved_blocks per decode worker, stranded_bytes per
                        prefill worker, live_reservations and inflight of this replica
    Redis itself        the keys under the run's prefix (layout in state/keys.py):
                        `{d:<w>}:lease` zset members with a lease still in the future, and
                        `{p:<w>}:bytes` hash fields (stranded-KV entries not yet cleared)
"""

from __future__ import annotations

import asyncio
import re
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import redis.asyncio as aioredis

from disagg_tools.procs import process_rss_bytes

__all__ = [
    "Leftovers",
    "RssSampler",
    "admin_state",
    "leftovers",
    "listen_overflows",
    "metric_sums",
    "redis_commands",
    "wait_quiet",
]

_METRIC = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+([-+0-9.eEinfNa]+)")


async def admin_state(session: aiohttp.ClientSession, router_url: str) -> dict[str, Any]:
    async with session.get(
        router_url + "/admin/state", timeout=aiohttp.ClientTimeout(total=10)
    ) as resp:
        resp.raise_for_status()
        return dict(await resp.json())


async def metric_sums(session: aiohttp.ClientSession, router_url: str) -> dict[str, float]:
    """Every sample of /metrics summed over its labels, plus `name{labels}` entries as they are."""
    async with session.get(
        router_url + "/metrics", timeout=aiohttp.ClientTimeout(total=10)
    ) as resp:
        text = await resp.text()
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _METRIC.match(line)
        if not m:
            continue
        name, labels, value = m.group(1), m.group(2) or "", float(m.group(3))
        out[name] = out.get(name, 0.0) + value
        if labels:
            out[name + labels] = value
    return out


async def redis_commands(url: str) -> dict[str, int]:
    """calls per command from INFO commandstats (cumulative since the server started)."""
    client = aioredis.from_url(url)
    try:
        stats = await client.info("commandstats")
    finally:
        await client.aclose()
    out: dict[str, int] = {}
    for key, value in stats.items():
        name = key.removeprefix("cmdstat_")
        if isinstance(value, dict):
            out[name] = int(value.get("calls", 0))
    return out


def listen_overflows() -> int:
    """TcpExt ListenOverflows of this machine (every listener, not only the router's): SYNs
    or handshake ACKs dropped because an accept queue was full."""
    try:
        with open("/proc/net/netstat") as f:
            lines = f.read().splitlines()
    except OSError:
        return 0
    for names, values in zip(lines[::2], lines[1::2], strict=False):
        if names.startswith("TcpExt:"):
            table = dict(zip(names.split()[1:], values.split()[1:], strict=False))
            return int(table.get("ListenOverflows", 0))
    return 0


def command_delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    """Calls per command between two readings, without our own INFO calls."""
    delta = {k: v - before.get(k, 0) for k, v in after.items()}
    delta.pop("info", None)
    return {k: v for k, v in sorted(delta.items(), key=lambda kv: -kv[1]) if v > 0}


@dataclass(slots=True)
class Leftovers:
    """What is still held once the traffic is over."""

    reserved_blocks: dict[str, int] = field(default_factory=dict)  # router view, per decode worker
    stranded_bytes: dict[str, int] = field(default_factory=dict)  # router view, per prefill worker
    live_reservations: int = 0  # this replica's lease keeper
    inflight: int = 0
    redis_live_leases: dict[str, int] = field(default_factory=dict)  # Redis, per decode worker
    redis_stranded_entries: dict[str, int] = field(default_factory=dict)  # Redis, per prefill
    error: str | None = None

    @property
    def reservations(self) -> int:
        return sum(self.reserved_blocks.values()) + sum(self.redis_live_leases.values())

    @property
    def stranded(self) -> int:
        return sum(self.stranded_bytes.values()) + sum(self.redis_stranded_entries.values())

    @property
    def clean(self) -> bool:
        return (
            self.error is None
            and self.reservations == 0
            and self.stranded == 0
            and self.live_reservations == 0
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "reserved_blocks": self.reserved_blocks,
            "stranded_bytes": self.stranded_bytes,
            "live_reservations": self.live_reservations,
            "inflight": self.inflight,
            "redis_live_leases": self.redis_live_leases,
            "redis_stranded_entries": self.redis_stranded_entries,
            "error": self.error,
        }

    def __repr__(self) -> str:
        return (
            f"Leftovers(reserved={self.reserved_blocks} stranded={self.stranded_bytes} "
            f"live={self.live_reservations} redis_leases={self.redis_live_leases} "
            f"redis_stranded={self.redis_stranded_entries} error={self.error})"
        )


async def leftovers(
    session: aiohttp.ClientSession, router_url: str, redis_url: str, prefix: str
) -> Leftovers:
    out = Leftovers()
    try:
        state = await admin_state(session, router_url)
        out.live_reservations = int(state.get("live_reservations", 0))
        out.inflight = int(state.get("inflight", 0))
        for w in state.get("workers", []):
            if w["role"] in ("decode", "both"):
                out.reserved_blocks[w["id"]] = int(w.get("reserved_blocks") or 0)
            if w["role"] in ("prefill", "both"):
                out.stranded_bytes[w["id"]] = int(w.get("stranded_bytes") or 0)
    except (aiohttp.ClientError, TimeoutError, ValueError, KeyError) as exc:
        out.error = f"admin state: {type(exc).__name__}: {exc}"
    client = aioredis.from_url(redis_url)
    try:
        now = time.time()
        async for key in client.scan_iter(match=prefix + "*", count=1000):
            name = key.decode()
            m = re.search(r"\{([dp]):([^}]*)\}:(lease|bytes)$", name)
            if not m:
                continue
            kind, wid, _ = m.groups()
            if kind == "d":
                out.redis_live_leases[wid] = int(await client.zcount(name, f"({now}", "+inf"))
            else:
                out.redis_stranded_entries[wid] = int(await client.hlen(name))
    except (OSError, aioredis.RedisError) as exc:
        out.error = (out.error or "") + f" redis: {type(exc).__name__}: {exc}"
    finally:
        await client.aclose()
    return out


async def wait_quiet(
    session: aiohttp.ClientSession,
    router_url: str,
    redis_url: str,
    prefix: str,
    timeout_s: float,
    poll_s: float = 0.5,
) -> tuple[Leftovers, float]:
    """Poll until nothing is left (or `timeout_s`); returns the last reading and the wait."""
    t0 = time.monotonic()
    while True:
        left = await leftovers(session, router_url, redis_url, prefix)
        waited = time.monotonic() - t0
        if (left.clean and left.inflight == 0) or waited >= timeout_s:
            return left, waited
        await asyncio.sleep(poll_s)


class RssSampler:
    """Samples a pid's RSS every `period_s` while running (restarted pids are followed by name)."""

    def __init__(self, pid_fn: Any, period_s: float = 1.0) -> None:
        self._pid_fn = pid_fn
        self.period_s = period_s
        self.samples: list[tuple[float, int]] = []
        self._task: asyncio.Task[None] | None = None

    async def _loop(self) -> None:
        while True:
            rss = process_rss_bytes(self._pid_fn())
            if rss:
                self.samples.append((time.monotonic(), rss))
            await asyncio.sleep(self.period_s)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    @property
    def peak(self) -> int:
        return max((r for _, r in self.samples), default=0)
