"""Admit, estimate, place and reserve decode room; grow the reservation as an answer outgrows it.

Entry point: `admit_and_reserve(call, info, seat, avoid)` returns an `Attempt` holding a decode
reservation, waiting in the admission queue while there is no room, or raises `NoCapacity` /
`Unavailable` (or a `StoreError`: no prefill is sent without a reservation in hand). `estimate`
builds the `RequestInfo` it places; `grow` is the reservation's growth while the answer streams.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from dataclasses import replace

from policies.base import ClusterView, Rejection, RequestInfo, blocks_for, extra_choice_tokens
from router.admission import QueueFull
from router.errors import NoCapacity, Unavailable
from router.gateway import Gateway
from router.request.attempt import Ask, Attempt, Call, loop_time
from router.request.legs import hold_intent, strand_intent
from router.workers.rotation import models_of, pool_alive, retry_after_s, why_empty
from state.base import StoreError

__all__ = ["Seat", "admit_and_reserve", "estimate", "grow"]

log = logging.getLogger(__name__)


class Seat:
    """The request's place under the router's concurrency cap: its queue ticket, and whether it
    has entered (it leaves once, at the end: router/request/lifecycle.py `cleanup`)."""

    __slots__ = ("ticket", "admitted")

    def __init__(self, ticket: int) -> None:
        self.ticket = ticket
        self.admitted = False

    def __repr__(self) -> str:
        return f"Seat(ticket={self.ticket}, admitted={self.admitted})"


async def estimate(call: Call, ask: Ask) -> RequestInfo:
    """What placement needs to know of the request, the output-length estimate included."""
    gw = call.gw
    hint = call.headers.get("X-Expected-Output-Tokens")
    priority = call.parsed.body.get("priority")
    # The choices' partial blocks are counted in the largest block size of the
    # decode workers, so the reservation is an upper bound wherever placement puts it.
    block_size = max(
        (w.spec.layout.block_size for w in gw.pools.decode_workers),
        default=16,
    )
    info = RequestInfo(
        request_id=call.request_id,
        model=call.parsed.model,
        prompt_tokens=ask.prompt_tokens,
        max_tokens=ask.max_tokens,
        arrival_s=call.started,
        priority=priority if isinstance(priority, int) else 0,
        prefix_hashes=call.prefixes,
        # A hint is advisory: one that is not a plain ASCII number (`²`, `①` pass isdigit()
        # but not int(); 5,000 digits pass neither) is ignored like a missing one, as
        # docs/policies.md says, rather than failing a request that is otherwise fine.
        hint_output_tokens=(
            int(hint) if hint and len(hint) <= 9 and hint.isascii() and hint.isdigit() else None
        ),
        hint_trusted=gw.settings.trust_hints,
        n=call.parsed.n,
        block_size=block_size,
    )
    return await estimated(gw, info)


async def estimated(gw: Gateway, info: RequestInfo) -> RequestInfo:
    """`info` with the estimator's estimate from the statistics as they are now: the completed
    answers (shared by every replica) and this replica's live requests that outgrew their
    reservations (policies/overruns.py), so a class that overruns reserves more at once."""
    keys = gw.estimator.class_keys(info)
    histograms = gw.overruns.with_live(await gw.histograms.get(keys))
    return replace(info, estimate=gw.estimator.estimate(info, histograms))


async def admit_and_reserve(call: Call, info: RequestInfo, seat: Seat, avoid: set[str]) -> Attempt:
    """Reserve decode room, waiting in the admission queue while there is none."""
    gw, adm = call.gw, call.gw.admission
    wait_until = loop_time(
        gw, min(call.started + adm.settings.max_wait_s, call.started + gw.settings.timeouts.ttft_s)
    )
    overruns_seen = gw.overruns.version
    baton = 0  # what is left of the wake-up this request woke with (router/admission.py)
    while True:
        if overruns_seen != gw.overruns.version:
            # A class overran while this request waited: size it on what is known now.
            overruns_seen = gw.overruns.version
            info = await estimated(gw, info)
        if not seat.admitted and adm.has_slot():
            adm.enter()
            seat.admitted = True
        outcome: Attempt | Rejection = (
            await _try_reserve(gw, info, avoid)
            if seat.admitted
            else Rejection("the router is at its concurrency cap", 1.0)
        )
        if isinstance(outcome, Attempt):
            if adm.waiting:
                adm.notify()  # there may be room for the next in line too
            outcome.grow_at_tokens = info.reserve_output_tokens
            outcome.classes = tuple(gw.estimator.class_keys(info))
            return outcome
        if baton > 1:  # no room for this one: the next in line may be smaller
            adm.pass_on(info.priority, seat.ticket, baton - 1)
        baton = 0
        _check_pools_alive(gw, info.model)
        if adm.settings.mode == "instant" or _never_fits(gw, info):
            gw.metrics.rejections.labels(reason="no_room").inc()
            raise NoCapacity(outcome.reason, retry_after_s=outcome.retry_after_s)
        if seat.admitted:
            # Honest early refusal: waiting is pointless when the room is not expected to
            # free before the deadline; say when it is expected instead of waiting it out.
            room_in = _predicted_wait(gw, info)
            if room_in is not None and room_in > wait_until - asyncio.get_running_loop().time():
                gw.metrics.rejections.labels(reason="predicted_wait").inc()
                raise NoCapacity(
                    f"no decode room is expected before the request's deadline (room expected "
                    f"in about {room_in:.0f} s): {outcome.reason}",
                    retry_after_s=max(1.0, room_in),
                )
        try:
            gw.metrics.admission_waiting.inc()
            try:
                baton = await adm.wait(info.priority, seat.ticket, wait_until)
            finally:
                gw.metrics.admission_waiting.dec()
        except QueueFull as exc:
            gw.metrics.rejections.labels(reason="queue_full").inc()
            raise NoCapacity(
                f"{exc}; {outcome.reason}", retry_after_s=outcome.retry_after_s
            ) from exc
        if not baton:
            gw.metrics.rejections.labels(reason="deadline").inc()
            raise NoCapacity(
                f"no decode room before the request's deadline: {outcome.reason}",
                retry_after_s=outcome.retry_after_s,
            )


def _forecast(gw: Gateway, info: RequestInfo) -> dict[str, int]:
    """Prediction-based admission (Mooncake): blocks forecast to free on each decode worker
    by the time this request's prefill would finish."""
    speeds = [
        w.spec.perf.prefill_tokens_per_s()
        for w in gw.pools.prefill_workers
        if w.available and w.spec.perf is not None
    ] or [10_000.0]
    queued = min((w.queued_prompt_tokens for w in gw.pools.prefill_workers), default=0)
    horizon = (queued + info.prompt_tokens) / max(speeds)
    now = gw.clock()
    return gw.leases.freeing_by(now + horizon, now)


def _predicted_wait(gw: Gateway, info: RequestInfo) -> float | None:
    """Seconds until a decode worker should have room for this request, read off the expected
    ends of the reservations on it; None when that cannot be told: a worker has room now (the
    refusal was for another reason), or a worker short of room holds none of this replica's
    reservations with a known end (another replica's, or answers past their expected end).

    This replica knows only its own reservations' ends; other replicas behind the same load
    balancer serve the same mix, so each known end stands for its share of the worker's
    reservations (the store's reserved count over this replica's)."""
    now = gw.clock()
    view = _with_margins(gw, gw.pools.snapshot(model=info.model))
    need_tokens = info.prompt_tokens + info.reserve_output_tokens
    soonest: float | None = None
    for d in view.decode:
        if not d.healthy:
            continue
        short = blocks_for(need_tokens, d.layout.block_size) - d.free_blocks
        if short <= 0:
            return None
        ends = gw.leases.ends_on(d.worker_id, now)
        local = sum(blocks for _, blocks in ends)
        if local <= 0:
            return None
        share = max(1.0, d.reserved_blocks / local)
        freed = 0.0
        for end, blocks in ends:
            freed += blocks * share
            if freed >= short:
                soonest = end - now if soonest is None else min(soonest, end - now)
                break
        else:
            return None  # even every known end frees too little: the rest is unknown
    return soonest


def _with_margins(gw: Gateway, view: ClusterView) -> ClusterView:
    """The view with each decode worker's overrun margin held (policies/overruns.py): room kept
    back for the growth of answers longer than their estimates. A worker the shared view shows
    reserved past its capacity is such growth, seen by every replica: what the store holds,
    not the view's count, which adds this replica's reservations still on their way (a burst's
    pending blocks are no growth, and would close the worker to everyone)."""
    now = gw.clock()
    workers = gw.pools.workers
    for d in view.decode:
        w = workers.get(d.worker_id)
        if w is not None and w.reserved_blocks > w.capacity_blocks:
            gw.margin.observe(d.worker_id, w.reserved_blocks - w.capacity_blocks, now)
    decode = gw.margin.held(view.decode, now)
    return view if decode is view.decode else replace(view, decode=decode)


async def _try_reserve(gw: Gateway, info: RequestInfo, avoid: set[str]) -> Attempt | Rejection:
    pools = gw.pools
    view = _with_margins(gw, pools.snapshot(frozenset(avoid), info.model))
    decision = gw.policy.place(info, view)
    if isinstance(decision, Rejection) and avoid:
        # Avoiding the workers that failed this request left nowhere to go: a worker that
        # failed once may well serve the retry (its circuit breaker decides, not this).
        decision = gw.policy.place(info, _with_margins(gw, pools.snapshot(model=info.model)))
    overbook: dict[str, int] = {}
    if isinstance(decision, Rejection) and gw.admission.settings.mode == "predictive":
        overbook = _forecast(gw, info)
        if overbook:
            view = pools.snapshot(frozenset(avoid), info.model, freeing=overbook)
            decision = gw.policy.place(info, _with_margins(gw, view))
    if isinstance(decision, Rejection):
        return decision
    for cand in decision.candidates:
        rid = uuid.uuid4().hex  # ours alone: clients reuse X-Request-Id values
        # The prefill's stranded-KV entry goes with the reservation: one round trip before the
        # prefill, none between its answer and the decode leg.
        intent = strand_intent(gw, info, rid, cand)
        # Visible to placements made while the store call is under way (no await between
        # the decision and this line).
        gw.pools.note_pending(cand.decode_id, cand.reserve_blocks)
        try:
            reserved = await gw.store.reserve(
                cand.decode_id,
                rid,
                cand.reserve_blocks,
                gw.settings.reservation_lease_s,
                overbook_blocks=overbook.get(cand.decode_id, 0),
                intent=intent,
            )
        except (StoreError, asyncio.CancelledError):
            # The answer was lost, not necessarily the reservation (nor the intent): release
            # them later. No prefill is sent without a reservation in hand, so the request
            # ends in a 503 — or, cancelled (the client left while the script ran), ends.
            gw.leases.owe_release(cand.decode_id, rid)
            if intent is not None:
                gw.leases.owe_unstrand(intent.prefill_id, intent.request_id, intent.ready_within_s)
            raise
        finally:
            gw.pools.note_pending(cand.decode_id, -cand.reserve_blocks)
        if reserved:
            if overbook:
                gw.metrics.admitted_on_forecast.inc()
            gw.pools.note_reserved(cand.decode_id, cand.reserve_blocks)
            # The n choices decode side by side: the answer lasts one choice's tokens.
            expected_end = (
                gw.clock()
                + cand.predicted_ttft_s
                + info.reserve_choice_tokens * cand.predicted_itl_s
            )
            gw.leases.hold(cand.decode_id, rid, cand.reserve_blocks, expected_end)
            gw.metrics.placements.labels(
                prefill=cand.prefill_id or "local", decode=cand.decode_id
            ).inc()
            log.debug("placed on %s -> %s", cand.prefill_id or "local", cand.decode_id)
            attempt = Attempt(cand, rid)
            if intent is not None:
                hold_intent(gw, attempt, intent, reserved.stranded)
            return attempt
        if intent is not None and reserved.stranded:
            # A cluster wrote the intent beside the refusal: take it back, in the background
            # (the refusal is not the hot path, and the entry's id is this reservation's
            # alone, so no later write can be the one this clears).
            gw.tasks.job(gw.leases.unstrand(intent.prefill_id, intent.request_id), "unstrand")
        gw.metrics.reserve_conflicts.inc()
    return Rejection(
        "every candidate decode worker filled up while reserving "
        "(other router replicas took the room)",
        1.0,
    )


def _check_pools_alive(gw: Gateway, model: str = "") -> None:
    """No worker in rotation on one side for the request's model, nor one on its way there (a
    role switch's drain): waiting for room is pointless, fail fast (503) saying what each worker
    of that side does instead (drained, serving the other role, probe failing:
    router/workers/rotation.py), with a Retry-After of when one may be back by itself (longer when
    only
    an operator can bring one back)."""
    pools = gw.pools
    for side in ("decode", "prefill"):
        if not pool_alive(pools, side, model):
            of = f" for {model}" if model and len(models_of(pools)) > 1 else ""
            why = why_empty(pools, side, model) or "none is configured or registered"
            raise Unavailable(
                f"no {side} worker is in rotation{of}: {why}",
                retry_after_s=retry_after_s(pools, side, model),
                code="no_worker_in_rotation",
            )


def _never_fits(gw: Gateway, info: RequestInfo) -> bool:
    """Larger than any decode worker even when idle: waiting for room would be in vain."""
    need = info.prompt_tokens + info.reserve_output_tokens
    workers = list(gw.pools.decode_workers)
    # None at all in the decode pool (a `both` worker on its way there: _check_pools_alive let
    # it through) is not "too large": room comes with the worker.
    return bool(workers) and all(
        need > w.capacity_blocks * w.spec.layout.block_size for w in workers
    )


def grow(call: Call, attempt: Attempt, ask: Ask, tokens: int) -> None:
    """Grow the reservation as the answer outgrows it (never silently smaller than use): at
    `tokens` sent on this attempt of `ask`, start a growth in the background if one is due."""
    if tokens <= attempt.grow_at_tokens or attempt.decode_id is None or attempt.growing:
        return
    gw = call.gw
    worker = gw.pools.workers.get(attempt.decode_id)
    if worker is None:  # removed from the pools mid-stream: its release goes by id
        return
    if not attempt.overran:
        attempt.overran = True
        gw.metrics.reservation_overruns.inc()
    n = call.parsed.n
    # The answer is at least this long (one choice's, as estimated): its class's estimate
    # rises now, not when it completes (policies/overruns.py).
    gw.overruns.overran(attempt.reservation_id, attempt.classes, -(-(ask.resumed + tokens) // n))
    # Grow by a quarter at a time, so a long overrun costs a few store calls, not one a block.
    grow_at = max(tokens + 1, int(attempt.grow_at_tokens * 1.25))
    block = worker.spec.layout.block_size
    # `tokens` counts every choice's (the relay counts each choice's events), as the size
    # does: prompt + the choices' output + their own partial blocks (policies/base.py).
    extra = extra_choice_tokens(ask.prompt_tokens, call.parsed.n, block)
    new_blocks = blocks_for(ask.prompt_tokens + ask.resumed + grow_at + extra, block)
    attempt.growing = True
    # It ends later than expected: when the grown room should be written, at the pace placement
    # predicted (the n choices decode side by side). Early refusals read these ends.
    end = gw.clock() + (grow_at - tokens) / n * attempt.candidate.predicted_itl_s
    gw.tasks.job(_grow(call, attempt, new_blocks, grow_at, end), "grow-reservation")


async def _grow(call: Call, attempt: Attempt, blocks: int, grow_at: int, end: float) -> None:
    """Grow into free room if there is some, else past capacity: the tokens exist on the
    worker whatever the count says, and a count below use would let placement overfill it.
    A store failure leaves `grow_at_tokens` where it was, so the next token tries again."""
    gw = call.gw
    try:
        decode_id = attempt.decode_id
        if decode_id is None or blocks <= attempt.blocks:
            return
        rid = attempt.reservation_id
        grown = await gw.store.resize(decode_id, rid, blocks)
        if not grown:
            grown = await gw.store.resize(decode_id, rid, blocks, force=True)
            if grown:
                gw.metrics.reservation_forced_growth.inc()
                worker = gw.pools.workers.get(decode_id)
                if worker is not None:
                    # Admission counted on less than these sequences hold: keep the excess
                    # back from new placements there until the growth has room again.
                    past = worker.reserved_blocks + blocks - attempt.blocks
                    gw.margin.observe(decode_id, past - worker.capacity_blocks, gw.clock())
                log.info(
                    "request %s outgrew its reservation on %s, which has no free room: "
                    "grown past capacity to %d blocks (the tokens are there)",
                    call.request_id,
                    decode_id,
                    blocks,
                )
        # The store answered: the next growth waits for the next threshold. Not grown even
        # when forced means the store lost the reservation; the lease keeper puts it back,
        # at this size.
        attempt.grow_at_tokens = grow_at
        if attempt.decode_id == decode_id:  # not released meanwhile
            gw.leases.resized(rid, blocks, end)
            if grown:
                gw.pools.note_reserved(decode_id, blocks - attempt.blocks)
            attempt.blocks = blocks
    finally:
        attempt.growing = False
