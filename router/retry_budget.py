"""The cluster-wide retry budget as one replica uses it.

Spending a retry is a store call (the budget is shared by every replica: Finagle's rule of
`ratio` × recent requests + a floor). Counting requests toward the window is not: each replica
tallies its first attempts locally and adds the tally to the store twice a second, on the
background loops' shared beat (router/edge/wiring.py), so a request costs no store call for it
and nothing is left running per request; an idle replica neither calls the store nor wakes up
for it (`counted`). The window is 10 s; a count that lands up to 0.5 s late moves it by 5 % at
most, and towards fewer retries, never more.
"""

from __future__ import annotations

import asyncio

from router.config import RetrySettings
from state.base import RetryBudgetPolicy, StateStore

__all__ = ["RetryBudget"]


class RetryBudget:
    def __init__(self, store: StateStore, settings: RetrySettings) -> None:
        self.store = store
        self.policy = RetryBudgetPolicy(
            settings.budget_ratio, settings.budget_min_per_s, settings.budget_window_s
        )
        self._untallied = 0
        self._counted = asyncio.Event()  # set by the first request after a flush

    def __repr__(self) -> str:
        return f"RetryBudget({self.policy}, untallied={self._untallied})"

    def note_request(self) -> None:
        """One first attempt (a failed request counts toward the window like any other)."""
        self._untallied += 1
        if self._untallied == 1:
            self._counted.set()

    async def counted(self) -> None:
        """Returns once there is a tally to flush: the flushing loop sleeps here while the
        replica is idle instead of waking a few times a second for nothing."""
        if self._untallied:
            return
        self._counted.clear()
        await self._counted.wait()

    async def flush(self) -> None:
        """Add the local tally to the store's window; kept for the next flush if it fails."""
        if not self._untallied:
            return  # an idle replica makes no store call for nothing
        count, self._untallied = self._untallied, 0
        try:
            await self.store.note_request(count)
        except BaseException:
            self._untallied += count
            raise

    async def try_retry(self) -> bool:
        """Spend one retry if the cluster-wide budget allows it (StoreError if unreachable)."""
        return await self.store.try_retry(self.policy)
