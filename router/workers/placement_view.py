"""The pools as placement policies see them: a `ClusterView` snapshot of the membership.

Each view carries this replica's accounting (queued prompt tokens, reserved and pending
blocks, stranded KV; router/workers/accounting.py) and, when fresh, the worker's own load
report (router/workers/load_poller.py): stale reports are not trusted, least of all as idle.
"""

from __future__ import annotations

import time

from policies.base import ClusterView, DecodeView, PrefillView
from router.config import Settings
from router.workers.discovery import LoadSnapshot
from router.workers.membership import Membership
from router.workers.worker_state import WorkerState

__all__ = ["PlacementView"]

_NO_LOAD = LoadSnapshot(running=0, waiting=0, kv_usage=None, num_gpu_blocks=None, at=0.0)


class PlacementView:
    def __init__(self, members: Membership, settings: Settings) -> None:
        self._members = members
        self._settings = settings

    def __repr__(self) -> str:
        return f"PlacementView({len(self._members.workers)} workers)"

    def _fresh_load(self, w: WorkerState) -> LoadSnapshot | None:
        if w.load is None or w.load.stale(time.monotonic(), self._settings.load_max_age_s):
            return None  # stale data is not trusted, least of all as "idle"
        return w.load

    def _used_blocks(self, w: WorkerState) -> int:
        load = self._fresh_load(w)
        if load is None or load.kv_usage is None:
            return 0
        return int(load.kv_usage * w.capacity_blocks)

    def snapshot(
        self,
        avoid: frozenset[str] = frozenset(),
        model: str = "",
        freeing: dict[str, int] | None = None,
    ) -> ClusterView:
        """The workers serving `model` (all when empty); `avoid` = workers that already failed
        this request; `freeing` = blocks per decode worker forecast to be free by the time the
        prefill ends (prediction-based admission)."""
        freeing = freeing or {}
        members = self._members
        prefill = tuple(
            PrefillView(
                worker_id=w.spec.id,
                layout=w.spec.layout,
                healthy=w.available and w.spec.id not in avoid,
                group=w.spec.group,
                queued_prompt_tokens=w.queued_prompt_tokens,
                inflight=w.inflight,
                prefill_tokens_per_s=(
                    w.spec.perf.prefill_tokens_per_s() if w.spec.perf else 10_000.0
                ),
                stranded_bytes=w.stranded_bytes,
                stranded_cap_bytes=w.spec.stranded_cap_bytes,
                recent_prefixes=w.recent_prefixes.frozen,
            )
            for w in members.prefill_workers
            if w.spec.serves(model)
        )
        decode = tuple(
            DecodeView(
                worker_id=w.spec.id,
                layout=w.spec.layout,
                capacity_blocks=w.capacity_blocks,
                reserved_blocks=max(
                    0, w.reserved_blocks + w.pending_blocks - freeing.get(w.spec.id, 0)
                ),
                used_blocks=self._used_blocks(w),
                resident_seqs=max(w.resident_seqs, (self._fresh_load(w) or _NO_LOAD).running),
                healthy=w.available and w.spec.id not in avoid,
                group=w.spec.group,
                step_base_s=w.spec.perf.step_base_s if w.spec.perf else 0.005,
                step_s_per_block=w.spec.perf.step_s_per_block if w.spec.perf else 0.0,
                can_prefill=members.can_prefill_locally(w),
                prefill_tokens_per_s=(
                    w.spec.perf.prefill_tokens_per_s() if w.spec.perf else 10_000.0
                ),
                queued_prompt_tokens=w.queued_prompt_tokens,
            )
            for w in members.decode_workers
            if w.spec.serves(model)
        )
        return ClusterView(
            prefill=prefill, decode=decode, kv_bytes_per_token=self._settings.kv_bytes_per_token
        )
