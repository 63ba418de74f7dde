"""Admit, estimate, place and reserve decode room (with the stranded-KV entry of a pulled pair).

Entry point: `Reserver.admit_and_reserve(call, info, seat, avoid)` returns an `Attempt` holding
a decode reservation, waiting in the admission queue while there is no room, or raises
`NoCapacity` / `Unavailable` (or a `StoreError`: no prefill is sent without a reservation in
hand). Every reservation is admitted by the fairness policy (router/admission.py `admitted`:
the seat's tenant is charged the estimate, `Seat.charge`, settled at its release by
router/request/lifecycle.py); a request that gives up leaves the queue (`withdraw`).
`estimate` builds the `RequestInfo` it places. What is reserved is owned from then on by its
holdings (router/request/holdings.py): its growth and its release are theirs. Whether it takes a
slot, places, waits or is refused is router/request/admit.py's decision (pure): the loop here
reads the facts it decides on and does what it says.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, replace

from policies.base import (
    Candidate,
    ClusterView,
    OutputEstimate,
    OutputLengthEstimator,
    PlacementPolicy,
    Rejection,
    RequestInfo,
    WaitingRequest,
    blocks_for,
)
from policies.fairness import admission_charge, estimate_cost
from policies.loras import lora_prefixes
from policies.overruns import LiveOverruns, OverrunMargin
from policies.tenant_classes import record_keys_of
from router.admission import Admission, QueueFull
from router.config import Settings
from router.errors import NoCapacity, NotInRotation
from router.fair_share import ClusterShare
from router.histograms import HistogramCache
from router.leases import LeaseKeeper
from router.metrics import RouterMetrics
from router.request.admit import (
    Forecast,
    Line,
    Miss,
    Refuse,
    Unavailable,
    after_miss,
    after_wait,
    never_fits,
    queue_refused,
    room_expected_in,
    turn,
)
from router.request.attempt import Ask, Attempt, Call
from router.request.holdings import Book, Reservation, StrandedEntry
from router.request.pairing import Pairing
from router.request.quota import within_block_limit
from router.request.seat import Seat
from router.workers.membership import Membership
from router.workers.placement_view import PlacementView
from router.workers.rotation import models_of, pool_alive, retry_after_s, why_empty
from state.base import StateStore, StoreError, StrandIntent

__all__ = ["Reserver", "Seat"]

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Reserver:
    """The reserve stage: what it needs of the replica, handed to it once."""

    settings: Settings
    store: StateStore
    members: Membership
    placement: PlacementView  # the snapshot placement decides on
    policy: PlacementPolicy
    estimator: OutputLengthEstimator
    histograms: HistogramCache
    overruns: LiveOverruns
    margin: OverrunMargin
    admission: Admission
    leases: LeaseKeeper
    metrics: RouterMetrics
    book: Book
    pairing: Pairing
    clock: Callable[[], float]
    # The cluster's fair share (router/fair_share.py): room left for a more under-served
    # tenant waiting on another replica. None: this replica's order is its own.
    share: ClusterShare | None = None
    # Reads the other replicas' reservations now if this replica's view of them is older than
    # a quiet refresh (router/workers/refresher.py `read_if_stale`); True if it read. None:
    # the view is taken as it is.
    fresh_usage: Callable[[], Awaitable[bool]] | None = None

    def __repr__(self) -> str:
        return f"Reserver(policy={self.policy.name}, estimator={self.estimator.name})"

    async def estimate(
        self,
        call: Call,
        ask: Ask,
        seat: Seat,
        *,
        whole_cap: bool = False,
        rest_of: tuple[RequestInfo, int] | None = None,
    ) -> RequestInfo:
        """What placement needs to know of the request, the output-length estimate included
        (`whole_cap`: the continuation of a preempted stream, whose estimate proved short,
        reserves its whole remaining cap instead: `whole_cap_estimate`; `rest_of`: the try it
        continues and the tokens that try relayed, for a stream taken back for others, which
        reserves the rest of that try's estimate: `rest_estimate`)."""
        hint = call.headers.get("X-Expected-Output-Tokens")
        # The choices' partial blocks are counted in the largest block size of the
        # decode workers, so the reservation is an upper bound wherever placement puts it.
        block_size = max(
            (w.spec.layout.block_size for w in self.members.decode_workers),
            default=16,
        )
        # A LoRA adapter's request is placed for its base model, on the workers that hold the
        # adapter or may load it (router/workers/loras.py); "": no adapter.
        model = call.parsed.model
        lora_base = self.placement.loras.known(model)
        info = RequestInfo(
            request_id=call.request_id,
            model=lora_base or model,
            lora=model if lora_base else "",
            prompt_tokens=ask.prompt_tokens,
            max_tokens=ask.max_tokens,
            arrival_s=call.started,
            priority=call.priority,
            # Under an adapter, its own prefix space (policies/loras.py).
            prefix_hashes=lora_prefixes(call.prefixes, model if lora_base else None),
            # A hint is advisory: one that is not a plain ASCII number (`²`, `①` pass isdigit()
            # but not int(); 5,000 digits pass neither) is ignored like a missing one, as
            # docs/policies.md says, rather than failing a request that is otherwise fine.
            hint_output_tokens=(
                int(hint) if hint and len(hint) <= 9 and hint.isascii() and hint.isdigit() else None
            ),
            hint_trusted=self.settings.estimates.trust_hints,
            n=call.parsed.n,
            block_size=block_size,
            # A named tenant is estimated on its own answers first (issue 31); `default` (no
            # tenants configured) on the shared classes, as before.
            tenant=seat.tenant.name,
        )
        if rest_of is not None:
            rest = rest_estimate(info, *rest_of)
            if rest is not None:
                return within_block_limit(rest, seat.tenant)
            whole_cap = True  # it had outgrown that estimate: as a growth's preemption
        if whole_cap:
            return within_block_limit(self.whole_cap_estimate(info), seat.tenant)
        return await self.estimated(info, seat)

    def whole_cap_estimate(self, info: RequestInfo) -> RequestInfo:
        """`info` reserving its whole remaining cap, but never more than the largest decode
        worker can hold beside its prompt (it must fit somewhere; past that it grows again).
        Its answer is recorded in the classes of the first estimate (`Seat.keyed`)."""
        room = max(
            (w.capacity_blocks * w.spec.layout.block_size for w in self.members.decode_workers),
            default=0,
        )
        fits = room - info.prompt_tokens - info.block_size  # a block of slack for the last one
        reserve = max(1, min(info.max_tokens, fits)) if room else info.max_tokens
        estimate = OutputEstimate(reserve, source="preempted: its whole remaining cap")
        return replace(info, estimate=estimate)

    async def estimated(self, info: RequestInfo, seat: Seat | None = None) -> RequestInfo:
        """`info` with the estimator's estimate from the statistics as they are now: the completed
        answers (shared by every replica) and this replica's live requests that outgrew their
        reservations (policies/overruns.py), so a class that overruns reserves more at once.
        A named tenant's own classes and the shared ones are read in the one call (a pipeline).
        With the request's `seat`, the classes its answer counts in are kept there for the
        reservation and the release, decided on the completed answers read here (a tenant
        feeds a shared class only up to its share: policies/tenant_classes.py)."""
        estimator = self.estimator
        keys = tuple(estimator.class_keys(info))
        completed = await self.histograms.get(keys)
        histograms = self.overruns.with_live(completed)
        estimated = replace(info, estimate=estimator.estimate(info, histograms))
        if seat is not None:
            # Within what its tenant may hold at once (issue 31): the hold never above it.
            estimated = within_block_limit(estimated, seat.tenant)
            seat.keyed(estimated, keys, record_keys_of(estimator, info, completed, keys))
        return estimated

    async def admit_and_reserve(
        self,
        call: Call,
        info: RequestInfo,
        seat: Seat,
        avoid: set[str],
        resume_by: float | None = None,
    ) -> Attempt:
        """Reserve decode room, waiting in the admission queue while there is none; the
        reservation is admitted by the fairness policy (charged to the seat's tenant).
        `resume_by` (the continuation of a preempted stream, whose client waits mid-stream):
        it waits for room until then (router clock), never refused early."""
        slo = self.settings.scaling
        # The order among tenants weighs what the request is expected to hold: its blocks for
        # its time to first token and its answer at one decode step each, the pools' SLOs.
        waiting = WaitingRequest(
            seat.ticket,
            seat.tenant.tenant,
            info.priority,
            estimate_cost(info, slo.itl_slo_s, slo.ttft_slo_s),
        )
        try:
            attempt = await self._admit_and_reserve(call, info, seat, avoid, waiting, resume_by)
        except BaseException:
            self.admission.withdraw(seat.ticket)  # out of the queue, whatever ended it
            raise
        # Charged what it is expected to hold, now that placement predicted its pace
        # (policies/fairness.py `admission_charge`); settled with the actual at its release.
        cand = attempt.candidate
        charged = admission_charge(
            info,
            cand.reserve_blocks,
            cand.predicted_ttft_s,
            cand.predicted_itl_s or slo.itl_slo_s,
        )
        seat.charge = self.admission.admitted(replace(waiting, cost=charged), cand.reserve_blocks)
        seat.reserved_at = self.clock()
        return attempt

    async def _admit_and_reserve(
        self,
        call: Call,
        info: RequestInfo,
        seat: Seat,
        avoid: set[str],
        waiting: WaitingRequest,
        resume_by: float | None = None,
    ) -> Attempt:
        """The admission loop: read the queue, the workers and the clock, ask the decision
        (router/request/admit.py, pure), do what it says (awaits, metrics), and again."""
        adm = self.admission
        loop = asyncio.get_running_loop()
        wait_by = (  # on the router's clock
            resume_by
            if resume_by is not None
            else min(
                call.started + adm.settings.max_wait_s, call.started + self.settings.timeouts.ttft_s
            )
        )
        wait_until = wait_by + (loop.time() - self.clock())  # on the loop's, as asyncio waits
        # One no decode worker could hold even empty, however short its answers: the client's
        # to change, at once (a 400, admit.py `never_fits`), not a 429 to retry in vain.
        if (too_large := never_fits(call.parsed, info, self.members.decode_workers)) is not None:
            raise too_large
        overruns_seen = self.overruns.version
        baton = 0  # what is left of the wake-up this request woke with (router/admission.py)
        while True:
            if overruns_seen != self.overruns.version:
                # A class overran while this request waited: size it on what is known now.
                overruns_seen = self.overruns.version
                info = await self.estimated(info, seat)
            step = turn(Line(seat.admitted, adm.has_slot(), adm.queue_first, adm.queued, baton))
            if step.enter:
                adm.enter()
                seat.admitted = True
            # The prompt's token ids (None where not tokenized): each worker's exact cached
            # prefix from its KV events (router/workers/placement_view.py).
            outcome = (
                step.held
                or self._left_for_another(waiting, info)
                or await self._try_reserve(
                    info, avoid, call.parsed.prompt_token_ids, seat.class_keys(self.estimator, info)
                )
            )
            if isinstance(outcome, Attempt):
                if adm.waiting:
                    adm.notify()  # there may be room for the next in line too
                return outcome
            miss = Miss(
                why=outcome,
                admitted=seat.admitted,
                in_line=step.in_line,
                baton=baton,
                patient=resume_by is not None,
                instant=adm.settings.mode == "instant",
                never_fits=self._never_fits(info),
                unavailable=self._not_in_rotation(info.model) or self._no_lora_pair(info),
                deadline=wait_until,
                now=loop.time(),
                door=adm.door(waiting.tenant),
            )
            decision = after_miss(miss)
            if isinstance(decision, Forecast):
                room_in = self._predicted_wait(info)
                decision = after_miss(replace(miss, room_in=room_in, now=loop.time()))
                assert not isinstance(decision, Forecast)  # asked once: it has the forecast
            if decision.pass_on:
                adm.pass_on(info.priority, seat.ticket, decision.pass_on)
            if isinstance(decision, Unavailable):
                raise decision.error
            if isinstance(decision, Refuse):
                raise self._refuse(seat, decision) from decision.cause
            try:
                self.metrics.admission_waiting.inc()
                try:
                    # Held at the concurrency cap, it waits for a slot, not for room.
                    for_room = seat.admitted
                    baton = await adm.wait(
                        info.priority, seat.ticket, decision.until, waiting, for_room
                    )
                finally:
                    self.metrics.admission_waiting.dec()
            except QueueFull as exc:
                raise self._refuse(seat, queue_refused(exc, outcome)) from exc
            if (refusal := after_wait(baton, outcome)) is not None:
                raise self._refuse(seat, refusal)

    def _left_for_another(self, waiting: WaitingRequest, info: RequestInfo) -> Rejection | None:
        """The room is left for a more under-served tenant waiting on another replica, for at
        most the hand-off's grace (router/fair_share.py); None: this request may take it."""
        share = self.share
        if share is None or self.admission.settings.mode == "instant":
            return None
        need = blocks_for(info.prompt_tokens + info.reserve_output_tokens, info.block_size)
        hold = share.hold_s(waiting.tenant, waiting.priority, waiting.cost, need)
        if hold is None:
            return None
        return Rejection(
            "the room that frees is left for a tenant below its share waiting on another "
            "router replica (the cluster's fair share)",
            max(1.0, hold),
        )

    def _refuse(self, seat: Seat, refusal: Refuse) -> NoCapacity:
        """The 429 to raise, counted by reason (and by the request's tenant)."""
        reason = refusal.reason
        self.metrics.rejections.labels(reason=reason).inc()
        self.metrics.tenant_rejections.labels(tenant=seat.tenant.name, reason=reason).inc()
        return NoCapacity(refusal.message, retry_after_s=refusal.retry_after_s)

    def _forecast(self, info: RequestInfo) -> dict[str, int]:
        """Prediction-based admission (Mooncake): blocks forecast to free on each decode worker
        by the time this request's prefill would finish."""
        speeds = [
            w.spec.perf.prefill_tokens_per_s()
            for w in self.members.prefill_workers
            if w.available and w.spec.perf is not None
        ] or [10_000.0]
        queued = min((w.queued_prompt_tokens for w in self.members.prefill_workers), default=0)
        horizon = (queued + info.prompt_tokens) / max(speeds)
        now = self.clock()
        return self.leases.freeing_by(now + horizon, now)

    def _predicted_wait(self, info: RequestInfo) -> float | None:
        """Seconds until a decode worker should have room for this request, read off the
        expected ends of this replica's reservations (router/request/admit.py
        `room_expected_in`), on the view placement sees; None when that cannot be told."""
        now = self.clock()
        view = self._with_margins(self.placement.snapshot(model=info.model, lora=info.lora))
        need_tokens = info.prompt_tokens + info.reserve_output_tokens
        return room_expected_in(
            need_tokens, view.decode, lambda worker: self.leases.ends_on(worker, now), now
        )

    def _with_margins(self, view: ClusterView) -> ClusterView:
        """The view with each decode worker's overrun margin held (policies/overruns.py): room kept
        back for the growth of answers longer than their estimates. A worker the shared view shows
        reserved past its capacity is such growth, seen by every replica: what the store holds,
        not the view's count, which adds this replica's reservations still on their way (a burst's
        pending blocks are no growth, and would close the worker to everyone)."""
        now = self.clock()
        workers = self.members.workers
        for d in view.decode:
            w = workers.get(d.worker_id)
            if w is not None and w.reserved_blocks > w.capacity_blocks:
                self.margin.observe(d.worker_id, w.reserved_blocks - w.capacity_blocks, now)
        decode = self.margin.held(view.decode, now)
        return view if decode is view.decode else replace(view, decode=decode)

    async def _try_reserve(
        self,
        info: RequestInfo,
        avoid: set[str],
        prompt_ids: Sequence[int] | None,
        classes: tuple[str, ...],
    ) -> Attempt | Rejection:
        outcome = await self._place_and_reserve(info, avoid, prompt_ids, classes)
        if (
            isinstance(outcome, Rejection)
            and self.fresh_usage is not None
            and await self.fresh_usage()
        ):
            # A quiet replica's view of the others' reservations may be from before its quiet
            # spell (it makes no reads then): not refused or queued on that, but on what the
            # store holds now. Only on a miss: a placement that fits costs nothing more.
            outcome = await self._place_and_reserve(info, avoid, prompt_ids, classes)
        return outcome

    async def _place_and_reserve(
        self,
        info: RequestInfo,
        avoid: set[str],
        prompt_ids: Sequence[int] | None,
        classes: tuple[str, ...],
    ) -> Attempt | Rejection:
        snapshot = self.placement.snapshot
        view = self._with_margins(
            snapshot(frozenset(avoid), info.model, prompt_token_ids=prompt_ids, lora=info.lora)
        )
        decision = self.policy.place(info, view)
        if isinstance(decision, Rejection) and avoid:
            # Avoiding the workers that failed this request left nowhere to go: a worker that
            # failed once may well serve the retry (its circuit breaker decides, not this).
            decision = self.policy.place(
                info,
                self._with_margins(
                    snapshot(model=info.model, prompt_token_ids=prompt_ids, lora=info.lora)
                ),
            )
        overbook: dict[str, int] = {}
        if isinstance(decision, Rejection) and self.admission.settings.mode == "predictive":
            overbook = self._forecast(info)
            if overbook:
                view = snapshot(
                    frozenset(avoid),
                    info.model,
                    freeing=overbook,
                    prompt_token_ids=prompt_ids,
                    lora=info.lora,
                )
                decision = self.policy.place(info, self._with_margins(view))
        if isinstance(decision, Rejection):
            return decision
        for cand in decision.candidates:
            attempt = await self._reserve(info, cand, overbook.get(cand.decode_id, 0), classes)
            if attempt is not None:
                if overbook:
                    self.metrics.admitted_on_forecast.inc()
                return attempt
            self.metrics.reserve_conflicts.inc()
        return Rejection(
            "every candidate decode worker filled up while reserving "
            "(other router replicas took the room)",
            1.0,
        )

    async def _reserve(
        self, info: RequestInfo, cand: Candidate, overbook: int, classes: tuple[str, ...]
    ) -> Attempt | None:
        """Reserve `cand`'s decode room, with its prefill's stranded-KV entry: one round trip
        before the prefill, none between its answer and the decode leg. None: the worker filled
        up meanwhile (another replica took the room)."""
        book = self.book
        # Ours alone (clients reuse X-Request-Id values): 128 random bits, unique across
        # replicas, without uuid4's object (0.5 us instead of 2.1).
        rid = os.urandom(16).hex()
        intent = self._strand_intent(info, rid, cand)
        with book.pending(cand.decode_id, cand.reserve_blocks):
            try:
                reserved = await self.store.reserve(
                    cand.decode_id,
                    rid,
                    cand.reserve_blocks,
                    self.settings.leases.reservation_s,
                    overbook_blocks=overbook,
                    intent=intent,
                )
            except (StoreError, asyncio.CancelledError):
                # No prefill is sent without a reservation in hand, so the request ends in a
                # 503 — or, cancelled (the client left while the script ran), ends.
                book.lost(cand.decode_id, rid, intent)
                raise
        if not reserved:
            book.refused(intent, reserved.stranded)
            return None
        # The n choices decode side by side: the answer lasts one choice's tokens.
        expected_end = (
            self.clock() + cand.predicted_ttft_s + info.reserve_choice_tokens * cand.predicted_itl_s
        )
        reservation = Reservation.hold(
            book,
            cand.decode_id,
            rid,
            cand.reserve_blocks,
            expected_end,
            grow_at_tokens=info.reserve_output_tokens,
            classes=classes,
            itl_s=cand.predicted_itl_s,
        )
        self.metrics.placements_by(cand.prefill_id or "local", cand.decode_id).inc()
        log.debug("placed on %s -> %s", cand.prefill_id or "local", cand.decode_id)
        attempt = Attempt(cand, reservation, info.prefix_hashes)
        if intent is not None:
            attempt.stranded = StrandedEntry.hold(book, intent, reserved.stranded)
        return attempt

    def _strand_intent(self, info: RequestInfo, rid: str, cand: Candidate) -> StrandIntent | None:
        """The stranded-KV entry the prefill of `cand` will leave, written with its
        reservation; None when no KV waits between the legs (router/request/pairing.py)."""
        if cand.prefill_id is None or not self.pairing.kv_waits(info.n, cand.prefill_id):
            return None
        t = self.settings.timeouts
        return StrandedEntry.intent(
            cand.prefill_id,
            info.request_id,
            rid,
            info.prompt_tokens * self.settings.kv_bytes_per_token,
            # The prefill answers (or is given up on) within its leg's timeout and the
            # request's time to first token: until then the reaper must not count its lease.
            min(t.prefill_s, t.ttft_s),
        )

    def _not_in_rotation(self, model: str = "") -> NotInRotation | None:
        """No worker in rotation on one side for the request's model, nor one on its way there
        (a role switch's drain): waiting for room is pointless, fail fast (503) saying what
        each worker of that side does instead (drained, serving the other role, probe failing:
        router/workers/rotation.py), with a Retry-After of when one may be back by itself
        (longer when only an operator can bring one back)."""
        pools = self.members
        for side in ("decode", "prefill"):
            if not pool_alive(pools, side, model):
                of = f" for {model}" if model and len(models_of(pools)) > 1 else ""
                return NotInRotation(
                    f"{side} worker{of}",
                    why_empty(pools, side, model),
                    retry_after_s=retry_after_s(pools, side, model),
                )
        return None

    def _no_lora_pair(self, info: RequestInfo) -> NotInRotation | None:
        """A LoRA request with no (prefill, decode) pair whose both sides hold its adapter or
        may load it (a decode worker that prefills itself counts as a pair): waiting is
        pointless, a 503 naming the adapter (docs/lora.md)."""
        if not info.lora:
            return None
        view = self.placement.snapshot(model=info.model, lora=info.lora)
        keys = {p.layout.key for p in view.prefill if p.healthy}
        if any(d.healthy and (d.can_prefill or d.layout.key in keys) for d in view.decode):
            return None
        return NotInRotation(
            f"prefill/decode pair for the LoRA adapter '{info.lora}'",
            "no pair in rotation has it on both sides, or may load it there",
            retry_after_s=self.settings.lora.poll_s,
        )

    def _never_fits(self, info: RequestInfo) -> bool:
        """Larger than any decode worker even when idle: waiting for room would be in vain."""
        need = info.prompt_tokens + info.reserve_output_tokens
        workers = list(self.members.decode_workers)
        # None at all in the decode pool (a `both` worker on its way there: _not_in_rotation let
        # it through) is not "too large": room comes with the worker.
        return bool(workers) and all(
            need > w.capacity_blocks * w.spec.layout.block_size for w in workers
        )


def rest_estimate(info: RequestInfo, before: RequestInfo, relayed: int) -> RequestInfo | None:
    """`info` (a continuation: the prompt and the text relayed so far) reserving what the try
    `before` still expected to decode: its reserved answer less the `relayed` tokens, within
    the continuation's remaining cap. So a stream taken back for the fair share or a class
    holds, resumed, the room it held (not its whole cap, which would make its tenant look over
    its share again). None when it had relayed that much already: its estimate proved short."""
    left = before.reserve_output_tokens - relayed
    if left < 1:
        return None
    estimate = OutputEstimate(
        min(left, info.max_tokens), source="taken back: the rest of its estimate"
    )
    return replace(info, estimate=estimate)
