"""Keeps this replica's decode reservations alive while their requests are.

One task renews every live lease each third of the lease period, so a streaming request keeps
its room, and a router that dies stops renewing: its reservations expire by themselves
(design.md §2). Renewal is batched per tick, not a task per request.
"""

from __future__ import annotations

import asyncio
import logging

from state.base import StateStore

__all__ = ["LeaseKeeper"]

log = logging.getLogger(__name__)


class LeaseKeeper:
    def __init__(self, store: StateStore, lease_s: float) -> None:
        self.store = store
        self.lease_s = lease_s
        self.live: dict[str, str] = {}  # reservation id -> decode worker id
        # reservation id -> (blocks, expected end on the monotonic clock): what prediction-based
        # admission counts on freeing up (this replica's reservations; others' are not known)
        self.expected: dict[str, tuple[int, float]] = {}

    def __repr__(self) -> str:
        return f"LeaseKeeper({len(self.live)} live, lease={self.lease_s}s)"

    def hold(
        self,
        worker_id: str,
        reservation_id: str,
        blocks: int = 0,
        expected_end: float = float("inf"),
    ) -> None:
        self.live[reservation_id] = worker_id
        self.expected[reservation_id] = (blocks, expected_end)

    def resized(self, reservation_id: str, blocks: int) -> None:
        if reservation_id in self.expected:
            self.expected[reservation_id] = (blocks, self.expected[reservation_id][1])

    def drop(self, reservation_id: str) -> None:
        self.live.pop(reservation_id, None)
        self.expected.pop(reservation_id, None)

    def freeing_by(self, when: float) -> dict[str, int]:
        """Blocks per decode worker whose reservations are expected to end by `when`."""
        out: dict[str, int] = {}
        for rid, (blocks, end) in self.expected.items():
            if end <= when and rid in self.live:
                wid = self.live[rid]
                out[wid] = out.get(wid, 0) + blocks
        return out

    async def renew_all(self) -> int:
        """Renew every live lease; returns how many were already gone (expired under us).

        A lease can expire under a live request when the store was unreachable for a whole
        lease period. Its sequence still occupies the decode worker, so the reservation is
        put back — over capacity if another request took the room meanwhile — rather than
        left uncounted (which would let placement overfill that worker)."""
        items = list(self.live.items())
        results = await asyncio.gather(
            *(self.store.renew(wid, rid, self.lease_s) for rid, wid in items),
            return_exceptions=True,
        )
        lost = 0
        for (rid, wid), ok in zip(items, results, strict=True):
            if isinstance(ok, BaseException):
                log.warning("lease renewal of %s on %s failed: %s", rid, wid, ok)
            elif not ok and rid in self.live:
                lost += 1
                await self._reinstate(rid, wid)
        return lost

    async def _reinstate(self, rid: str, wid: str) -> None:
        blocks = self.expected.get(rid, (0, 0.0))[0]
        try:
            # Overbooking by its own size always fits: the room is in use whatever the count.
            ok = blocks > 0 and await self.store.reserve(
                wid, rid, blocks, self.lease_s, overbook_blocks=blocks
            )
        except Exception as exc:
            log.warning("reservation %s on %s expired and could not be put back: %s", rid, wid, exc)
            return  # still live: the next tick tries again
        if ok:
            log.warning("reservation %s on %s expired while its request was alive: "
                        "put back (%d blocks)", rid, wid, blocks)
        else:
            log.warning("reservation %s on %s expired while its request was alive", rid, wid)
            self.drop(rid)

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.lease_s / 3)
            try:
                await self.renew_all()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("lease renewal tick failed: %s", exc)
