"""Prefix caches on both pools, and what the router is told of them (`ClusterConfig.affinity`).

Every worker, prefill and decode, holds an exact `PrefixCache` of `prefix_cache_blocks` blocks:
P stores a prompt's blocks when it prefills them, D when it receives them or prefills them
locally. What the physical caches do is the same in every mode, so the modes differ only in what
the placement policy sees (equal load, equal hardware):

    exact          both views' `cached_prefix_tokens`, from the router's event-fed `KVIndex`
    exact_prefill  the prefill views' only, as the peers' KV-event routers do
    estimated      today's hint: `recent_prefixes`, the blocks the router last sent each P
                   (bounded like the live router's `RecentPrefixes`), weighed by the policy
    none           nothing
    oracle         both views read straight from the caches (no event lag)

The engine (`disagg_tools.simcluster.engine`) calls the hooks below at the events they name.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from functools import partial
from typing import TYPE_CHECKING

from disagg_tools.simcluster.prefix_cache import CacheEvent, KVIndex, PrefixCache
from policies.base import DecodeView, PrefillView

if TYPE_CHECKING:
    from disagg_tools.simcluster.config import ClusterConfig
    from disagg_tools.simcluster.workers import Job

__all__ = ["PrefixFacts", "ROUTER_RECENT_LIMIT"]

# The live router's per-worker record of recently sent prefix hashes (RecentPrefixes' limit).
ROUTER_RECENT_LIMIT = 1024


class PrefixFacts:
    """The caches of one run, the router's index of them, and the counters they feed."""

    def __init__(
        self,
        cfg: ClusterConfig,
        worker_ids: list[str],
        push: Callable[[float, Callable[[], None]], None],
        now: Callable[[], float],
    ) -> None:
        assert cfg.affinity is not None
        self.mode = cfg.affinity
        self.block_tokens = cfg.prefix_block_tokens
        self.lag = cfg.kv_event_lag_s
        self.check = cfg.check_views
        self._push = push
        self._now = now
        self.index = {w: KVIndex() for w in worker_ids}
        # Every event each worker published, in order: a test replays them against the cache.
        self.log: dict[str, list[CacheEvent]] = {w: [] for w in worker_ids}
        self.caches = {
            w: PrefixCache(cfg.prefix_cache_blocks, partial(self._publish, w)) for w in worker_ids
        }
        self.recent: dict[str, dict[int, None]] = {w: {} for w in worker_ids}
        self._recent_frozen: dict[str, frozenset[int]] = {}
        self.hit_tokens = 0
        self.prompt_tokens = 0
        self.kv_bytes_moved = 0
        self.checks = 0
        self.evicted_blocks = 0

    # -- the event model ----------------------------------------------------------------------
    def _publish(self, wid: str, event: CacheEvent) -> None:
        if self.check:
            self.log[wid].append(event)
        if event[0] == "removed":
            self.evicted_blocks += len(event[1])
        index = self.index[wid]
        if self.lag <= 0:
            index.apply(event)
        else:
            self._push(self._now() + self.lag, partial(index.apply, event))

    def _tokens(self, hits: int, prompt: int) -> int:
        return min(hits * self.block_tokens, prompt)

    def prefill_hit(self, wid: str, job: Job) -> int:
        """P starts the job's prefill: the tokens its cache spares (the last one is always
        computed, it yields the logits)."""
        cached = min(
            self._tokens(self.caches[wid].hit_blocks(job.hashes), job.prompt), job.prompt - 1
        )
        self.hit_tokens += cached
        self.prompt_tokens += job.prompt
        return cached

    def stored(self, wid: str, job: Job) -> None:
        """A worker holds the job's prompt blocks now (prefilled, or received over the link)."""
        self.caches[wid].store(job.hashes)

    def moved_bytes(self, wid: str, job: Job, kv_bytes_per_token: int) -> int:
        """KV bytes the decode worker pulls: only the blocks its own cache misses (vLLM's NIXL
        consumer, docs/design.md §9)."""
        held = self._tokens(self.caches[wid].hit_blocks(job.hashes), job.prompt)
        moved = max(1, job.prompt - held) * kv_bytes_per_token
        self.kv_bytes_moved += moved
        return moved

    def local_hit(self, wid: str, job: Job) -> int:
        """D prefills the job itself (conditional disaggregation, or a preemption's recompute):
        the tokens its cache spares; it holds the prompt's blocks afterwards."""
        cached = self._tokens(self.caches[wid].hit_blocks(job.hashes), job.ctx0 - 1)
        if job.gen == 0 and job.preemptions == 0:  # a first prefill, not a recompute
            self.hit_tokens += cached
            self.prompt_tokens += job.prompt
        self.caches[wid].store(job.hashes)
        return cached

    def routed(self, wid: str, job: Job) -> None:
        """The router sent the job to prefill worker `wid`: its record for the estimate."""
        if not job.hashes:
            return
        order = self.recent[wid]
        for h in job.hashes:
            order.pop(h, None)
            order[h] = None
        while len(order) > ROUTER_RECENT_LIMIT:
            del order[next(iter(order))]
        self._recent_frozen.pop(wid, None)

    # -- what the policy sees -----------------------------------------------------------------
    def decorate(
        self, prefill: tuple[PrefillView, ...], decode: tuple[DecodeView, ...], job: Job
    ) -> tuple[tuple[PrefillView, ...], tuple[DecodeView, ...]]:
        """The views of the snapshot for this job, with what the mode tells the router."""
        mode = self.mode
        if mode == "none":
            return prefill, decode
        if mode == "estimated":
            return tuple(
                replace(v, recent_prefixes=self._recent_of(v.worker_id)) for v in prefill
            ), decode
        if self.check:
            self._check_index()
        known = self.caches if mode == "oracle" else self.index
        hashes, prompt = job.hashes, job.prompt
        prefill = tuple(
            replace(
                v, cached_prefix_tokens=self._tokens(known[v.worker_id].hit_blocks(hashes), prompt)
            )
            for v in prefill
        )
        if mode != "exact_prefill":
            decode = tuple(
                replace(
                    v,
                    cached_prefix_tokens=self._tokens(
                        known[v.worker_id].hit_blocks(hashes), prompt
                    ),
                )
                for v in decode
            )
        return prefill, decode

    def _recent_of(self, wid: str) -> frozenset[int]:
        frozen = self._recent_frozen.get(wid)
        if frozen is None:
            frozen = self._recent_frozen[wid] = frozenset(self.recent[wid])
        return frozen

    def _check_index(self) -> None:
        """Debug (`ClusterConfig.check_views`): with no event lag the router's index is the
        cache, block for block, at every placement."""
        if self.lag > 0:
            return
        for wid, cache in self.caches.items():
            if self.index[wid].blocks() != cache.blocks():
                raise AssertionError(f"{wid}: the router's KV index differs from the cache")
        self.checks += 1

    def _check_replay(self) -> None:
        """Debug, at the end of a run (every lagged event delivered): replaying each worker's
        events gives its cache, and so does the router's index."""
        for wid, cache in self.caches.items():
            held = cache.blocks()
            if KVIndex.replay(self.log[wid]).blocks() != held or self.index[wid].blocks() != held:
                raise AssertionError(f"{wid}: its KV events do not replay to its cache")
            self.checks += 1

    def counters(self) -> dict[str, float]:
        if self.check:
            self._check_replay()
        rate = self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0
        return {
            "prefix_hit_tokens": self.hit_tokens,
            "prefix_prompt_tokens": self.prompt_tokens,
            "prefix_hit_rate": rate,
            "kv_bytes_moved": self.kv_bytes_moved,
            "prefix_evicted_blocks": self.evicted_blocks,
            "view_checks": self.checks,
        }
