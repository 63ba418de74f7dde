"""One worker's prefix cache as its KV events tell it: the blocks it holds, by the router's name.

The engine names a block by its own hash (vLLM salts it per process, and folds in LoRA names,
cache salts, multimodal keys); the router names it by `policies.token_blocks.block_hashes` of the
block's token ids chained from its parent's router hash. A `BlockStored` event carries the token
ids and the parent's engine hash, so the index keeps:

    _router_of: engine hash -> router hash   (to chain a child from its parent, and to remove)
    _held:      router hash -> engine blocks  (how many engine blocks carry that router name)

`_held` counts because two engine blocks can carry the same tokens (a LoRA, a cache salt, an
engine that caches a duplicate block): the router name stays held until the last goes. A store
for an engine hash already indexed counts once more (`_copies`, sparse), so each removal undoes
one store.

A block whose parent the index does not know (its store came before the index began, or was in a
batch lost for good) cannot be named: it is skipped and counted (`unchained`). The index is then
a subset of the worker's cache, never a superset, and converges as old blocks are evicted and
stored again.

Memory: bounded by `max_blocks` (an engine holds at most its KV capacity in blocks; a stream
that claims more is wrong and the index is dropped: `overflowed`). Measured by
tests/test_kv_events.py::test_index_memory_per_block (docs/kv-events.md): 155 bytes per block
held at 1 M blocks (148 MiB: the two tables and the ints they hold), so the 4 M default cap is
at most ~620 MB per worker, and a worker of 100 k blocks costs ~16 MB per router replica.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

from policies.token_blocks import ROOT_HASH, block_hashes, cached_prefix_blocks

__all__ = ["EngineHash", "KvIndex"]

# vLLM's ExternalBlockHash: an int (older releases, up to 2**64) or bytes (newer): either is
# only compared, never computed, here.
EngineHash = Hashable


class KvIndex:
    """The blocks one worker holds, named by the router's chained hash of their tokens."""

    __slots__ = (
        "block_size",
        "max_blocks",
        "unchained",
        "overflowed",
        "_router_of",
        "_held",
        "_copies",
    )

    def __init__(self, max_blocks: int = 4_000_000) -> None:
        self.block_size: int | None = None  # learned from the first BlockStored
        self.max_blocks = max_blocks
        self.unchained = 0  # blocks skipped: their parent was not known
        self.overflowed = False  # the stream claimed more than max_blocks: dropped
        self._router_of: dict[EngineHash, int] = {}
        self._held: dict[int, int] = {}
        self._copies: dict[EngineHash, int] = {}

    def __repr__(self) -> str:
        return f"KvIndex(blocks={len(self._router_of)}, block_size={self.block_size})"

    def __len__(self) -> int:
        """Engine blocks indexed."""
        return len(self._router_of)

    @property
    def router_hashes(self) -> frozenset[int]:
        """Every router name held (for tests and the admin view; a copy)."""
        return frozenset(self._held)

    def clear(self) -> None:
        """AllBlocksCleared, a publisher restart, or a drop: nothing is known to be held."""
        self._router_of.clear()
        self._held.clear()
        self._copies.clear()
        self.unchained = 0
        self.overflowed = False

    def store(
        self,
        engine_hashes: Sequence[EngineHash],
        parent: EngineHash | None,
        token_ids: Sequence[int],
        block_size: int,
    ) -> int:
        """A BlockStored: `engine_hashes[i]` holds `token_ids[i*bs:(i+1)*bs]`, chained from
        `parent` (None: the first block of a prompt). Returns how many blocks were indexed."""
        if block_size <= 0 or len(token_ids) < len(engine_hashes) * block_size:
            raise ValueError(
                f"BlockStored: {len(engine_hashes)} blocks of {block_size} tokens, "
                f"{len(token_ids)} token ids"
            )
        if self.block_size is None:
            self.block_size = block_size
        elif block_size != self.block_size:
            raise ValueError(f"BlockStored: block size {block_size}, not {self.block_size}")
        if parent is None:
            router_parent = ROOT_HASH
        elif parent in self._router_of:
            router_parent = self._router_of[parent]
        else:
            self.unchained += len(engine_hashes)
            return 0
        named = block_hashes(
            token_ids[: len(engine_hashes) * block_size], block_size, router_parent
        )
        for engine, router in zip(engine_hashes, named, strict=True):
            if engine in self._router_of:
                self._copies[engine] = self._copies.get(engine, 1) + 1
                continue
            self._router_of[engine] = router
            self._held[router] = self._held.get(router, 0) + 1
        if len(self._router_of) > self.max_blocks:
            self.clear()
            self.overflowed = True
        return len(named)

    def remove(self, engine_hashes: Sequence[EngineHash]) -> None:
        """A BlockRemoved: an unknown hash (stored before the index began) is ignored."""
        for engine in engine_hashes:
            copies = self._copies.get(engine)
            if copies is not None:
                if copies <= 2:
                    del self._copies[engine]
                else:
                    self._copies[engine] = copies - 1
                continue
            router = self._router_of.pop(engine, None)
            if router is None:
                continue
            left = self._held[router] - 1
            if left:
                self._held[router] = left
            else:
                del self._held[router]

    def cached_prefix_blocks(self, hashes: Sequence[int]) -> int:
        """How many of a request's leading blocks (router hashes, this index's block size) the
        worker holds: a prefix cache serves a prefix only."""
        return cached_prefix_blocks(hashes, self._held)
