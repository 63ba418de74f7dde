"""The stranded-KV reaper: KV held on a prefill worker past the KV lease is gone, counted, dropped.

The request that owned it fails its decode leg and is retried (or fails) through the normal
path; this keeps the ledger (and placement's backpressure) honest meanwhile.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from router.config import Settings
from router.loop_timing import LoopTiming
from router.workers.accounting import LocalAccounting
from router.workers.membership import Membership
from state.base import StateStore, StoreError

__all__ = ["StrandedReaper"]

log = logging.getLogger(__name__)


class StrandedReaper:
    def __init__(
        self,
        settings: Settings,
        store: StateStore,
        members: Membership,
        accounting: LocalAccounting,
        timing: LoopTiming,
        on_expired: Callable[[str], None] | None = None,
    ) -> None:
        """`on_expired(worker_id)`: one entry expired there (the metrics count it)."""
        self._settings = settings
        self._store = store
        self._members = members
        self._accounting = accounting
        self._timing = timing
        self._on_expired = on_expired

    def __repr__(self) -> str:
        return f"StrandedReaper(every {self._settings.loops.stranded_reap_s} s while any is held)"

    async def run(self) -> None:
        s = self._settings
        while True:
            # While no prefill worker holds stranded KV (every replica's entries, as the last
            # refresh read them, and this replica's since), there is nothing to reap: no wake-ups.
            await self._accounting.stranded_somewhere()
            await self._timing.beat(s.loops.stranded_reap_s)
            for w in list(self._members.prefill_workers):
                if w.stranded_bytes == 0:
                    continue  # nothing stranded there: no store call
                try:
                    expired = await self._store.reap_stranded(w.spec.id, s.leases.kv_s)
                except asyncio.CancelledError:
                    raise
                except StoreError:
                    continue  # the refresher reports the outage once
                except Exception as exc:
                    log.warning("reaping stranded KV on %s failed: %r", w.spec.id, exc)
                    continue
                for entry in expired:
                    log.warning(
                        "stranded KV of %s on %s expired after %.0f s (%d bytes)",
                        entry.request_id,
                        entry.prefill_id,
                        s.leases.kv_s,
                        entry.nbytes,
                    )
                    if self._on_expired is not None:
                        self._on_expired(w.spec.id)
