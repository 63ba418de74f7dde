"""A read-through cache of the shared output-length histograms.

Estimators are pure: they get histograms, not a store. This cache keeps the per-request path
free of store round trips: a cold class is fetched once, then refreshed in the background at
most every `refresh_s`, so every replica learns from every completion within about a second.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping, Sequence

from router.background import BackgroundTasks
from state.base import StateStore

__all__ = ["HistogramCache"]


class HistogramCache:
    def __init__(self, store: StateStore, refresh_s: float, tasks: BackgroundTasks) -> None:
        self.store = store
        self.refresh_s = refresh_s
        self.tasks = tasks
        self._data: dict[str, Mapping[int, int]] = {}
        self._fetched_at: dict[str, float] = {}
        self._refreshing = False
        # Cold classes being fetched, so that a burst of requests of a new class makes one
        # store call, not one each (a 2,000-request burst would otherwise be 2,000 fetches).
        self._cold: dict[str, asyncio.Task[None]] = {}

    def __repr__(self) -> str:
        return f"HistogramCache({len(self._data)} classes)"

    async def _refresh(self, keys: Sequence[str]) -> None:
        try:
            await self._fetch(keys)
        finally:
            self._refreshing = False

    async def _fetch_cold(self, keys: list[str]) -> None:
        new = [k for k in keys if k not in self._cold]
        if new:
            task = self.tasks.job(self._fetch(new), "histogram-fetch")
            for k in new:
                self._cold[k] = task

            def fetched(_task: asyncio.Task[None]) -> None:
                for k in new:
                    self._cold.pop(k, None)

            task.add_done_callback(fetched)
        pending = {t for k in keys if (t := self._cold.get(k)) is not None}
        # Shielded: a request cancelled here (its client left) stops waiting at once, and the
        # shared fetch goes on for the others. A failed fetch fails every waiter (StoreError).
        await asyncio.gather(*(asyncio.shield(t) for t in pending))

    async def _fetch(self, keys: Sequence[str]) -> None:
        fresh = await self.store.output_histograms(keys)
        now = time.monotonic()
        for k in keys:
            self._data[k] = fresh.get(k, {})
            self._fetched_at[k] = now

    async def get(self, keys: Sequence[str]) -> dict[str, Mapping[int, int]]:
        missing = [k for k in keys if k not in self._data]
        if missing:
            await self._fetch_cold(missing)
        now = time.monotonic()
        stale = [k for k in keys if now - self._fetched_at.get(k, 0.0) > self.refresh_s]
        if stale and not self._refreshing:
            # One refresh at a time; a failed one is tried again on a later request.
            self._refreshing = True
            self.tasks.job(self._refresh(stale), "histogram-refresh")
        return {k: self._data.get(k, {}) for k in keys}
