"""What one tenant holds and really reserves, read from the store (issue 31's poison scenario).

A tenant's concurrent-blocks hold is the store's `:hsum` (the sum of its per-request `:holds`,
state/keys.py `tenant_quota`). What the tenant really reserves on the decode workers the store
does not say by tenant (a reservation's id is random): it is read as everything reserved on
the decode workers (`{d:<id>}:sum`) at the instants when no other tenant holds anything (the
scenario gives the other tenant a block limit that never binds, so that its holds are in the
store: a hold is taken before its request waits for room, so while another tenant holds
blocks its reservations cannot be told from the attacker's). Before issue 31 a hold was sized
once from the estimate: the hold then said 10 blocks while 1,320 were reserved, and only the
second figure shows it.

Every ~50 ms one MULTI reads all of it at one instant. Peaks are kept per phase (`phase`, set
by the caller), and apart for the instants when more than one of the tenant's requests held
or reserved blocks: the store lets a tenant holding nothing take or grow ONE request past its
limit (state/quota_scripts.py: else a request larger than the limit could never be served),
so only those say whether requests *together* passed it.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field

import redis.asyncio as aioredis

from disagg_tools.loadgen.hostile_tenants import hsum_key

__all__ = ["AttackerPeak", "AttackerSampler"]


@dataclass(frozen=True, slots=True)
class AttackerPeak:
    """One instant: the attacker's hold, the largest request's part of it and how many of its
    requests held blocks (a preempted stream's hold is 0); what it really reserved and in how
    many reservations."""

    hold: int = 0
    largest: int = 0
    holding: int = 0
    reserved: int = 0
    reservations: int = 0


@dataclass
class AttackerSampler:
    redis_url: str
    prefix: str
    attacker: str
    others: list[str]  # every other tenant: each with a block limit (module docstring)
    workers: list[str]  # the decode workers
    period_s: float = 0.05
    phase: str = "run"
    # phase -> the peak hold, the peak reservation, and both among instants with > 1 request
    peaks: dict[str, dict[str, AttackerPeak]] = field(default_factory=dict)
    samples: int = 0
    alone: int = 0  # samples with no other tenant holding: the reservation is all the attacker's
    errors: int = 0
    _stop: asyncio.Event = field(default_factory=asyncio.Event)
    _task: asyncio.Task[None] | None = None

    def highest(self, what: str) -> AttackerPeak:
        """The peak of `what` ("hold", "reserved", "hold, shared", "reserved, shared") over
        every phase."""
        by_hold = what.startswith("hold")
        found = [p[what] for p in self.peaks.values() if what in p]
        return max(found, key=lambda p: p.hold if by_hold else p.reserved, default=AttackerPeak())

    async def _sample(self, client: aioredis.Redis) -> None:
        pipe = client.pipeline(transaction=True)
        for wid in self.workers:
            pipe.get(f"{self.prefix}{{d:{wid}}}:sum")  # state/keys.py, Keys.decode_*
            pipe.hlen(f"{self.prefix}{{d:{wid}}}:res")
        for tenant in (self.attacker, *self.others):
            pipe.hvals(f"{self.prefix}{{t:{tenant}}}:holds")  # "blocks|expected end" each
            pipe.get(hsum_key(self.prefix, tenant))
        values = await pipe.execute()
        n = len(self.workers)
        reserved = sum(int(values[2 * i] or 0) for i in range(n))
        reservations = sum(int(values[2 * i + 1]) for i in range(n))
        tenants = []
        for j in range(1 + len(self.others)):
            blocks = [int(v.split(b"|", 1)[0]) for v in values[2 * n + 2 * j]]
            tenants.append((int(values[2 * n + 2 * j + 1] or 0), blocks))
        (hold, blocks), others = tenants[0], tenants[1:]
        alone = not any(h for h, _ in others)
        now = AttackerPeak(
            hold=hold,
            largest=max(blocks, default=0),
            holding=sum(b > 0 for b in blocks),
            reserved=reserved if alone else 0,
            reservations=reservations if alone else 0,
        )
        self.samples += 1
        self.alone += alone
        peaks = self.peaks.setdefault(self.phase, {})
        measured = [("hold", now.hold, now.holding)]
        if alone:
            measured.append(("reserved", now.reserved, now.reservations))
        for what, value, count in measured:
            keys = [what] + ([f"{what}, shared"] if count > 1 else [])
            for key in keys:
                best = peaks.get(key)
                if best is None or value > (best.hold if what == "hold" else best.reserved):
                    peaks[key] = now

    async def _loop(self) -> None:
        client = aioredis.from_url(self.redis_url)
        try:
            while not self._stop.is_set():
                try:
                    await self._sample(client)
                except (OSError, aioredis.RedisError, ValueError):
                    self.errors += 1
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stop.wait(), self.period_s)
        finally:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(2.0):
                    await client.aclose()

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        self._stop.set()  # between two reads, not by cancelling one (StoreSampler.stop: why)
        if self._task is not None:
            done, _ = await asyncio.wait({self._task}, timeout=5.0)
            if not done:
                self._task.cancel()
