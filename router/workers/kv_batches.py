"""One worker's KV-event batches into its index, within the limits, sharing the event loop.

    payload ── over MAX_BATCH_BYTES? refused ──> decode (one call up to 64 KiB, else in steps;
    over MAX_BATCH_BLOCKS: refused) ──> each event: store (128 blocks a step, the index's bound
    read per event: past it, dropped and the rest refused), remove (4,096 a step), clear ──>
    the batch's lists emptied in slices ──> a dropped index's tables freed in slices

`apply` returns why the index must be dropped (None: applied); the subscriber
(router/workers/kv_events.py) drops it and keeps its sequence state. The limits and the loop's
turns: router/workers/kv_limits.py.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from router.metrics import RouterMetrics
from router.workers.kv_index import KvIndex
from router.workers.kv_limits import (
    BULK_DECODE_BYTES,
    FREE_SLICE,
    REMOVE_SLICE,
    LoopTurns,
    Refusals,
)
from router.workers.kv_wire import (
    AllBlocksCleared,
    BatchRefused,
    BlockRemoved,
    BlockStored,
    DecodedBatch,
    WireError,
    decode_batch,
    decode_batch_steps,
)

__all__ = ["BatchApplier"]

log = logging.getLogger("router.workers.kv_events")


class BatchApplier:
    """Batches into one worker's index; `applied` counts those taken."""

    __slots__ = (
        "worker_id",
        "index",
        "applied",
        "_metrics",
        "_refusals",
        "_bound",
        "_max_batch_bytes",
        "_max_batch_blocks",
        "_turns",
        "rank",
        "foreign_rank",
    )

    def __init__(
        self,
        worker_id: str,
        index: KvIndex,
        metrics: RouterMetrics,
        refusals: Refusals,
        bound: Callable[[int | None], int],
        *,
        max_batch_bytes: int,
        max_batch_blocks: int,
        rank: int | None = None,
    ) -> None:
        self.worker_id = worker_id
        # The data-parallel rank whose publisher this is (None: a worker without ranks, whose
        # batches may say 0): a batch naming another rank is ignored and counted in
        # `foreign_rank`, never applied to this rank's index (router/workers/dp_ranks.py).
        self.rank = rank
        self.foreign_rank = 0
        self.index = index
        self.applied = 0
        self._metrics = metrics
        self._refusals = refusals
        self._bound = bound
        self._max_batch_bytes = max_batch_bytes
        self._max_batch_blocks = max_batch_blocks
        self._turns = LoopTurns()

    def __repr__(self) -> str:
        return f"BatchApplier({self.worker_id}, applied={self.applied}, {self.index})"

    async def _decode(self, payload: bytes) -> DecodedBatch:
        if len(payload) > self._max_batch_bytes:
            raise BatchRefused(
                "batch_bytes", f"{len(payload)} bytes, more than {self._max_batch_bytes}"
            )
        if len(payload) <= BULK_DECODE_BYTES:
            return decode_batch(payload, self._max_batch_blocks)
        return await self._turns.drive(decode_batch_steps(payload, self._max_batch_blocks))

    async def apply(self, payload: bytes) -> str | None:
        """One batch; the reason to drop the index (what it said is lost or false), or None."""
        await self._turns.turn()  # at least one a batch: a store of a few blocks has none
        m, wid = self._metrics, self.worker_id
        try:
            batch = await self._decode(payload)
        except WireError as exc:
            m.kv_events_malformed.labels(worker=wid).inc()
            log.warning("worker %s: a KV-event batch that does not decode: %s", wid, exc)
            return "malformed"
        except BatchRefused as exc:
            self._refusals.refuse(exc.reason, str(exc))
            return "refused"
        said = batch.data_parallel_rank
        if said is not None and said != (self.rank or 0):
            self.foreign_rank += 1
            if self.foreign_rank == 1:  # once: a misconfigured engine says it every batch
                log.warning(
                    "worker %s: a KV-event batch of data-parallel rank %s on the publisher of "
                    "rank %s: ignored (counted in its prefix_cache.kv_events.foreign_rank)",
                    wid, said, self.rank or 0,
                )  # fmt: skip
            return None
        self.applied += 1
        m.kv_events_batches.labels(worker=wid).inc()
        dropped = await self._events(batch)
        m.kv_events_index_blocks.labels(worker=wid).set(len(self.index))
        await self._free(batch)
        return dropped

    async def _events(self, batch: DecodedBatch) -> str | None:
        index, m, wid = self.index, self._metrics, self.worker_id
        for event in batch.events:
            try:
                if isinstance(event, BlockStored):
                    index.max_blocks = self._bound(index.block_size or event.block_size)
                    await self._turns.drive(
                        index.store_steps(
                            event.block_hashes,
                            event.parent_block_hash,
                            event.token_ids,
                            event.block_size,
                            event.lora,
                        )
                    )
                    if index.overflowed:
                        held = f"more than {index.max_blocks} blocks held"
                        self._refusals.refuse("capacity", held)
                        return "overflow"  # and the rest of a batch that claims too much
                elif isinstance(event, BlockRemoved):
                    hashes = event.block_hashes
                    for lo in range(0, len(hashes), REMOVE_SLICE):
                        index.remove(hashes[lo : lo + REMOVE_SLICE])
                        await self._turns.turn()
                elif isinstance(event, AllBlocksCleared):
                    index.clear()
                    m.kv_events_index_drops.labels(worker=wid, reason="cleared").inc()
            except ValueError as exc:
                m.kv_events_malformed.labels(worker=wid).inc()
                log.warning("worker %s: a KV event the index refuses: %s", wid, exc)
        return None

    async def _free(self, batch: DecodedBatch) -> None:
        """Empty a large batch's lists a slice at a time: freed at once when the batch goes,
        a 300,000-block batch's 4.8 M token ids hold the loop ~60 ms."""
        for event in batch.events:
            if isinstance(event, AllBlocksCleared):
                continue
            lists = [event.block_hashes]
            if isinstance(event, BlockStored):
                lists.append(event.token_ids)
            for values in lists:
                while isinstance(values, list) and len(values) > FREE_SLICE:
                    del values[-FREE_SLICE:]
                    await self._turns.turn()

    async def release(self) -> None:
        """Free a dropped index's tables, a slice between two turns of the loop."""
        if self.index.retired:
            await self._turns.drive(self.index.release_steps())
