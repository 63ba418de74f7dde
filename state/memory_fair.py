"""The cluster's fair share on `MemoryStore` (state/fair_shares.py has the steps, which this only
applies: no await, so the call is atomic like the Redis script)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Mapping

from state.fair_shares import FairSlot, FairTable, FairView, check_fair_sync, fair_sync_now

__all__ = ["MemoryFair"]


class MemoryFair:
    """A mixin of `MemoryStore`: it provides `_clock`, `_fair` and `_nudged` (each replica
    listening: its queues, one per open `fair_nudges`)."""

    _clock: Callable[[], float]
    _fair: FairTable
    _nudged: dict[str, list[asyncio.Queue[None]]]

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

    async def fair_nudge(self, replica: str) -> None:
        for queue in self._nudged.get(replica, ()):
            queue.put_nowait(None)

    async def fair_nudges(self, replica: str) -> AsyncIterator[None]:
        queue: asyncio.Queue[None] = asyncio.Queue()
        self._nudged.setdefault(replica, []).append(queue)
        try:
            while True:
                await queue.get()
                yield None
        finally:
            listening = self._nudged[replica]
            listening.remove(queue)
            if not listening:
                del self._nudged[replica]
