"""What one try holds and must give back, each with one owner: the decode reservation
(`Reservation`) and the stranded-KV entry of a pulled prefill (`StrandedEntry`).

Each owner goes through its life in one place, so the stages that meet it only call it:

    reservation   intent (`Book.pending`, visible to placement while the store call is out)
                  → hold (router/request/reserve.py) → grow (the relay's token count,
                  router/request/respond.py) → release (router/request/release.py)
    stranded KV   intent (written with the reservation, pending) → hold → ready (the prefill
                  answered: marked ready only if the decode has not taken it within
                  READY_MARK_AFTER_S) → accepted (the decode's first token) → release

`release()` takes the holding once (a second call gives None), so nothing is given back twice;
the one store call that gives back both is `Book.finish` (router/leases.py `finish`).
A `Book` is this replica's bookkeeping of holdings: the store, the lease keeper, the
workers' local counts, the overrun statistics. It is built once per app.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass

from policies.base import blocks_for, extra_choice_tokens
from policies.overruns import LiveOverruns, OverrunMargin
from router.admission import Admission
from router.background import BackgroundTasks
from router.leases import LeaseKeeper
from router.metrics import RouterMetrics
from router.request.preemption import OVER_LIMIT, Preemptor
from router.workers.accounting import LocalAccounting
from router.workers.membership import Membership
from state.base import StateStore, StrandIntent

__all__ = ["READY_MARK_AFTER_S", "Book", "Record", "Reservation", "StrandedEntry"]

log = logging.getLogger(__name__)

# How long after the prefill's answer a stranded entry still pending is marked ready (its KV
# lease then counts from the answer, not from the latest the prefill could have answered). A
# decode usually shows it took the KV within milliseconds and the entry is cleared instead, so
# the mark costs no store call for most requests; it matters for KV that sits unaccepted.
READY_MARK_AFTER_S = 1.0

# The estimator's feedback: (class keys, output-length bucket), recorded with the last release.
Record = tuple[list[str], int]
# The tenant's concurrent-blocks hold of the request, made to follow its reservation: (blocks,
# force) -> granted (router/request/quota.py `QuotaGate.follow`).
FollowHold = Callable[[int, bool], Awaitable[bool]]
# How often a growth that preempted other streams looks again for their room.
_ROOM_POLL_S = 0.02


@dataclass(slots=True)
class Book:
    """The services a holding needs to be held, grown and given back."""

    store: StateStore
    leases: LeaseKeeper
    members: Membership  # who is in the pools (a grown worker's size, its block size)
    accounting: LocalAccounting  # this replica's counts on the workers since the last refresh
    tasks: BackgroundTasks
    metrics: RouterMetrics
    overruns: LiveOverruns
    margin: OverrunMargin
    admission: Admission
    clock: Callable[[], float]
    preemptor: Preemptor

    @contextlib.contextmanager
    def pending(self, decode_id: str, blocks: int) -> Iterator[None]:
        """A reservation on its way to the store: counted by placements made meanwhile (no
        await between the decision and this), uncounted once the store has answered."""
        self.accounting.note_pending(decode_id, blocks)
        try:
            yield
        finally:
            self.accounting.note_pending(decode_id, -blocks)

    def lost(self, decode_id: str, reservation_id: str, intent: StrandIntent | None) -> None:
        """The store's answer to a reservation was lost, not necessarily the reservation (nor
        its stranded entry): owe their release, which the lease keeper retries."""
        self.leases.owe_release(decode_id, reservation_id)
        if intent is not None:
            self.leases.owe_unstrand(intent.prefill_id, intent.request_id, intent.ready_within_s)

    def refused(self, intent: StrandIntent | None, written: bool) -> None:
        """A refused reservation whose stranded entry a cluster wrote beside the refusal: take
        it back, in the background (the entry's id is this reservation's alone)."""
        if intent is not None and written:
            self.tasks.job(self.leases.unstrand(intent.prefill_id, intent.request_id), "unstrand")

    async def finish(
        self,
        freed: tuple[str, str] | None,
        unstrand: tuple[str, str] | None,
        record: Record | None,
    ) -> None:
        """Give back a reservation and a stranded entry, and record an answer's length: one
        store call. It cannot half-fail: a step the store did not take is owed."""
        if freed is None and unstrand is None and record is None:
            return
        released = await self.leases.finish(freed, unstrand, record)
        if freed is not None:
            self.accounting.note_released(freed[0], released)
            if self.admission.waiting:
                self.admission.notify()


class Reservation:
    """Decode room held on one worker for one try, grown as the answer outgrows it."""

    __slots__ = (
        "book",
        "decode_id",
        "reservation_id",
        "blocks",
        "grow_at_tokens",
        "overran",
        "growing",
        "classes",
        "itl_s",
        "tenant",
        "follow_hold",
        "block_limit",
    )

    def __init__(
        self,
        book: Book,
        decode_id: str,
        reservation_id: str,
        blocks: int,
        grow_at_tokens: int,
        classes: tuple[str, ...],
        itl_s: float,
    ) -> None:
        self.book = book
        self.decode_id: str | None = decode_id  # None once released
        self.reservation_id = reservation_id
        self.blocks = blocks
        self.grow_at_tokens = grow_at_tokens
        self.overran = False
        self.growing = False  # a growth is on its way to the store
        # The estimator's classes of the request: an overrun raises their estimates in flight.
        self.classes = classes
        self.itl_s = itl_s  # the pace placement predicted, for the expected end after a growth
        # Whose it is, and its tenant's hold to grow with it (set by router/request/lifecycle.py
        # once the try holds it; None: the tenant's blocks are not limited).
        self.tenant = ""
        self.follow_hold: FollowHold | None = None
        self.block_limit: int | None = None  # the tenant's max_reserved_blocks

    @classmethod
    def hold(
        cls,
        book: Book,
        decode_id: str,
        reservation_id: str,
        blocks: int,
        expected_end: float,
        *,
        grow_at_tokens: int,
        classes: tuple[str, ...],
        itl_s: float,
    ) -> Reservation:
        """The store holds it: counted locally, renewed by the lease keeper until released."""
        book.accounting.note_reserved(decode_id, blocks)
        book.leases.hold(decode_id, reservation_id, blocks, expected_end)
        return cls(book, decode_id, reservation_id, blocks, grow_at_tokens, classes, itl_s)

    def __repr__(self) -> str:
        return f"Reservation({self.decode_id}, blocks={self.blocks})"

    def grow(self, tokens: int, *, prompt_tokens: int, resumed: int, n: int) -> None:
        """Grow the room as the answer outgrows it (never silently smaller than use): at
        `tokens` sent on this try (of a prompt of `prompt_tokens`, `resumed` tokens already
        sent before it, `n` choices), start a growth in the background if one is due."""
        decode_id, book = self.decode_id, self.book
        if tokens <= self.grow_at_tokens or decode_id is None or self.growing:
            return
        worker = book.members.workers.get(decode_id)
        if worker is None:  # removed from the pools mid-stream: its release goes by id
            return
        stream = book.preemptor.live.get(self.reservation_id)
        if stream is not None and stream.reason is not None:
            return  # preempted: its room goes back, it does not grow
        if not self.overran:
            self.overran = True
            book.metrics.reservation_overruns.inc()
        # The answer is at least this long (one choice's, as estimated): its class's estimate
        # rises now, not when it completes (policies/overruns.py).
        book.overruns.overran(self.reservation_id, self.classes, -(-(resumed + tokens) // n))
        # Grow by a quarter at a time, so a long overrun costs a few store calls, not one a block.
        grow_at = max(tokens + 1, int(self.grow_at_tokens * 1.25))
        block = worker.spec.layout.block_size
        # `tokens` counts every choice's (the relay counts each choice's events), as the size
        # does: prompt + the choices' output + their own partial blocks (policies/base.py).
        extra = extra_choice_tokens(prompt_tokens, n, block)
        new_blocks = blocks_for(prompt_tokens + resumed + grow_at + extra, block)
        self.growing = True
        # It ends later than expected: when the grown room should be written, at the pace
        # placement predicted (the n choices side by side). Early refusals read these ends.
        end = book.clock() + (grow_at - tokens) / n * self.itl_s
        book.tasks.job(self._grow(new_blocks, grow_at, end), "grow-reservation")

    async def _grow(self, blocks: int, grow_at: int, end: float) -> None:
        """Grow into free room: first the tenant's hold (its block limit), then the decode
        worker's. Where either has no room, streams are preempted (router/request/
        preemption.py) and the growth waits for their room; preempted itself, this one does not
        grow (it gives its room back and resumes). With no stream to preempt it grows past the
        limit as before preemption existed: the tokens exist on the worker whatever the count
        says, and a count below use would let placement overfill it. A store failure leaves
        `grow_at_tokens` where it was, so the next token tries again."""
        book = self.book
        try:
            decode_id = self.decode_id
            if decode_id is None or blocks <= self.blocks:
                return
            rid = self.reservation_id
            follow = self.follow_hold
            if follow is not None and not await follow(blocks, False):
                limit = self.block_limit
                if limit is not None and blocks > limit and book.preemptor.stop(rid, OVER_LIMIT):
                    return  # alone it outgrows its tenant's whole limit: it ends (lifecycle)
                made = await self._make_room(blocks, None, lambda: follow(blocks, False))
                if made is None:
                    return  # preempted itself: no growth
                if not made:
                    await follow(blocks, True)
                    book.metrics.reservation_forced_growth.inc()
            grown = await book.store.resize(decode_id, rid, blocks)
            if not grown:
                made = await self._make_room(
                    blocks, decode_id, lambda: book.store.resize(decode_id, rid, blocks)
                )
                if made is None:
                    return
                grown = made
                if not grown:
                    grown = await book.store.resize(decode_id, rid, blocks, force=True)
                    if grown:
                        self._forced(decode_id, blocks)
            # The store answered: the next growth waits for the next threshold. Not grown even
            # when forced means the store lost the reservation; the lease keeper puts it back,
            # at this size.
            self.grow_at_tokens = grow_at
            if self.decode_id == decode_id:  # not released meanwhile
                book.leases.resized(rid, blocks, end)
                if grown:
                    book.accounting.note_reserved(decode_id, blocks - self.blocks)
                self.blocks = blocks
        finally:
            self.growing = False

    async def _make_room(
        self, blocks: int, decode_id: str | None, retry: Callable[[], Awaitable[bool]]
    ) -> bool | None:
        """Preempt for a growth to `blocks` that found no room (on `decode_id`, or under the
        tenant's limit when None), then try again (`retry`) while the victims give their room
        back. True: grown; None: this stream itself was preempted — at once, or when the
        victims' room did not come back within `release_wait_s` (a loaded replica: the
        promise holds, the grower waits its turn); False: nothing may be preempted (the caller
        forces, counted)."""
        book = self.book
        preemptor = book.preemptor
        if decode_id is not None and blocks > max(
            (w.capacity_blocks for w in book.members.decode_workers), default=0
        ):
            return False  # more than any decode worker holds: its continuation fits nowhere
        reason = "worker_full" if decode_id is not None else "tenant_limit"
        victims = preemptor.choose(
            self.reservation_id, self.tenant, blocks - self.blocks, decode_id
        )
        if not victims:
            return False
        preemptor.preempt(victims, reason)
        if victims.includes_grower:
            return None
        deadline = book.clock() + preemptor.settings.release_wait_s
        rid = self.reservation_id
        registered = rid in preemptor.live  # a stream that can be resumed (respond.py)
        while True:
            await asyncio.sleep(_ROOM_POLL_S)
            stream = preemptor.live.get(rid)
            ended = registered and (stream is None or stream.reason is not None)
            if self.decode_id is None or ended:
                # Released, ended, or stopped meanwhile (preempted after all, for another
                # growth): its room goes back, it needs no growth (the state machine saw one
                # forced here).
                return None
            if await retry():
                return True
            if book.clock() >= deadline:
                itself = preemptor.itself(self.reservation_id)
                if not itself:
                    return False
                preemptor.preempt(itself, reason)
                return None

    def _forced(self, decode_id: str, blocks: int) -> None:
        book = self.book
        book.metrics.reservation_forced_growth.inc()
        worker = book.members.workers.get(decode_id)
        if worker is not None:
            # Admission counted on less than these sequences hold: keep the excess back from
            # new placements there until the growth has room again.
            past = worker.reserved_blocks + blocks - self.blocks
            book.margin.observe(decode_id, past - worker.capacity_blocks, book.clock())
        log.info(
            "reservation %s outgrew its room on %s, which has none free: grown past capacity "
            "to %d blocks (the tokens are there)",
            self.reservation_id,
            decode_id,
            blocks,
        )

    def release(self) -> tuple[str, str] | None:
        """(decode worker, reservation id) to give back, once; None after."""
        decode_id, self.decode_id = self.decode_id, None
        if decode_id is None:
            return None
        if self.overran:
            self.book.overruns.ended(self.reservation_id)  # its length is now the record's
        return decode_id, self.reservation_id


class StrandedEntry:
    """The KV a pulled prefill leaves on its worker until the decode takes it: an entry in the
    prefill worker's ledger, written pending with the reservation (`intent`)."""

    __slots__ = ("book", "prefill_id", "entry_id", "nbytes", "ready_mark", "held")

    def __init__(self, book: Book, intent: StrandIntent) -> None:
        self.book = book
        self.prefill_id = intent.prefill_id
        self.entry_id = intent.request_id
        self.nbytes = intent.nbytes
        # Marks the entry ready if the decode has not taken the KV soon after the prefill
        # answered: most decodes take it first, and no store call is needed.
        self.ready_mark: asyncio.TimerHandle | None = None
        self.held = True

    @staticmethod
    def intent(
        prefill_id: str, request_id: str, reservation_id: str, nbytes: int, ready_within_s: float
    ) -> StrandIntent:
        """The entry to write with the reservation. Its id is the request's and the
        reservation's: a client may reuse X-Request-Id values, and a retry's entry must not
        be the one an owed unstrand of the failed try is still to clear. `ready_within_s`:
        the latest the prefill can answer, while the reaper must not count its KV lease."""
        return StrandIntent(prefill_id, f"{request_id}/{reservation_id}", nbytes, ready_within_s)

    @classmethod
    def hold(cls, book: Book, intent: StrandIntent, written: bool) -> StrandedEntry:
        """The reservation holds: this try owns the entry, which counts on the prefill worker
        from now on (placement's stranded-KV cap, a role drain waiting for the KV to leave)."""
        book.accounting.note_stranded(intent.prefill_id, intent.nbytes)
        book.leases.stranded(intent, written)
        return cls(book, intent)

    def __repr__(self) -> str:
        return f"StrandedEntry({self.prefill_id}, {self.nbytes} B, held={self.held})"

    def ready(self, answered: float) -> None:
        """The prefill answered at `answered` (event-loop time): the KV now waits for the
        decode. Marked ready in the store only if the decode has not taken it by then."""
        if self.held:
            loop = asyncio.get_running_loop()
            self.ready_mark = loop.call_later(READY_MARK_AFTER_S, self._mark_ready, answered)

    def _mark_ready(self, answered: float) -> None:
        self.ready_mark = None
        if not self.held:  # pragma: no cover - the timer is cancelled with the entry
            return
        age = asyncio.get_running_loop().time() - answered
        leases = self.book.leases
        self.book.tasks.job(leases.kv_ready(self.prefill_id, self.entry_id, age), "kv-ready")

    def accepted(self) -> None:
        """The decode worker produced output, so it holds the KV: clear the entry now, in the
        background (the stream goes on meanwhile)."""
        taken = self.release()
        if taken is not None:
            self.book.tasks.job(self.book.leases.unstrand(*taken), "unstrand")

    def release(self) -> tuple[str, str] | None:
        """(prefill worker, entry id) to clear, once; None after. Written with the reservation,
        so a prefill that failed (or never answered, or was not sent) has an entry too."""
        if self.ready_mark is not None:
            self.ready_mark.cancel()
            self.ready_mark = None
        if not self.held:
            return None
        self.held = False
        self.book.accounting.note_stranded(self.prefill_id, -self.nbytes)
        return self.prefill_id, self.entry_id
