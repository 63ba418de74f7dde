"""This replica's own accounting of what it puts on the workers, at once, between refreshes.

The router's own accounting is the primary load signal (docs/design.md §4: the peers' counters
miss requests still in prefill). Reserved blocks per decode worker come from the shared store
(every replica's reservations, router/workers/refresher.py) and are adjusted here at once after
each reserve and release, so back-to-back requests on one replica see each other; a placement
being written to the store counts as pending meanwhile; stranded KV per prefill worker is
counted from the hand-off to the decode side's pull.

A worker removed while requests were on it is no longer counted: their releases still go to
the store by id.
"""

from __future__ import annotations

import asyncio

from router.loop_timing import LoopTiming
from router.workers.membership import Membership

__all__ = ["LocalAccounting"]


class LocalAccounting:
    def __init__(self, members: Membership, timing: LoopTiming) -> None:
        self._members = members
        self._timing = timing
        # Set whenever a prefill worker is seen holding stranded KV (wakes the reaper).
        self._stranded = asyncio.Event()

    def __repr__(self) -> str:
        return f"LocalAccounting({len(self._members.workers)} workers)"

    def note_reserved(self, worker_id: str, blocks: int) -> None:
        if (w := self._members.workers.get(worker_id)) is not None:
            w.reserved_blocks += blocks

    def note_pending(self, worker_id: str, blocks: int) -> None:
        """A placement's blocks while its reservation is on its way to the store (negative:
        landed or given up). A placement wakes the loops that slow down while quiet."""
        if (w := self._members.workers.get(worker_id)) is not None:
            w.pending_blocks = max(0, w.pending_blocks + blocks)
        if blocks > 0:
            self._timing.placed()

    def note_released(self, worker_id: str, blocks: int) -> None:
        if (w := self._members.workers.get(worker_id)) is not None:
            w.reserved_blocks = max(0, w.reserved_blocks - blocks)

    def note_stranded(self, worker_id: str, nbytes: int) -> None:
        if (w := self._members.workers.get(worker_id)) is not None:
            w.stranded_bytes = max(0, w.stranded_bytes + nbytes)
        if nbytes > 0:
            self._stranded.set()

    def stranded_from_store(self, worker_id: str, nbytes: int) -> None:
        """The store's count of a prefill worker's stranded KV (every replica's), replacing
        this replica's adjusted one."""
        if (w := self._members.workers.get(worker_id)) is not None:
            w.stranded_bytes = nbytes
            if nbytes:
                self._stranded.set()

    async def stranded_somewhere(self) -> None:
        """Returns once some worker holds stranded KV (at once if one does now)."""
        if any(w.stranded_bytes for w in self._members.workers.values()):
            return
        self._stranded.clear()
        await self._stranded.wait()
