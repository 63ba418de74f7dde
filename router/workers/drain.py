"""Draining a worker: no new placements on it (prefill or decode) while its streams finish.

The drained set lives in the shared store (`{reg}:drained`), so a drain taken by one replica's
admin API reaches every replica within its registry refresh (`registry_refresh_s`); the
replica that takes the call applies it at once. Each change is recorded with its time (a
`DrainMark`, undrains too): each replica keeps the marks it last saw, and puts them back if
the store loses its data (router/workers/store_loss.py), the latest mark winning.

A drained worker stays in the pools (its health is still probed, its reservations still
renewed and released): it is only left out of the placement snapshot, through
`WorkerState.available`.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import Protocol

from state.base import DrainMark, StateStore

__all__ = ["apply_drained", "drain_view", "set_drained"]

log = logging.getLogger(__name__)


class _Drainable(Protocol):
    @property
    def worker_id(self) -> str: ...

    drained: bool
    drain_mark: DrainMark | None


def apply_drained(workers: Iterable[_Drainable], marks: Mapping[str, DrainMark]) -> None:
    """Mark each of `workers` drained or not as the store's marks say (logged on a change);
    each keeps its mark, to put back after a store loss."""
    for w in workers:
        mark = marks.get(w.worker_id)
        w.drain_mark = mark
        now = mark is not None and mark.drained
        if now != w.drained:
            log.info("worker %s %s", w.worker_id, "drained" if now else "back in use")
            w.drained = now


def drain_view(workers: Iterable[_Drainable]) -> dict[str, DrainMark]:
    """The drain marks this replica knows (its last registry read or its own changes)."""
    return {w.worker_id: w.drain_mark for w in workers if w.drain_mark is not None}


async def set_drained(
    store: StateStore, workers: Iterable[_Drainable], worker_id: str, drained: bool
) -> bool:
    """Drain (or undrain) `worker_id` for every replica; applied here at once, with the mark
    the store recorded (its time is what a put-back after a loss is judged by). True if that
    changed the shared state."""
    changed = await store.set_drained(worker_id, drained)
    marks = await store.drain_marks()
    apply_drained((w for w in workers if w.worker_id == worker_id), marks)
    return changed
