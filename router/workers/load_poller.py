"""The workers' own load reports, polled while this replica serves.

vLLM's `/metrics`, SGLang's `/get_load` (router/workers/discovery.py): running and waiting
requests and KV usage, kept on each worker for the placement snapshot, which trusts a reading
for `load_max_age_s`. The router's own accounting stays the primary signal; a worker with no
load endpoint is placed by it alone.
"""

from __future__ import annotations

import asyncio
import logging

import aiohttp

from router.config import Settings
from router.loop_timing import LoopTiming
from router.workers.discovery import fetch_sglang_load, fetch_vllm_load
from router.workers.membership import Membership
from router.workers.worker_state import WorkerState

__all__ = ["LoadPoller"]

log = logging.getLogger(__name__)


class LoadPoller:
    def __init__(self, settings: Settings, members: Membership, timing: LoopTiming) -> None:
        self._settings = settings
        self._members = members
        self._timing = timing

    def __repr__(self) -> str:
        return f"LoadPoller(every {self._settings.loops.load_poll_s} s while busy)"

    async def poll(self, session: aiohttp.ClientSession, w: WorkerState) -> None:
        fetch = fetch_sglang_load if w.spec.adapter == "sglang" else fetch_vllm_load
        try:
            w.load = await fetch(session, w.spec.url)
        except Exception as exc:  # no load endpoint: the router's own accounting stands
            log.debug("load poll of %s failed: %s", w.spec.id, exc)

    async def run(self, session: aiohttp.ClientSession) -> None:
        """Every `load_poll_s` while this replica serves. While it is quiet, not at all: a
        reading older than `load_max_age_s` is not trusted anyway, and a vLLM worker's
        /metrics costs ~1 ms of router CPU a poll (docs/history/benchmarks-overhead.md). The first
        placement after a quiet spell polls at once (placement meanwhile goes by the router's
        own accounting, as with any stale reading)."""
        period = self._settings.loops.load_poll_s
        if period <= 0:
            return
        workers = self._members.workers
        while True:
            # A data-parallel server's report is its ranks' together (or its first rank's):
            # wrong for each rank alone, so its ranks are placed by the router's accounting.
            polled = [w for w in workers.values() if w.spec.dp_size == 1]
            await asyncio.gather(*(self.poll(session, w) for w in polled))
            await self._timing.beat(period)
            while not self._timing.busy():
                await self._timing.quiet_sleep(3600.0)  # the next placement, however long it takes
