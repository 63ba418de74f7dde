"""The router's own name for a run of prompt tokens: a chained hash of full token blocks.

Block `i`'s hash covers its tokens and the hash of block `i - 1`, so equal hashes mean equal
prefixes up to and including that block, whatever the engine's own hash seed (vLLM salts its
block hashes per process). The KV-event index of each worker (router/workers/), the request's
prefix (router/), and the simulator's caches (disagg_tools/simcluster/) all name blocks this
way, so a request's blocks are looked up in a worker's index by equality alone.

Only full blocks are named: an engine caches (and reports) full blocks only.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Container, Sequence

__all__ = ["ROOT_HASH", "block_hashes", "cached_prefix_blocks"]

# The parent of the first block.
ROOT_HASH = 0

_PACK = struct.Struct("<q")


def block_hashes(
    token_ids: Sequence[int], block_size: int, parent: int = ROOT_HASH
) -> tuple[int, ...]:
    """The chained hashes of the full blocks of `token_ids` (a trailing partial block has
    none), starting from `parent` (a block's hash chains the previous block's)."""
    if block_size <= 0:
        raise ValueError(f"block_size must be > 0, got {block_size}")
    out: list[int] = []
    full = len(token_ids) - len(token_ids) % block_size
    # Packed once (an 8k-token prompt is named on the request path): each block is a slice.
    packed = memoryview(struct.pack(f"<{full}I", *token_ids[:full]))
    step = 4 * block_size
    for start in range(0, 4 * full, step):
        h = hashlib.blake2b(_PACK.pack(parent), digest_size=8)
        h.update(packed[start : start + step])
        parent = int.from_bytes(h.digest(), "little", signed=True)
        out.append(parent)
    return tuple(out)


def cached_prefix_blocks(hashes: Sequence[int], held: Container[int]) -> int:
    """How many of the request's leading blocks a worker holds: the length of the run of
    `hashes` from the start that are all in `held` (a prefix cache serves a prefix only)."""
    n = 0
    for h in hashes:
        if h not in held:
            break
        n += 1
    return n
