"""What this router replica holds in the shared store, kept true whatever the store does.

- **Live reservations** are renewed each third of the lease period, one `renew_many` call per
  decode worker per tick (not one per reservation), so a streaming request keeps its room and a
  router that dies stops renewing: its reservations expire by themselves (docs/design.md §5).
  A reservation the store lost under a live request (an outage longer than the lease, or a
  Redis restarted empty) is put back, over capacity if need be: its sequence really occupies
  the worker.
- **Stranded entries** of this replica's requests are remembered, so they can be written again
  when the store lost them. Each is written with its reservation, pending
  (router/request/reserve.py);
  marking it ready is a background call that never creates an entry (`kv_ready`).
- **Owed steps**: an end-of-request release or unstrand that failed (the store was down, or one
  step errored) is retried every second until it lands or its lease has run out anyway. An owed
  release is never renewed: it is out of `live` the moment its request let go of it.

Nothing here raises into a request: store failures are logged (once per tick, not per item)
and retried.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from router.loop_timing import beat
from state.base import Finished, StateStore, StoreError, StrandIntent

__all__ = ["LeaseKeeper"]

log = logging.getLogger(__name__)

# How often owed steps are retried, and the renewal tick's granularity.
_OWED_RETRY_S = 1.0


@dataclass(slots=True)
class _Owed:
    worker_id: str
    # Monotonic time of the failed attempt; for a stranded entry still pending in the store,
    # its ready-by time: the reaper takes that one only a KV lease after it, so it is owed
    # until then.
    since: float


@dataclass(slots=True)
class _Strand:
    prefill_id: str
    nbytes: int
    # Monotonic time its KV became ready, or (pending) will be ready by at the latest: what a
    # store that lost the entry is given back.
    ready_at: float


class LeaseKeeper:
    def __init__(
        self,
        store: StateStore,
        lease_s: float,
        *,
        stranded_lease_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.store = store
        self.lease_s = lease_s
        self.stranded_lease_s = stranded_lease_s
        self.clock = clock
        self.live: dict[str, str] = {}  # reservation id -> decode worker id
        # reservation id -> (blocks, expected end on the monotonic clock): what prediction-based
        # admission counts on freeing up (this replica's reservations; others' are not known)
        self.expected: dict[str, tuple[int, float]] = {}
        self.strands: dict[str, _Strand] = {}  # ledger entry id -> the entry
        self.owed_releases: dict[str, _Owed] = {}  # reservation id -> its decode worker
        self.owed_unstrands: dict[str, _Owed] = {}  # ledger entry id -> its prefill worker
        self.owed_strands: set[str] = set()  # ledger entry ids not written yet
        # What else lives by this replica's renewals, renewed on the same tick and put back
        # after a store loss the same way (router/request/quota.py: tenants' quota holds).
        self.also_renew: list[Callable[[], Awaitable[None]]] = []
        # Whether what `also_renew` renews holds anything now (one per entry there): while
        # neither they nor this keeper hold or owe anything, its loop has no timer at all.
        self.also_holding: list[Callable[[], bool]] = []
        self._work = asyncio.Event()  # set by what gives the loop something to do (`wake`)
        # After a loss, the store holds new reservations back for the slowest replica's round
        # (state/holdback.py): it learns this replica's from here.
        store.advertise_renewal(self.renew_within_s)

    @property
    def renew_every_s(self) -> float:
        return max(_OWED_RETRY_S, self.lease_s / 3)

    @property
    def renew_within_s(self) -> float:
        """The longest between two renewal rounds: the period, checked on the tick (`run`)."""
        return self.renew_every_s + min(_OWED_RETRY_S, self.renew_every_s)

    def __repr__(self) -> str:
        return (
            f"LeaseKeeper({len(self.live)} live, {len(self.strands)} stranded, "
            f"owed={len(self.owed_releases)}+{len(self.owed_unstrands)}, lease={self.lease_s}s)"
        )

    # -- reservations ------------------------------------------------------------------------
    def hold(
        self,
        worker_id: str,
        reservation_id: str,
        blocks: int = 0,
        expected_end: float = float("inf"),
    ) -> None:
        self.live[reservation_id] = worker_id
        self.expected[reservation_id] = (blocks, expected_end)
        self.wake()

    def resized(self, reservation_id: str, blocks: int, expected_end: float | None = None) -> None:
        """A grown reservation: its size, and (an answer longer than expected) its new end."""
        if reservation_id in self.expected:
            end = self.expected[reservation_id][1] if expected_end is None else expected_end
            self.expected[reservation_id] = (blocks, end)

    def drop(self, reservation_id: str) -> None:
        self.live.pop(reservation_id, None)
        self.expected.pop(reservation_id, None)

    def owe_release(self, worker_id: str, reservation_id: str) -> None:
        """A release that did not land (or a reserve whose answer was lost): retried."""
        self.drop(reservation_id)
        self._owe((worker_id, reservation_id), None)

    def reservations_by_worker(self) -> Counter[str]:
        """How many live reservations this replica holds on each decode worker: what the
        refresher compares with the store's count to tell whether another replica holds any."""
        return Counter(self.live.values())

    def freeing_by(self, when: float, now: float) -> dict[str, int]:
        """Blocks per decode worker whose reservations are expected to end after `now` and by
        `when`. One already past its expected end is not counted: its answer outran the
        estimate, or its client holds the room without reading, so when it ends is unknown —
        counting it would admit on room that is not coming (an over-commit)."""
        out: dict[str, int] = {}
        for rid, (blocks, end) in self.expected.items():
            if now < end <= when and rid in self.live:
                wid = self.live[rid]
                out[wid] = out.get(wid, 0) + blocks
        return out

    def ends_on(self, worker_id: str, now: float) -> list[tuple[float, int]]:
        """(expected end, blocks) of this replica's live reservations on `worker_id` still
        expected to end, soonest first: when room should appear there."""
        return sorted(
            (end, blocks)
            for rid, (blocks, end) in self.expected.items()
            if end > now and self.live.get(rid) == worker_id
        )

    # -- stranded KV -------------------------------------------------------------------------
    def stranded(self, intent: StrandIntent, written: bool) -> None:
        """The reservation wrote `intent` (pending) with it, or (`written` False: a cluster's
        ledger node failed) did not: then it is written on a later tick. Best effort: the
        ledger is bookkeeping, not a safety reservation, so that does not fail the request."""
        ready_by = self.clock() + intent.ready_within_s
        self.strands[intent.request_id] = _Strand(intent.prefill_id, intent.nbytes, ready_by)
        if not written:
            self.owed_strands.add(intent.request_id)
            self.wake()

    def owe_unstrand(self, prefill_id: str, request_id: str, ready_within_s: float) -> None:
        """An entry that may be in the ledger, pending (a reservation whose answer was lost):
        cleared on a later tick."""
        self._owe(None, (prefill_id, request_id), self.clock() + ready_within_s)

    async def kv_ready(self, prefill_id: str, request_id: str, age_s: float) -> None:
        """The prefill answered `age_s` ago and the decode has not taken the KV yet: its KV
        lease counts from then. A failure leaves the entry pending, reaped later, never early."""
        entry = self.strands.get(request_id)
        if entry is None:  # unstranded meanwhile: nothing to mark
            return
        entry.ready_at = self.clock() - age_s
        if request_id in self.owed_strands:  # not written yet: it will be, with this time
            return
        try:
            await self.store.mark_ready(prefill_id, request_id, age_s)
        except StoreError as exc:
            log.debug("marking the KV of %s on %s ready failed: %s", request_id, prefill_id, exc)

    async def unstrand(self, prefill_id: str, request_id: str) -> None:
        """The decode took the KV (first token): clear the entry, now or on a later tick."""
        entry = self.strands.pop(request_id, None)
        if request_id in self.owed_strands:  # never written: nothing to clear
            self.owed_strands.discard(request_id)
            return
        try:
            await self.store.unstrand(prefill_id, request_id)
        except StoreError:
            self._owe(None, (prefill_id, request_id), entry.ready_at if entry else None)

    # -- the end of an attempt -----------------------------------------------------------------
    async def finish(
        self,
        release: tuple[str, str] | None,
        unstrand: tuple[str, str] | None,
        record: tuple[Sequence[str], int] | None = None,
    ) -> int:
        """Release, unstrand and record in one store call. Never raises: a step that failed is
        owed and retried. Returns the blocks released now (0 when owed or already gone)."""
        if release is not None:
            self.drop(release[1])  # never renewed again, whatever the store says
        ready_at = None
        if unstrand is not None:
            entry = self.strands.pop(unstrand[1], None)
            ready_at = entry.ready_at if entry else None
            if unstrand[1] in self.owed_strands:
                self.owed_strands.discard(unstrand[1])
                unstrand = None
        try:
            done = await self.store.finish(release, unstrand, record)
        except StoreError as exc:
            log.debug("end-of-request bookkeeping deferred: %s", exc)
            self._owe(release, unstrand, ready_at)
            return 0
        except asyncio.CancelledError:
            # The request's task was cancelled mid-call (its client left, the replica stops):
            # whether the script ran is unknown. Owed, so the retry (idempotent by id) lands
            # it; otherwise the room would stay held until its lease ran out.
            self._owe(release, unstrand, ready_at)
            raise
        self._owe(
            release if done.released_blocks is None else None,
            unstrand if done.unstranded_bytes is None else None,
            ready_at,
        )
        if not done.recorded:
            log.debug("an output-length statistic was not recorded")
        return done.released_blocks or 0

    def _owe(
        self,
        release: tuple[str, str] | None,
        unstrand: tuple[str, str] | None,
        ready_at: float | None = None,
    ) -> None:
        now = self.clock()
        self.wake()
        if release is not None:
            self.owed_releases[release[1]] = _Owed(release[0], now)
        if unstrand is not None:
            since = now if ready_at is None else max(now, ready_at)
            self.owed_unstrands[unstrand[1]] = _Owed(unstrand[0], since)

    # -- the background work ---------------------------------------------------------------------
    def wake(self) -> None:
        """Something to renew or settle now: the loop ticks again (`run`)."""
        self._work.set()

    @property
    def idle(self) -> bool:
        """Nothing held or owed, here or by what it also renews."""
        return not self.live and not self.owed and not any(h() for h in self.also_holding)

    async def renew_all(self) -> int:
        """Renew every live lease, one call per decode worker; returns how many the store had
        lost and were put back. Each worker's answer is taken as it comes, not once all have
        answered: a reservation released while its renewal was on its way, and put back by
        it, is owed at once, not only when the slowest worker's call is done."""
        if not self.live:
            return 0  # nothing held: no tick work
        by_worker: dict[str, dict[str, int]] = {}
        for rid, wid in list(self.live.items()):
            by_worker.setdefault(wid, {})[rid] = self.expected.get(rid, (0, 0.0))[0]
        wids = list(by_worker)
        results = await asyncio.gather(
            *(self._renew_worker(wid, by_worker[wid]) for wid in wids), return_exceptions=True
        )
        put_back = 0
        failed: list[str] = []
        for wid, result in zip(wids, results, strict=True):
            if isinstance(result, BaseException):
                failed.append(f"{wid}: {result}")
            else:
                put_back += result
        if failed:
            log.warning("lease renewal failed for %d worker(s): %s", len(failed), failed[0])
        return put_back

    async def _renew_worker(self, wid: str, reservations: dict[str, int]) -> int:
        result = await self.store.renew_many(wid, reservations, self.lease_s)
        back = [rid for rid in result if rid in self.live]
        for rid in result:
            if rid not in self.live and rid not in self.owed_releases:
                # Released while this renewal was on its way, and put back by it after the
                # release ran: release it again rather than leave it for its lease.
                self.owed_releases[rid] = _Owed(wid, self.clock())
        if back:
            log.warning(
                "%d reservation(s) on %s had been lost by the store under live requests: put back",
                len(back),
                wid,
            )
        return len(back)

    async def settle_owed(self) -> int:
        """Retry owed releases and unstrands (and deferred strands); returns how many are
        still owed. A release owed longer than a lease is moot (the lease expired): dropped."""
        now = self.clock()
        for rid, owed in list(self.owed_releases.items()):
            if now - owed.since > self.lease_s:
                del self.owed_releases[rid]
        for req, owed in list(self.owed_unstrands.items()):
            if now - owed.since > self.stranded_lease_s:
                del self.owed_unstrands[req]  # the reaper has taken it by now
        releases = list(self.owed_releases.items())
        unstrands = list(self.owed_unstrands.items())
        strands = [r for r in self.owed_strands if r in self.strands]
        self.owed_strands.intersection_update(strands)
        calls: list[Awaitable[object]] = [
            self.store.finish(release=(o.worker_id, rid)) for rid, o in releases
        ]
        calls += [self.store.finish(unstrand=(o.worker_id, req)) for req, o in unstrands]
        calls += [self.store.strand(*self._strand_args(req)) for req in strands]
        if not calls:
            return 0
        results = await asyncio.gather(*calls, return_exceptions=True)
        keys = [("release", rid) for rid, _ in releases]
        keys += [("unstrand", req) for req, _ in unstrands]
        keys += [("strand", req) for req in strands]
        for (kind, key), result in zip(keys, results, strict=True):
            if isinstance(result, BaseException):
                continue
            if kind == "strand":
                self.owed_strands.discard(key)
            elif isinstance(result, Finished):
                if kind == "release" and result.released_blocks is not None:
                    self.owed_releases.pop(key, None)
                elif kind == "unstrand" and result.unstranded_bytes is not None:
                    self.owed_unstrands.pop(key, None)
        return self.owed

    @property
    def owed(self) -> int:
        """Store steps not taken yet: releases, unstrands and strands."""
        return len(self.owed_releases) + len(self.owed_unstrands) + len(self.owed_strands)

    def _strand_args(self, request_id: str) -> tuple[str, str, int, float]:
        entry = self.strands[request_id]
        return entry.prefill_id, request_id, entry.nbytes, entry.ready_at - self.clock()

    async def reassert(self) -> None:
        """The store lost its data: put back every live reservation and stranded entry (and
        what else lives by the renewals)."""
        await self.renew_all()
        for renew in self.also_renew:
            await renew()
        if self.strands:
            results = await asyncio.gather(
                *(self.store.strand(*self._strand_args(r)) for r in list(self.strands)),
                return_exceptions=True,
            )
            failed = [r for r in results if isinstance(r, BaseException)]
            if failed:
                log.warning("%d stranded entries could not be put back: %s", len(failed), failed[0])

    async def run(self) -> None:
        renew_every = self.renew_every_s
        next_renewal = self.clock() + renew_every
        while True:
            if self.idle:
                # Nothing held or owed: a tick would do nothing, so there is none until a hold,
                # a debt or a quota hold (`wake`) gives it work (an idle replica's wake-ups,
                # docs/benchmarks-overhead.md "Idle"). What it holds then is fresh.
                self._work.clear()
                await self._work.wait()
                next_renewal = self.clock() + renew_every
                continue
            # On the loops' shared beat (router/loop_timing.py): its store calls, when it has
            # any, go out with theirs, and a tick with none costs no wake-up of its own.
            await beat(min(_OWED_RETRY_S, renew_every))
            try:
                await self.settle_owed()
                if self.clock() >= next_renewal:
                    next_renewal = self.clock() + renew_every
                    await self.renew_all()
                    for renew in self.also_renew:
                        await renew()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a bug here must not end renewals for the process
                log.warning("lease keeper tick failed: %r", exc)
