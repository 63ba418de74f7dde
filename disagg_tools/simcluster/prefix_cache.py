"""An exact prefix cache per simulated worker, and the router's event-fed index of it.

Blocks are named as the trace names them (Mooncake's hash ids; the multi-turn workload's chained
ids, `disagg_tools.traces.multi_turn`), each `ClusterConfig.prefix_block_tokens` long. The cache
follows the event model of a real engine (vLLM's KV events, docs/design.md §9): a block is
*stored* when the worker prefills it or receives it over the link, and *removed* when the worker
needs room, least recently used first. A hit is the leading run of a prompt's blocks.

`KVIndex` is what the router knows: a copy of one worker's block set, changed only by the events
the cache publishes, delivered after `ClusterConfig.kv_event_lag_s`. With no lag it equals the
cache at every placement (checked under `ClusterConfig.check_views`).

The cache is its own pool of blocks, beside the KV the running sequences hold (a GPU-sized
one models the free HBM vLLM keeps cached blocks in; a large one, an offloaded CPU tier).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence

from policies.token_blocks import cached_prefix_blocks

__all__ = ["PrefixCache", "KVIndex", "CacheEvent"]

# ("stored" | "removed", block ids), as a worker publishes them.
CacheEvent = tuple[str, tuple[int, ...]]


class PrefixCache:
    """One worker's cached blocks, LRU-evicted at `capacity_blocks`; publishes its changes."""

    __slots__ = ("capacity", "_lru", "_publish")

    def __init__(
        self, capacity_blocks: int, publish: Callable[[CacheEvent], None] | None = None
    ) -> None:
        if capacity_blocks < 0:
            raise ValueError(f"capacity_blocks must be >= 0, got {capacity_blocks}")
        self.capacity = capacity_blocks
        self._lru: OrderedDict[int, None] = OrderedDict()
        self._publish = publish

    def __len__(self) -> int:
        return len(self._lru)

    def blocks(self) -> frozenset[int]:
        return frozenset(self._lru)

    def hit_blocks(self, hashes: Sequence[int]) -> int:
        """The prompt's leading blocks held now (a lookup: nothing is touched)."""
        return cached_prefix_blocks(hashes, self._lru)

    def store(self, hashes: Sequence[int]) -> None:
        """The worker holds these blocks now (prefilled or received): new ones are stored, held
        ones touched, and the least recently used evicted past capacity.

        Touched last block first, as vLLM frees a request's blocks, so a prefix's head is the
        most recently used and evicted last: a chain loses its tail before its head.
        """
        if self.capacity <= 0 or not hashes:
            return
        lru = self._lru
        wanted = list(dict.fromkeys(hashes))[: self.capacity]
        new = tuple(h for h in wanted if h not in lru)
        for h in reversed(wanted):
            lru[h] = None
            lru.move_to_end(h)
        removed: list[int] = []
        while len(lru) > self.capacity:
            removed.append(lru.popitem(last=False)[0])
        if self._publish is not None:
            # Removed before stored, as an engine frees room before it writes the new blocks.
            if removed:
                self._publish(("removed", tuple(removed)))
            if new:
                self._publish(("stored", new))


class KVIndex:
    """The router's view of one worker's cache, built only from the events it published."""

    __slots__ = ("_held",)

    def __init__(self) -> None:
        self._held: set[int] = set()

    def apply(self, event: CacheEvent) -> None:
        kind, hashes = event
        if kind == "stored":
            self._held.update(hashes)
        elif kind == "removed":
            self._held.difference_update(hashes)
        else:
            raise ValueError(f"unknown cache event {kind!r}")

    def hit_blocks(self, hashes: Sequence[int]) -> int:
        return cached_prefix_blocks(hashes, self._held)

    def blocks(self) -> frozenset[int]:
        return frozenset(self._held)

    @classmethod
    def replay(cls, events: Iterable[CacheEvent]) -> KVIndex:
        index = cls()
        for event in events:
            index.apply(event)
        return index
