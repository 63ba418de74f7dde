"""The histogram cache against a real Redis: a burst of a cold class makes one store call."""

from __future__ import annotations

import asyncio
from typing import Any

from router.background import BackgroundTasks
from router.histograms import HistogramCache
from state import open_store
from tests.conftest import REDIS_URL


async def test_a_burst_of_a_cold_class_makes_one_store_call(redis_prefix: str) -> None:
    store = await open_store(REDIS_URL, redis_prefix)
    tasks = BackgroundTasks()
    try:
        await store.record_output(["c1"], 64)
        calls: list[tuple[str, ...]] = []
        real = store.output_histograms

        async def counting(keys: Any) -> Any:
            calls.append(tuple(keys))
            return await real(keys)

        store.output_histograms = counting  # type: ignore[method-assign]
        cache = HistogramCache(store, refresh_s=60.0, tasks=tasks)
        results = await asyncio.gather(*(cache.get(["c1", "c2"]) for _ in range(200)))
        assert calls == [("c1", "c2")]
        assert all(r == {"c1": {64: 1}, "c2": {}} for r in results)

        # A waiter that is cancelled (its client left) does not cancel the shared fetch.
        waiter = asyncio.create_task(cache.get(["c3"]))
        other = asyncio.create_task(cache.get(["c3"]))
        await asyncio.sleep(0)
        waiter.cancel()
        assert await other == {"c3": {}}
        assert calls[-1] == ("c3",) and len(calls) == 2
    finally:
        await tasks.close()
        await store.close()
