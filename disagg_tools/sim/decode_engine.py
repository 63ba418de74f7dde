"""The simulated GPU: a KV block pool, the prefill queue, the KV lease ledger, the decode batch.

    prefill request ─> PrefillQueue (FIFO, one at a time) ─> KvLedger entry (leased blocks)
                                                                 │ POST /sim/kv/pull
    decode request ─> blocks for prompt+1 ─> DecodeEngine batch <┘ (or local prefill)
                                             one loop, every step every resident sequence
                                             advances one token; step time from the cost model

Durations come from `policies.costmodel.PerfModel`, multiplied by `time_factor()`
(slow_factor / time_scale, read on every use so a fault config change applies at once).
Nothing here knows about HTTP.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from policies.base import blocks_for
from policies.costmodel import PerfModel

from .sim_metrics import SimMetrics

__all__ = ["BlockPool", "Sequence", "DecodeEngine", "PrefillQueue", "KvEntry", "KvLedger"]

Token = tuple[str, str | None]  # (text, finish_reason on the last token)


class BlockPool:
    """Fixed-size KV cache in blocks; real block ids, so handoffs can name them."""

    def __init__(self, capacity: int, on_free: Callable[[], None] | None = None) -> None:
        self.capacity = capacity
        self._free = list(range(capacity - 1, -1, -1))  # pop() hands out low ids first
        self.on_free = on_free

    @property
    def free(self) -> int:
        return len(self._free)

    @property
    def used(self) -> int:
        return self.capacity - len(self._free)

    def take(self, n: int) -> list[int] | None:
        """n blocks, or None (and nothing taken) if fewer are free."""
        if n > len(self._free):
            return None
        return [self._free.pop() for _ in range(n)]

    def give(self, blocks: list[int]) -> None:
        if not blocks:
            return
        self._free.extend(blocks)
        blocks.clear()  # the owner's list is emptied, so a second give frees nothing twice
        if self.on_free is not None:
            self.on_free()

    def __repr__(self) -> str:
        return f"BlockPool(used={self.used}/{self.capacity})"


class Sequence:
    """One request resident in the decode batch; tokens reach the handler through `out`."""

    __slots__ = (
        "request_id",
        "blocks",
        "kv_tokens",
        "generated",
        "state",
        "stalled",
        "out",
        "_tokens",
    )

    def __init__(
        self, request_id: str, blocks: list[int], prompt_tokens: int, tokens: Iterator[Token]
    ) -> None:
        self.request_id = request_id
        self.blocks = blocks
        self.kv_tokens = prompt_tokens
        self.generated = 0
        self.state = "new"  # new | running | preempted | finished | aborted
        self.stalled = False
        self.out: asyncio.Queue[Token] = asyncio.Queue()
        self._tokens = tokens

    def __repr__(self) -> str:
        return (
            f"Sequence({self.request_id!r}, {self.state}, kv={self.kv_tokens}, "
            f"blocks={len(self.blocks)}, generated={self.generated})"
        )


class DecodeEngine:
    """Continuous batching: one loop per worker advances every running sequence per step."""

    def __init__(
        self,
        perf: PerfModel,
        pool: BlockPool,
        metrics: SimMetrics,
        time_factor: Callable[[], float],
        block_size: int,
    ) -> None:
        self.perf = perf
        self.pool = pool
        self.metrics = metrics
        self.time_factor = time_factor
        self.block_size = block_size
        self._running: dict[Sequence, None] = {}  # insertion-ordered set: oldest first
        self._preempted: deque[Sequence] = deque()
        self._wake = asyncio.Event()
        pool.on_free = self._wake.set

    @property
    def running(self) -> int:
        return len(self._running)

    @property
    def preempted(self) -> int:
        return len(self._preempted)

    def admission_blocks(self, prompt_tokens: int) -> int:
        return blocks_for(prompt_tokens + 1, self.block_size)

    def join(self, seq: Sequence) -> None:
        seq.state = "running"
        self._running[seq] = None
        self._wake.set()

    def abort(self, seq: Sequence) -> None:
        """Drop a sequence at once and free its blocks (vLLM's abort); idempotent."""
        if seq.state in ("finished", "aborted"):
            return
        self._running.pop(seq, None)
        if seq in self._preempted:
            self._preempted.remove(seq)
        seq.state = "aborted"
        self.pool.give(seq.blocks)

    async def run(self) -> None:
        while True:
            self._readmit()
            if not self._running:
                self._wake.clear()
                await self._wake.wait()
                continue
            kv = sum(s.kv_tokens for s in self._running)
            await asyncio.sleep(
                self.perf.decode_step_s(kv, len(self._running)) * self.time_factor()
            )
            self.step()

    def step(self) -> None:
        """Advance every running sequence by one token, or stall it when no block is free."""
        progressed = False
        for seq in list(self._running):
            if seq.kv_tokens >= len(seq.blocks) * self.block_size:
                more = self.pool.take(1)
                if more is None:
                    if not seq.stalled:
                        seq.stalled = True
                        self.metrics.inc("preemptions")
                    continue
                seq.blocks.extend(more)
            seq.stalled = False
            tok, finish = next(seq._tokens)
            seq.kv_tokens += 1
            seq.generated += 1
            progressed = True
            seq.out.put_nowait((tok, finish))
            self.metrics.inc("generation_tokens")
            if finish is not None:
                self._finish(seq, finish)
        if not progressed and self._running:
            self._unjam()

    def _finish(self, seq: Sequence, reason: str) -> None:
        self._running.pop(seq, None)
        seq.state = "finished"
        self.pool.give(seq.blocks)
        self.metrics.inc("request_success", label=reason)

    def _unjam(self) -> None:
        # Every sequence is stalled on a full cache. Like vLLM's recompute preemption, evict the
        # youngest so the others can grow; it re-enters when its KV fits again. A lone sequence
        # that fills the whole cache can never grow: end it as if max_model_len were reached.
        youngest = next(reversed(self._running))
        if len(self._running) == 1 and self.pool.used == len(youngest.blocks):
            self._running.pop(youngest)
            youngest.state = "finished"
            youngest.out.put_nowait(("", "length"))
            self.pool.give(youngest.blocks)
            self.metrics.inc("request_success", label="length")
            return
        if len(self._running) > 1:
            self._running.pop(youngest)
            youngest.state = "preempted"
            self.pool.give(youngest.blocks)
            self._preempted.append(youngest)

    def _readmit(self) -> None:
        while self._preempted:
            seq = self._preempted[0]
            blocks = self.pool.take(blocks_for(seq.kv_tokens + 1, self.block_size))
            if blocks is None:
                return
            self._preempted.popleft()
            seq.blocks = blocks
            seq.stalled = False
            self.join(seq)

    def __repr__(self) -> str:
        return f"DecodeEngine(running={self.running}, preempted={self.preempted}, pool={self.pool})"


class PrefillQueue:
    """FIFO prefill, one prompt at a time (asyncio.Lock wakes waiters in arrival order)."""

    def __init__(self, perf: PerfModel, time_factor: Callable[[], float]) -> None:
        self.perf = perf
        self.time_factor = time_factor
        self._lock = asyncio.Lock()
        self.waiting = 0
        self.running = 0
        self.queued_tokens = 0

    async def run(self, prompt_tokens: int) -> None:
        self.waiting += 1
        self.queued_tokens += prompt_tokens
        entered = False
        try:
            async with self._lock:
                self.waiting -= 1
                entered = True
                self.running += 1
                try:
                    await asyncio.sleep(self.perf.prefill_s(prompt_tokens) * self.time_factor())
                finally:
                    self.running -= 1
        finally:
            if not entered:
                self.waiting -= 1
            self.queued_tokens -= prompt_tokens

    def __repr__(self) -> str:
        return f"PrefillQueue(running={self.running}, waiting={self.waiting})"


@dataclass(slots=True)
class KvEntry:
    """A prefilled KV waiting for its decode worker to pull it."""

    request_id: str
    prompt_state: int
    prompt_tokens: int
    blocks: list[int]
    created: float
    expires: float


class KvLedger:
    """Prefilled KV held under a lease until a decode pulls it; expired entries are freed."""

    def __init__(
        self, pool: BlockPool, engine_id: str, clock: Callable[[], float], metrics: SimMetrics
    ) -> None:
        self.pool = pool
        self.engine_id = engine_id
        self.clock = clock
        self.metrics = metrics
        self._entries: dict[str, KvEntry] = {}
        self._suffix = itertools.count(1)
        self.added = asyncio.Event()  # wakes the reaper when the ledger stops being empty

    def __len__(self) -> int:
        return len(self._entries)

    def add(
        self,
        request_id: str,
        prompt_state: int,
        prompt_tokens: int,
        blocks: list[int],
        lease_s: float,
    ) -> KvEntry:
        key = request_id
        while key in self._entries:  # two prefills under one X-Request-Id must not collide
            key = f"{request_id}-{next(self._suffix)}"
        now = self.clock()
        entry = KvEntry(key, prompt_state, prompt_tokens, blocks, now, now + lease_s)
        self._entries[key] = entry
        self.added.set()
        return entry

    def next_expiry(self) -> float | None:
        # Every entry gets the same lease, so the oldest (first inserted) expires first.
        return next(iter(self._entries.values())).expires if self._entries else None

    def claim(
        self, request_id: object, engine_id: object, block_ids: object, prompt_state: object
    ) -> tuple[KvEntry | None, str | None]:
        """Take the entry a pull names: (entry, None), or (None, reason) and the entry stays.

        Reasons: "not_found" (unknown or expired), or a mismatch: "engine_id", "block_ids",
        "prompt_state" — crossed params, which real vLLM would not notice.
        """
        self.reap()
        entry = self._entries.get(request_id) if isinstance(request_id, str) else None
        if entry is None:
            return None, "not_found"
        if engine_id != self.engine_id:
            return None, "engine_id"
        if block_ids != entry.blocks:
            return None, "block_ids"
        if prompt_state != entry.prompt_state:
            return None, "prompt_state"
        del self._entries[entry.request_id]
        return entry, None

    def reap(self) -> int:
        """Free every expired entry; returns how many."""
        now = self.clock()
        expired = [e for e in self._entries.values() if e.expires <= now]
        for entry in expired:
            del self._entries[entry.request_id]
            self.pool.give(entry.blocks)
        self.metrics.inc("kv_expired", len(expired))
        return len(expired)

    def describe(self) -> list[dict[str, object]]:
        now = self.clock()
        return [
            {
                "request_id": e.request_id,
                "prompt_tokens": e.prompt_tokens,
                "blocks": len(e.blocks),
                "age_s": round(now - e.created, 6),
                "expires_in_s": round(e.expires - now, 6),
            }
            for e in self._entries.values()
        ]

    def __repr__(self) -> str:
        return f"KvLedger(entries={len(self._entries)}, engine_id={self.engine_id[:8]!r})"
