"""One worker's prefix cache as its KV events tell it: the blocks it holds, by the router's name.

The engine names a block by its own hash (vLLM salts it per process, and folds in LoRA names,
cache salts, multimodal keys); the router names it by `policies.token_blocks.block_hashes` of the
block's token ids chained from its parent's router hash. A `BlockStored` event carries the token
ids and the parent's engine hash, so the index keeps:

    _router_of: engine hash -> router hash   (to chain a child from its parent, and to remove)
    _held:      router hash -> engine blocks  (how many engine blocks carry that router name)

`_held` counts because two engine blocks can carry the same tokens (a cache salt, an engine that
caches a duplicate block); blocks stored under a LoRA adapter (the event's `lora_name`) chain from
the adapter's own root (policies/loras.py), so they never share a name with the base model's
or another adapter's: the router name stays held until the last goes. A store
for an engine hash already indexed counts once more (`_copies`, sparse), so each removal undoes
one store.

A block whose parent the index does not know (its store came before the index began, or was in a
batch lost for good) cannot be named: it is skipped and counted (`unchained`). The index is then
a subset of the worker's cache, never a superset, and converges as old blocks are evicted and
stored again.

Memory: bounded by `max_blocks` (an engine holds at most its KV capacity in blocks; a stream
that claims more is wrong and the index is dropped: `overflowed`). The subscriber sets it per
worker from what the worker can hold (router/workers/kv_events.py: GPU + offload blocks, with a
slack); 4 M is only the ceiling. `clear` puts new tables in place; a large index's old ones are
retired, and `release_steps` frees them a slice at a time (freeing 1.5 M blocks at once holds
the loop ~40 ms) and then asks the C allocator to hand its free pages back (`malloc_trim`), so
RSS returns when an index is dropped. Measured by
tests/router/workers/test_kv_events.py::test_index_memory_per_block (docs/kv-events.md): 155 bytes
per block
held at 1 M blocks (148 MiB: the two tables and the ints they hold), so the 4 M default cap is
at most ~620 MB per worker, and a worker of 100 k blocks costs ~16 MB per router replica.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable, Generator, Hashable, Sequence

from policies.loras import lora_root
from policies.token_blocks import block_hashes, cached_prefix_blocks

__all__ = ["EngineHash", "KvIndex"]

# vLLM's ExternalBlockHash: an int (older releases, up to 2**64) or bytes (newer): either is
# only compared, never computed, here.
EngineHash = Hashable

STORE_SLICE = 128  # blocks named between two yields of `store_steps` (~1 ms: the hashing)
RELEASE_SLICE = 20_000  # retired entries freed between two yields of `release_steps` (~0.5 ms)
_RETIRE_FROM = 20_000  # a smaller index is freed at once when cleared


@functools.cache
def _malloc_trim_fn() -> Callable[[int], int] | None:
    try:
        trim: Callable[[int], int] = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to call
        return None
    return trim


def _malloc_trim() -> None:
    """glibc keeps freed heap pages for reuse; after a large index is gone, give them back
    (~1 ms after a 1.5 M-block index here)."""
    trim = _malloc_trim_fn()
    if trim is not None:
        trim(0)


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
        "_retired",
    )

    def __init__(self, max_blocks: int = 4_000_000) -> None:
        self.block_size: int | None = None  # learned from the first BlockStored
        self.max_blocks = max_blocks
        self.unchained = 0  # blocks skipped: their parent was not known
        self.overflowed = False  # the stream claimed more than max_blocks: dropped
        self._router_of: dict[EngineHash, int] = {}
        self._held: dict[int, int] = {}
        self._copies: dict[EngineHash, int] = {}
        self._retired: list[dict[Hashable, int]] = []  # cleared tables, to free in slices

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
        """AllBlocksCleared, a publisher restart, or a drop: nothing is known to be held.
        New tables rather than `dict.clear()`: the old ones go whole, and a large index's
        pages go back to the OS (`release_steps`)."""
        if len(self._router_of) >= _RETIRE_FROM:
            self._retired += [self._router_of, self._held, self._copies]  # type: ignore[list-item]
        self._router_of = {}
        self._held = {}
        self._copies = {}
        self.unchained = 0
        self.overflowed = False

    @property
    def retired(self) -> int:
        """Entries of cleared tables not freed yet."""
        return sum(len(t) for t in self._retired)

    def release_steps(self) -> Generator[None, None, None]:
        """Free the retired tables, `RELEASE_SLICE` entries between two yields, then hand the
        free pages back to the OS."""
        if not self._retired:
            return
        while self._retired:
            table = self._retired[-1]
            while table:
                for _ in range(min(len(table), RELEASE_SLICE)):
                    table.popitem()
                yield
            self._retired.pop()
        _malloc_trim()

    def release(self) -> None:
        """`release_steps` at once (off the event loop, or in tests)."""
        for _ in self.release_steps():
            pass

    def store(
        self,
        engine_hashes: Sequence[EngineHash],
        parent: EngineHash | None,
        token_ids: Sequence[int],
        block_size: int,
        lora: str | None = None,
    ) -> int:
        """A BlockStored: `engine_hashes[i]` holds `token_ids[i*bs:(i+1)*bs]`, chained from
        `parent` (None: the first block of a prompt, under LoRA adapter `lora`: its chain starts
        at the adapter's root, policies/loras.py). Returns how many blocks were indexed."""
        steps = self.store_steps(engine_hashes, parent, token_ids, block_size, lora)
        while True:
            try:
                next(steps)
            except StopIteration as done:
                return int(done.value)

    def store_steps(
        self,
        engine_hashes: Sequence[EngineHash],
        parent: EngineHash | None,
        token_ids: Sequence[int],
        block_size: int,
        lora: str | None = None,
    ) -> Generator[None, None, int]:
        """`store`, `STORE_SLICE` blocks at a time, yielding between slices (the caller lets
        the event loop run); each slice chains from the previous one's last router hash, so
        the names are those of one call. Stops at `max_blocks`: the index dropped,
        `overflowed`. Returns how many blocks were named."""
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
            router_parent = lora_root(lora)  # a chain under an adapter lives in its own space
        elif parent in self._router_of:
            router_parent = self._router_of[parent]
        else:
            self.unchained += len(engine_hashes)
            return 0
        named = 0
        for lo in range(0, len(engine_hashes), STORE_SLICE):
            if named:
                yield
            hi = lo + STORE_SLICE
            router_names = block_hashes(
                token_ids[lo * block_size : hi * block_size], block_size, router_parent
            )
            # Tables read each slice: a clear between two slices put new ones in place.
            router_of, held = self._router_of, self._held
            for engine, router in zip(engine_hashes[lo:hi], router_names, strict=True):
                if engine in router_of:
                    self._copies[engine] = self._copies.get(engine, 1) + 1
                    continue
                router_of[engine] = router
                held[router] = held.get(router, 0) + 1
            named += len(router_names)
            router_parent = router_names[-1]
            if len(router_of) > self.max_blocks:
                self.clear()
                self.overflowed = True
                return named
        return named

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
