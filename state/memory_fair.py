"""The cluster's fair share on `MemoryStore` (state/fair_shares.py has the steps, which this only
applies: no await, so the call is atomic like the Redis script)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Mapping

from state.fair_shares import (
    FairSlot,
    FairTable,
    FairView,
    check_fair_sync,
    check_nudge_line,
    fair_sync_now,
)

__all__ = ["MemoryFair"]


class MemoryFair:
    """A mixin of `MemoryStore`: it provides `_clock`, `_fair` and `_nudged` (each replica
    listening: its queues, one per open `fair_nudges`)."""

    _clock: Callable[[], float]
    _fair: FairTable
    _nudged: dict[str, list[asyncio.Queue[FairSlot | None]]]
    _claims: dict[str, float]  # "<line>|<k>" -> when its claim expires

    async def fair_sync(
        self,
        replica: str,
        charges: Mapping[FairSlot, float],
        waiting: Mapping[FairSlot, tuple[int, float]],
        lease_s: float,
        holding: Mapping[FairSlot, int] | None = None,
    ) -> FairView:
        check_fair_sync(replica, charges, waiting, lease_s, holding)
        now = self._clock()
        return fair_sync_now(self._fair, now, replica, charges, waiting, lease_s, holding)

    async def fair_claim(
        self, wanted: Mapping[str, tuple[int, int]], owner: str, ttl_s: float
    ) -> dict[str, int]:
        now = self._clock()
        claims = self._claims
        for unit in [u for u, expires in claims.items() if expires <= now]:
            del claims[unit]
        got: dict[str, int] = {}
        for line, (count, want) in wanted.items():
            got[line] = 0
            for k in range(count):
                unit = f"{line}|{k}"
                if got[line] < want and unit not in claims:
                    claims[unit] = now + ttl_s
                    got[line] += 1
        return got

    async def fair_nudge(self, replica: str, line: FairSlot | None = None) -> None:
        if line is not None:
            check_nudge_line(line)
        for queue in self._nudged.get(replica, ()):
            queue.put_nowait(line)

    async def fair_nudges(self, replica: str) -> AsyncIterator[FairSlot | None]:
        queue: asyncio.Queue[FairSlot | None] = asyncio.Queue()
        self._nudged.setdefault(replica, []).append(queue)
        try:
            while True:
                yield await queue.get()
        finally:
            listening = self._nudged[replica]
            listening.remove(queue)
            if not listening:
                del self._nudged[replica]
