"""Draining a worker: no new placements on it (prefill or decode) while its streams finish.

The drained set lives in the shared store (`{reg}:drained`), so a drain taken by one replica's
admin API reaches every replica within its registry refresh (`registry_refresh_s`); the
replica that takes the call applies it at once. A drained worker stays in the pools (its
health is still probed, its reservations still renewed and released): it is only left out of
the placement snapshot, through `WorkerState.available`.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Protocol

from state.base import StateStore

__all__ = ["apply_drained", "set_drained"]

log = logging.getLogger(__name__)


class _Drainable(Protocol):
    @property
    def worker_id(self) -> str: ...

    drained: bool


def apply_drained(workers: Iterable[_Drainable], drained: set[str]) -> None:
    """Mark each of `workers` drained or not as the shared set says (logged on a change)."""
    for w in workers:
        now = w.worker_id in drained
        if now != w.drained:
            log.info("worker %s %s", w.worker_id, "drained" if now else "back in use")
            w.drained = now


async def set_drained(
    store: StateStore, workers: Iterable[_Drainable], worker_id: str, drained: bool
) -> bool:
    """Drain (or undrain) `worker_id` for every replica; applied here at once. True if that
    changed the shared state."""
    changed = await store.set_drained(worker_id, drained)
    apply_drained(
        (w for w in workers if w.worker_id == worker_id),
        {worker_id} if drained else set(),
    )
    return changed
