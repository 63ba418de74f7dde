"""`MemoryStore`: the `StateStore` in-process, for a single router with no Redis.

It mirrors `RedisStore` rule for rule (the conformance suite holds both to the same results):
leases expire at ``expiry <= now``, a repeated reserve renews without counting twice, the retry
budget counts per whole second over the last ``ceil(window_s)`` seconds.

Concurrency: the router runs on one asyncio thread, and no method awaits between its check and
its act, so each method is as atomic as a Lua script is in Redis. Do not add an ``await``
inside one.

Expired leases are dropped by scanning a worker's reservations on every call: a decode worker
holds at most a few hundred, so a heap would cost more code than it saves.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from state.base import (
    DecodeUsage,
    Finished,
    RegistryView,
    Reserved,
    RetryBudgetPolicy,
    StrandedEntry,
    StrandIntent,
    UsageView,
)
from state.fair_shares import FairSlot, FairTable
from state.keys import (
    RETRY_RETENTION_S,
    check_count,
    check_id,
    check_lease,
    check_policy,
)
from state.memory_fair import MemoryFair
from state.memory_quotas import MemoryQuotas
from state.memory_registry import MemoryRegistry
from state.quotas import Buckets

__all__ = ["MemoryStore"]


@dataclass(slots=True)
class _Reservation:
    blocks: int
    expiry: float


@dataclass(slots=True)
class _DecodeWorker:
    capacity: int = 0
    reserved: int = 0  # sum of the live reservations' blocks, kept exact by every change
    reservations: dict[str, _Reservation] = field(default_factory=dict)
    hold_until: float = 0.0  # no new reservation before this (state/holdback.py)
    # No lease ends before this: every store call purges, and scanning every reservation on
    # each one cost ~3 % of the router's CPU at 256 streams. A lower bound, not exact (a renewal
    # only moves an expiry later), so a purge past it scans and sets it again.
    soonest: float = float("inf")

    def expires(self, held: _Reservation, expiry: float) -> None:
        held.expiry = expiry
        self.soonest = min(self.soonest, expiry)

    def purge(self, now: float) -> None:
        if now < self.soonest:
            return
        dead = [rid for rid, r in self.reservations.items() if r.expiry <= now]
        for rid in dead:
            self.reserved -= self.reservations.pop(rid).blocks
        self.soonest = min((r.expiry for r in self.reservations.values()), default=float("inf"))

    @property
    def free(self) -> int:
        return self.capacity - self.reserved


@dataclass(slots=True)
class _Stranded:
    nbytes: int
    since: float


@dataclass(slots=True)
class _Ledger:
    total: int = 0
    entries: dict[str, _Stranded] = field(default_factory=dict)


class _Buckets:
    """Counts per whole second, pruned like the Redis hash: when a second's first count lands."""

    __slots__ = ("_counts",)

    def __init__(self) -> None:
        self._counts: dict[int, int] = {}

    def count(self, sec: int) -> None:
        if sec not in self._counts:
            for old in [s for s in self._counts if s <= sec - RETRY_RETENTION_S]:
                del self._counts[old]
            self._counts[sec] = 0
        self._counts[sec] += 1

    def since(self, first: int) -> int:
        return sum(n for s, n in self._counts.items() if s >= first)


class MemoryStore(MemoryRegistry, MemoryQuotas, MemoryFair):
    """The `StateStore` in this process's memory (the registry, drains, roles and the marker
    are `MemoryRegistry`'s)."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        super().__init__(clock)
        self._decode: dict[str, _DecodeWorker] = {}
        self._ledgers: dict[str, _Ledger] = {}
        self._requests = _Buckets()
        self._retries = _Buckets()
        self._outputs: dict[str, Counter[int]] = {}
        self._quotas: dict[str, Buckets] = {}  # tenant -> its quota state (MemoryQuotas)
        self._fair = FairTable()  # the cluster's fair share (MemoryFair)
        self._nudged: dict[
            str, list[asyncio.Queue[FairSlot | None]]
        ] = {}  # (MemoryFair) by replica
        self._claims: dict[str, float] = {}  # (MemoryFair) take-back claims' expiries

    def _drop_worker(self, worker_id: str) -> None:
        self._decode.pop(worker_id, None)
        self._ledgers.pop(worker_id, None)

    def _worker(self, worker_id: str) -> _DecodeWorker:
        worker = self._decode.get(check_id("worker_id", worker_id))
        if worker is None:
            worker = self._decode[worker_id] = _DecodeWorker()
        worker.purge(self._clock())
        return worker

    # -- decode reservations -------------------------------------------------------------
    async def set_capacity(self, worker_id: str, capacity_blocks: int) -> None:
        check_count("capacity_blocks", capacity_blocks)
        worker = self._worker(worker_id)
        hold_s = self._horizon.hold_s(worker_id)
        if hold_s > 0 and worker.capacity == 0:  # lost or deleted: put-backs first
            worker.hold_until = max(worker.hold_until, self._clock() + hold_s)
        worker.capacity = int(capacity_blocks)

    async def reserve(
        self,
        worker_id: str,
        reservation_id: str,
        blocks: int,
        lease_s: float,
        overbook_blocks: int = 0,
        intent: StrandIntent | None = None,
    ) -> Reserved:
        check_count("blocks", blocks)
        check_lease(lease_s)
        if intent is not None:  # checked before anything is booked, as the Redis store does
            check_count("nbytes", intent.nbytes)
            check_id("prefill_id", intent.prefill_id)
        worker = self._worker(worker_id)
        now = self._clock()
        expiry = now + lease_s
        held = worker.reservations.get(reservation_id)
        if held is not None:
            worker.expires(held, expiry)
        elif worker.hold_until > now or worker.free + max(0, int(overbook_blocks)) < blocks:
            return Reserved(False)
        else:
            worker.reservations[reservation_id] = held = _Reservation(int(blocks), expiry)
            worker.expires(held, expiry)
            worker.reserved += int(blocks)
        if intent is None:
            return Reserved(True)
        self._strand(intent.prefill_id, intent.request_id, intent.nbytes, intent.ready_within_s)
        return Reserved(True, stranded=True)

    async def renew(self, worker_id: str, reservation_id: str, lease_s: float) -> bool:
        check_lease(lease_s)
        worker = self._worker(worker_id)
        held = worker.reservations.get(reservation_id)
        if held is None:
            return False
        worker.expires(held, self._clock() + lease_s)
        return True

    async def renew_many(
        self, worker_id: str, reservations: Mapping[str, int], lease_s: float
    ) -> list[str]:
        check_lease(lease_s)
        worker = self._worker(worker_id)
        expiry = self._clock() + lease_s
        back = []
        for rid, blocks in reservations.items():
            check_count("blocks", blocks)
            held = worker.reservations.get(rid)
            if held is not None:
                worker.expires(held, expiry)
            elif blocks > 0:
                worker.reservations[rid] = held = _Reservation(int(blocks), expiry)
                worker.expires(held, expiry)
                worker.reserved += int(blocks)
                back.append(rid)
        return back

    async def resize(
        self, worker_id: str, reservation_id: str, blocks: int, *, force: bool = False
    ) -> bool:
        check_count("blocks", blocks)
        worker = self._worker(worker_id)
        held = worker.reservations.get(reservation_id)
        if held is None:
            return False
        delta = int(blocks) - held.blocks
        held_back = worker.hold_until > self._clock()
        if delta > 0 and not force and (held_back or worker.free < delta):
            return False
        held.blocks = int(blocks)
        worker.reserved += delta
        return True

    async def release(self, worker_id: str, reservation_id: str) -> int:
        worker = self._worker(worker_id)
        held = worker.reservations.pop(reservation_id, None)
        if held is None:
            return 0
        worker.reserved -= held.blocks
        return held.blocks

    async def decode_usage(self, worker_ids: Iterable[str]) -> dict[str, DecodeUsage]:
        return self._usage(worker_ids)

    def _usage(self, worker_ids: Iterable[str]) -> dict[str, DecodeUsage]:
        usage = {}
        for worker_id in worker_ids:
            w = self._worker(worker_id)
            usage[worker_id] = DecodeUsage(w.capacity, w.reserved, len(w.reservations))
        return usage

    # -- stranded KV ledger --------------------------------------------------------------
    def _ledger(self, prefill_id: str) -> _Ledger:
        ledger = self._ledgers.get(check_id("prefill_id", prefill_id))
        if ledger is None:
            ledger = self._ledgers[prefill_id] = _Ledger()
        return ledger

    async def strand(
        self, prefill_id: str, request_id: str, nbytes: int, ready_in_s: float = 0.0
    ) -> None:
        check_count("nbytes", nbytes)
        self._strand(prefill_id, request_id, nbytes, ready_in_s)

    def _strand(self, prefill_id: str, request_id: str, nbytes: int, ready_in_s: float) -> None:
        ledger = self._ledger(prefill_id)
        entry = ledger.entries.get(request_id)
        if entry is None:
            ledger.entries[request_id] = _Stranded(int(nbytes), self._clock() + ready_in_s)
            ledger.total += int(nbytes)
        else:
            # Keep the first `since`: the prefill's KV lease started when the KV was first ready.
            ledger.total += int(nbytes) - entry.nbytes
            entry.nbytes = int(nbytes)

    async def mark_ready(self, prefill_id: str, request_id: str, age_s: float = 0.0) -> bool:
        entry = self._ledger(prefill_id).entries.get(request_id)
        if entry is None:  # unstranded first: nothing to bring back
            return False
        entry.since = self._clock() - age_s
        return True

    async def unstrand(self, prefill_id: str, request_id: str) -> int:
        ledger = self._ledger(prefill_id)
        entry = ledger.entries.pop(request_id, None)
        if entry is None:
            return 0
        ledger.total -= entry.nbytes
        return entry.nbytes

    async def stranded_bytes(self, prefill_ids: Iterable[str]) -> dict[str, int]:
        return self._stranded_sums(prefill_ids)

    def _stranded_sums(self, prefill_ids: Iterable[str]) -> dict[str, int]:
        return {p: self._ledger(p).total for p in prefill_ids}

    async def reap_stranded(self, prefill_id: str, older_than_s: float) -> list[StrandedEntry]:
        ledger = self._ledger(prefill_id)
        cutoff = self._clock() - older_than_s
        old = sorted(
            ((rid, e) for rid, e in ledger.entries.items() if e.since <= cutoff),
            key=lambda item: item[1].since,
        )
        for rid, entry in old:
            del ledger.entries[rid]
            ledger.total -= entry.nbytes
        return [StrandedEntry(prefill_id, rid, e.nbytes, e.since) for rid, e in old]

    # -- the end of a request ---------------------------------------------------------------
    async def finish(
        self,
        release: tuple[str, str] | None = None,
        unstrand: tuple[str, str] | None = None,
        record: tuple[Sequence[str], int] | None = None,
    ) -> Finished:
        released = await self.release(*release) if release is not None else 0
        unstranded = await self.unstrand(*unstrand) if unstrand is not None else 0
        if record is not None:
            await self.record_output(*record)
        return Finished(released_blocks=released, unstranded_bytes=unstranded, recorded=True)

    # -- retry budget ----------------------------------------------------------------------
    async def note_request(self, count: int = 1) -> None:
        check_count("count", count)
        for _ in range(count):
            self._requests.count(math.floor(self._clock()))

    async def try_retry(self, policy: RetryBudgetPolicy) -> bool:
        check_policy(policy)
        sec = math.floor(self._clock())
        first = sec - math.ceil(policy.window_s) + 1
        requests = self._requests.since(first)
        retries = self._retries.since(first)
        if retries + 1 > policy.ratio * requests + policy.min_per_s * policy.window_s:
            return False
        self._retries.count(sec)
        return True

    # -- output-length statistics ----------------------------------------------------------
    async def record_output(self, class_keys: Sequence[str], bucket: int) -> None:
        for class_key in class_keys:
            counts = self._outputs.get(check_id("class_key", class_key))
            if counts is None:
                counts = self._outputs[class_key] = Counter()
            counts[int(bucket)] += 1

    async def output_histograms(self, class_keys: Sequence[str]) -> dict[str, Mapping[int, int]]:
        return {k: dict(self._outputs.get(check_id("class_key", k), {})) for k in class_keys}

    async def ping(self) -> bool:
        return True

    async def close(self) -> None:
        return None

    def __repr__(self) -> str:
        reserved = sum(w.reserved for w in self._decode.values())
        stranded = sum(ledger.total for ledger in self._ledgers.values())
        return (
            f"MemoryStore(decode_workers={len(self._decode)}, reserved_blocks={reserved}, "
            f"prefill_workers={len(self._ledgers)}, stranded_bytes={stranded})"
        )

    # -- one read for the state refresher ---------------------------------------------------
    async def usage_view(
        self, decode_ids: Iterable[str], prefill_ids: Iterable[str]
    ) -> tuple[dict[str, DecodeUsage], dict[str, int]]:
        return self._usage(decode_ids), self._stranded_sums(prefill_ids)

    # -- one read for a quiet beat -------------------------------------------------------------
    async def registry_and_usage_view(
        self, marker_ttl_s: float, decode_ids: Iterable[str], prefill_ids: Iterable[str]
    ) -> tuple[RegistryView, UsageView]:
        return await self.registry_view(marker_ttl_s), await self.usage_view(
            decode_ids, prefill_ids
        )
