"""The pools as placement policies see them: a `ClusterView` snapshot of the membership.

Each view carries this replica's accounting (queued prompt tokens, reserved and pending
blocks, stranded KV; router/workers/accounting.py) and, when fresh, the worker's own load
report (router/workers/load_poller.py): stale reports are not trusted, least of all as idle.

A worker whose KV events are applied (router/workers/kv_events.py) gets the exact cached prefix
of the request (`cached_prefix_tokens`: its index's run of the prompt's leading blocks); the
others get None, and placement falls back to the estimated affinity (`recent_prefixes`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, Protocol

from policies.base import ClusterView, DecodeView, PrefillView
from policies.loras import lora_root
from policies.token_blocks import block_hashes
from router.config import Settings
from router.workers.discovery import LoadSnapshot
from router.workers.kv_index import KvIndex
from router.workers.loras import LoraBook
from router.workers.membership import Membership
from router.workers.worker_state import WorkerState

__all__ = ["PlacementView"]

_NO_LOAD = LoadSnapshot(running=0, waiting=0, kv_usage=None, num_gpu_blocks=None, at=0.0)


class KvIndexes(Protocol):
    """Where a worker's KV index is (router/workers/kv_events.py KvEventHub)."""

    def index_of(self, worker_id: str) -> KvIndex | None: ...

    def describe(self, worker_id: str) -> dict[str, Any]: ...


class _PromptBlocks:
    """One request's prompt named in blocks, per block size, computed once per size."""

    __slots__ = ("_tokens", "_by_size")

    def __init__(self, tokens: Sequence[int]) -> None:
        self._tokens = tokens
        self._by_size: dict[tuple[int, str], tuple[int, ...]] = {}

    def cached_tokens(
        self, index: KvIndex | None, fallback_block_size: int, lora: str = ""
    ) -> int | None:
        """Under LoRA adapter `lora` the blocks are named in its own space (policies/loras.py):
        a base-model or another adapter's prefix is no hit."""
        if index is None:
            return None
        size = index.block_size or fallback_block_size
        hashes = self._by_size.get((size, lora))
        if hashes is None:
            hashes = self._by_size[(size, lora)] = block_hashes(self._tokens, size, lora_root(lora))
        return index.cached_prefix_blocks(hashes) * size


class PlacementView:
    def __init__(
        self, members: Membership, settings: Settings, kv_indexes: KvIndexes | None = None
    ) -> None:
        self._members = members
        self._settings = settings
        self._kv = kv_indexes
        # Which workers hold or may load each LoRA adapter (router/workers/loras.py).
        self.loras = LoraBook(settings)
        # The last request's blocks: its snapshots (a retry, the forecast) reuse them.
        self._last_prompt: _PromptBlocks | None = None
        self._last_tokens: Sequence[int] | None = None

    def _prompt_blocks(self, tokens: Sequence[int] | None) -> _PromptBlocks | None:
        if tokens is None or self._kv is None:
            return None
        if tokens is not self._last_tokens:
            self._last_tokens, self._last_prompt = tokens, _PromptBlocks(tokens)
        return self._last_prompt

    def prefix_cache(self, worker_id: str) -> dict[str, Any]:
        """What placement knows of the worker's prefix cache: `source` "events" (from its KV
        events: exact) or "estimated" (from the prompts this replica sent it), and the state of
        its event stream (None: it has no `kv_events` entry)."""
        if self._kv is None:
            return {"source": "estimated", "kv_events": None}
        return self._kv.describe(worker_id)

    def kv_index(self, worker_id: str) -> KvIndex | None:
        """The worker's index of its cached blocks, from its KV events; None: estimated."""
        return None if self._kv is None else self._kv.index_of(worker_id)

    def __repr__(self) -> str:
        return f"PlacementView({len(self._members.workers)} workers)"

    def _lora_costs(self, lora: str) -> dict[str, float]:
        """Worker id -> seconds before it can serve adapter `lora`, for the workers that hold it
        or may load it (none for \"\": no adapter)."""
        if not lora:
            return {}
        out: dict[str, float] = {}
        for w in self._members.workers.values():
            cost = self.loras.load_cost_s(w.spec, lora)
            if cost is not None:
                out[w.spec.id] = cost
        return out

    def _fresh_load(self, w: WorkerState) -> LoadSnapshot | None:
        if w.load is None or w.load.stale(time.monotonic(), self._settings.loops.load_max_age_s):
            return None  # stale data is not trusted, least of all as "idle"
        return w.load

    def _used_blocks(self, w: WorkerState) -> int:
        load = self._fresh_load(w)
        return 0 if load is None else w.used_blocks(load)

    def snapshot(
        self,
        avoid: frozenset[str] = frozenset(),
        model: str = "",
        freeing: dict[str, int] | None = None,
        prompt_token_ids: Sequence[int] | None = None,
        lora: str = "",
    ) -> ClusterView:
        """The workers serving `model` (all when empty); `avoid` = workers that already failed
        this request; `freeing` = blocks per decode worker forecast to be free by the time the
        prefill ends (prediction-based admission); `prompt_token_ids` = the request's prompt,
        for the exact cached prefix of each worker with KV events (None: not known); `lora` =
        the request's LoRA adapter: only workers that hold it or may load it, with the load's
        time (`lora_load_s`), never one that can do neither (docs/lora.md)."""
        freeing = freeing or {}
        members = self._members
        blocks = self._prompt_blocks(prompt_token_ids)
        load_s = self._lora_costs(lora)

        def cached(w: WorkerState) -> int | None:
            if blocks is None or self._kv is None:
                return None
            index = self._kv.index_of(w.spec.id)
            return blocks.cached_tokens(index, w.spec.layout.block_size, lora)

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
                cached_prefix_tokens=cached(w),
                lora_load_s=load_s.get(w.spec.id, 0.0),
            )
            for w in members.prefill_workers
            if w.spec.serves(model) and (not lora or w.spec.id in load_s)
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
                cached_prefix_tokens=cached(w),
                lora_load_s=load_s.get(w.spec.id, 0.0),
            )
            for w in members.decode_workers
            if w.spec.serves(model) and (not lora or w.spec.id in load_s)
        )
        return ClusterView(
            prefill=prefill, decode=decode, kv_bytes_per_token=self._settings.kv_bytes_per_token
        )
