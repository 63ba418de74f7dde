"""What one worker's KV events may cost a router replica, and how a batch shares the loop.

A worker's event socket is input like any other: a buggy or compromised engine can publish
anything on it. What it says costs each replica memory (the index: ~155 B a block,
router/workers/kv_index.py) and event-loop time (decoding, hashing: ~10 us a block), so:

- memory: a worker's index holds at most `capacity_bound` blocks (what the worker can hold,
  with a slack), and a batch at most `MAX_BATCH_BYTES` on the wire and `MAX_BATCH_BLOCKS`
  blocks; beyond, the batch is refused (`Refusals`: counted per worker and reason, logged at
  most once a `REFUSAL_LOG_S`) and the index dropped;
- time: a batch is decoded and applied in steps (kv_wire's `decode_batch_steps`, the index's
  `store_steps` and `release_steps`), and `LoopTurns` lets the loop run whenever a batch has
  held it for `TURN_S`, so other streams wait at most a few ms on any batch.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Generator
from typing import TypeVar

from router.metrics import RouterMetrics
from router.worker_spec import ConfigError
from router.workers.worker_state import WorkerState

__all__ = [
    "BULK_DECODE_BYTES",
    "FREE_SLICE",
    "MAX_BATCH_BLOCKS",
    "MAX_BATCH_BYTES",
    "MAX_INDEX_BLOCKS",
    "REMOVE_SLICE",
    "REPLAY_MAX_BYTES",
    "SUB_QUEUE",
    "WIRE_MAX_FACTOR",
    "LoopTurns",
    "Refusals",
    "capacity_bound",
]

log = logging.getLogger("router.workers.kv_events")

T = TypeVar("T")

# What a batch may be. An engine step stores at most its scheduled tokens' blocks (vLLM's
# max_num_batched_tokens: 2k-16k tokens, <= 1,024 blocks of 16, ~100 KB on the wire); these are
# 32 x that, and keep a batch's decoded lists under ~25 MB while it is applied.
MAX_BATCH_BYTES = 2 * 2**20
MAX_BATCH_BLOCKS = 32_768
MAX_INDEX_BLOCKS = 4_000_000  # the ceiling when a worker's capacity is not known (~620 MB)
BULK_DECODE_BYTES = 64 * 2**10  # up to here msgpack's one call (<= ~1 ms); larger: in steps
TURN_S = 0.002  # while a batch is applied, the loop gets a turn at least this often
REMOVE_SLICE = 4096  # removals between two turns
FREE_SLICE = 100_000  # list elements freed between two turns (~1 ms)
REFUSAL_LOG_S = 60.0
# What ZeroMQ may hold for a subscriber before a batch is read: SUB_QUEUE messages (an engine
# publishes one a step: ~0.5 s of them; past it the PUB drops and a replay fills the gap), none
# over WIRE_MAX_FACTOR x MAX_BATCH_BYTES (larger: the connection is dropped, by ZeroMQ, before
# it is buffered). A replay brings at most REPLAY_MAX_BYTES (vLLM keeps 10,000 batches).
SUB_QUEUE = 64
WIRE_MAX_FACTOR = 2
REPLAY_MAX_BYTES = 64 * 2**20


def capacity_bound(
    worker: WorkerState | None, engine_block_size: int | None, ceiling: int = MAX_INDEX_BLOCKS
) -> int:
    """The most blocks a worker's index may hold: (GPU + offload blocks) x slack, in the
    engine's blocks, at most `ceiling`. GPU blocks: what the engine reports (vLLM's
    `cache_config_info{num_gpu_blocks}`, in its own blocks), else its entry's `kv_blocks` or
    cost model (in the layout's blocks, converted once the events told the engine's size)."""
    if worker is None or worker.spec.kv_events is None:
        return ceiling
    load = worker.load
    gpu: int | None = load.num_gpu_blocks if load is not None else None
    if not gpu:
        try:
            configured = worker.spec.capacity_blocks
        except (ConfigError, ValueError, TypeError):  # a prefill without kv_blocks or perf
            return ceiling
        tokens = configured * worker.spec.layout.block_size
        gpu = -(-tokens // engine_block_size) if engine_block_size else configured
    kv = worker.spec.kv_events
    return min(ceiling, math.ceil((gpu + kv.offload_blocks) * kv.index_slack))


class LoopTurns:
    """The events' share of the loop: `turn` yields to the loop once they have held it for
    `TURN_S` since their last turn (a `sleep(0)` lets every ready callback run: the other
    streams' writes, the other workers' events). One deadline across batches: batches that
    are already queued come without a yield in between (an awaited ZeroMQ receive that is
    ready returns at once), so many small ones count as one large one."""

    __slots__ = ("_until",)

    def __init__(self) -> None:
        self._until = 0.0

    async def turn(self) -> None:
        if time.perf_counter() >= self._until:
            await asyncio.sleep(0)
            self._until = time.perf_counter() + TURN_S

    async def drive(self, steps: Generator[None, None, T]) -> T:
        """A step generator (the decoder, a store, a release) to its end, with turns for the
        loop between its steps; its return value."""
        while True:
            try:
                next(steps)
            except StopIteration as done:
                return done.value  # type: ignore[no-any-return]
            await self.turn()


class Refusals:
    """A worker's refused batches: each counted (`kv_events_refused_total{worker, reason}`),
    a warning at most once a `REFUSAL_LOG_S` (a flood is thousands of batches a second)."""

    __slots__ = ("_worker_id", "_metrics", "_logged_at", "_unlogged")

    def __init__(self, worker_id: str, metrics: RouterMetrics) -> None:
        self._worker_id = worker_id
        self._metrics = metrics
        self._logged_at = -math.inf
        self._unlogged = 0

    def refuse(self, reason: str, detail: str) -> None:
        self._metrics.kv_events_refused.labels(worker=self._worker_id, reason=reason).inc()
        self._unlogged += 1
        now = time.monotonic()
        if now - self._logged_at >= REFUSAL_LOG_S:
            log.warning(
                "worker %s: KV events refused (%s: %s), its index dropped; %d refused since "
                "the last such message",
                self._worker_id,
                reason,
                detail,
                self._unlogged,
            )
            self._logged_at = now
            self._unlogged = 0
