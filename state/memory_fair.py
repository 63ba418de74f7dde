"""The cluster's fair share on `MemoryStore` (state/fair_shares.py has the steps, which this only
applies: no await, so the call is atomic like the Redis script)."""

from __future__ import annotations

from collections.abc import Callable, Mapping

from state.fair_shares import FairSlot, FairTable, FairView, check_fair_sync, fair_sync_now

__all__ = ["MemoryFair"]


class MemoryFair:
    """A mixin of `MemoryStore`: it provides `_clock` and `_fair`."""

    _clock: Callable[[], float]
    _fair: FairTable

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
