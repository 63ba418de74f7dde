"""The workers' own load reports, polled while this replica serves.

vLLM's `/metrics`, SGLang's `/get_load` (router/workers/discovery.py): running and waiting
requests and KV usage, kept on each worker for the placement snapshot, which trusts a reading
for `load_max_age_s`. The router's own accounting stays the primary signal; a worker with no
load endpoint is placed by it alone. A data-parallel server is polled once, its report split by
rank into its rank targets (router/workers/dp_loads.py).
"""

from __future__ import annotations

import asyncio
import logging

import aiohttp

from router.config import Settings
from router.loop_timing import LoopTiming
from router.workers.discovery import fetch_sglang_load, fetch_vllm_load
from router.workers.dp_loads import assign_rank_loads, fetch_rank_loads
from router.workers.dp_ranks import is_lead
from router.workers.membership import Membership
from router.workers.worker_state import WorkerState

__all__ = ["LoadPoller"]

log = logging.getLogger(__name__)


class LoadPoller:
    def __init__(self, settings: Settings, members: Membership, timing: LoopTiming) -> None:
        self._settings = settings
        self._members = members
        self._timing = timing
        self._foreign: set[str] = set()  # DP entries that reported undeclared ranks (told once)

    def __repr__(self) -> str:
        return f"LoadPoller(every {self._settings.loops.load_poll_s} s while busy)"

    async def poll(self, session: aiohttp.ClientSession, w: WorkerState) -> None:
        fetch = fetch_sglang_load if w.spec.adapter == "sglang" else fetch_vllm_load
        try:
            w.took_load(await fetch(session, w.spec.url))
        except Exception as exc:  # no load endpoint: the router's own accounting stands
            log.debug("load poll of %s failed: %s", w.spec.id, exc)

    async def poll_ranks(self, session: aiohttp.ClientSession, lead: WorkerState) -> None:
        """A data-parallel server's report split by rank, each rank target its own
        (router/workers/dp_loads.py); a rank the entry does not declare is ignored, said once."""
        spec = lead.spec
        try:
            loads = await fetch_rank_loads(session, spec.url, spec.adapter)
        except Exception as exc:  # as `poll`: the router's own accounting stands
            log.debug("load poll of %s failed: %s", spec.dp_parent, exc)
            return
        foreign = assign_rank_loads(self._members.ranks_of(spec.dp_parent), loads)
        if foreign and spec.dp_parent not in self._foreign:
            self._foreign.add(spec.dp_parent)
            log.warning(
                "worker %s reports the load of data-parallel ranks %s beyond its dp_size %d: "
                "ignored (is its entry's dp_size the server's?)",
                spec.dp_parent, foreign, spec.dp_size,
            )  # fmt: skip

    async def run(self, session: aiohttp.ClientSession) -> None:
        """Every `load_poll_s` while this replica serves. While it is quiet, not at all: a
        reading older than `load_max_age_s` is not trusted anyway, and each poll costs
        router CPU (the request, and reading four gauges of a vLLM text of tens of KB:
        router/workers/prom_samples.py). The first
        placement after a quiet spell polls at once (placement meanwhile goes by the router's
        own accounting, as with any stale reading)."""
        period = self._settings.loops.load_poll_s
        if period <= 0:
            return
        workers = self._members.workers
        while True:
            # A data-parallel server: one poll of its URL (its lead), split by rank.
            await asyncio.gather(
                *(
                    self.poll(session, w) if w.spec.dp_size == 1 else self.poll_ranks(session, w)
                    for w in list(workers.values())
                    if w.spec.dp_size == 1 or is_lead(w.spec)
                )
            )
            await self._timing.beat(period)
            while not self._timing.busy():
                await self._timing.quiet_sleep(3600.0)  # the next placement, however long it takes
