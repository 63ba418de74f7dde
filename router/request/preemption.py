"""Preemption with exact resume: the enforcer of "no decode worker past its capacity, no tenant
past its block limit" once answers outgrow their estimates (issue 31).

A reservation is sized on an estimate; an answer that runs longer must grow it
(router/request/holdings.py `Reservation.grow`). Where the room is not there — the decode worker
is full, or the tenant's concurrent-blocks hold would pass its limit — growing anyway would
over-commit the worker (the engine then preempts and recomputes on its own, stalling every stream
on it) or let one tenant hold more than it may. Instead the router preempts a live stream:

    growth refused ──> Preemptor.choose (the rule: policies/preemption.py)
                   ──> each victim: its decode connection closed (the engine's abort signal,
                       vLLM and SGLang alike), its reservation and hold given back at its release
                   ──> its request resumes (router/request/lifecycle.py): prompt + the text the
                       client already has, re-prefilled, its whole remaining cap reserved,
                       waiting for room; the client sees a pause, never an error, a repeated or
                       a missing token, and its usage is one answer's
                   ──> the growth tries again into the freed room (or, with no victim to take,
                       is forced as before preemption existed: counted)

Only streams that can be resumed exactly are registered here: streamed, one choice, chat or
completions with a text prompt (router/request/respond.py `resumable`). Each replica knows only
its own streams: when it holds no other stream of the tenant on the worker, the growing stream
is its own victim.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from policies.fair_share import FAIR_SHARE, PRIORITY
from policies.preemption import StreamFacts, Victims, choose_victims
from router.config import PreemptionSettings
from router.metrics import RouterMetrics

__all__ = [
    "FAIR_SHARE",
    "OVER_LIMIT",
    "PRIORITY",
    "TAKEN_BACK",
    "LiveStream",
    "Preemptor",
    "Victims",
]

# Why a stream was taken back for others (router/request/fair_takeback.py; the reasons are the
# policy's). Such a stream had not outgrown its estimate.
TAKEN_BACK = frozenset({FAIR_SHARE, PRIORITY})

# Why a stream is stopped without resuming: its answer alone outgrew its tenant's whole block
# limit (router/request/lifecycle.py ends it with the limit's 429 frame).
OVER_LIMIT = "over_tenant_limit"

log = logging.getLogger(__name__)


class LiveStream:
    """One relayed decode stream that may be preempted: its reservation (by id), its worker, its
    tenant, when it was dispatched, how many times its request was preempted before, how to stop
    it, its request's priority class, and why it was stopped (None: it was not)."""

    __slots__ = (
        "reservation_id",
        "decode_id",
        "tenant",
        "dispatched",
        "preempted",
        "blocks",
        "cut",
        "priority",
        "reason",
    )

    def __init__(
        self,
        reservation_id: str,
        decode_id: str,
        tenant: str,
        dispatched: float,
        preempted: int,
        blocks: Callable[[], int],
        cut: Callable[[], None],
        priority: int = 0,
    ) -> None:
        self.reservation_id = reservation_id
        self.decode_id = decode_id
        self.tenant = tenant
        self.dispatched = dispatched
        self.preempted = preempted
        self.blocks = blocks  # what its reservation holds now (it grows)
        self.cut = cut
        self.priority = priority  # a more urgent class may take its room (fair_takeback.py)
        self.reason: str | None = None

    def __repr__(self) -> str:
        return (
            f"LiveStream({self.reservation_id[:8]}, {self.decode_id}, {self.tenant}, "
            f"class {self.priority})"
        )


class Preemptor:
    """This replica's live preemptible streams, and the rule that picks victims among them."""

    def __init__(self, settings: PreemptionSettings, metrics: RouterMetrics) -> None:
        self.settings = settings
        self.metrics = metrics
        self.live: dict[str, LiveStream] = {}  # reservation id -> its stream

    def __repr__(self) -> str:
        return f"Preemptor({len(self.live)} live)"

    @property
    def enabled(self) -> bool:
        return self.settings.enabled and self.settings.max_per_stream > 0

    def register(self, stream: LiveStream) -> None:
        """`stream` relays now."""
        self.live[stream.reservation_id] = stream

    def unregister(self, stream: LiveStream) -> None:
        self.live.pop(stream.reservation_id, None)

    def choose(
        self, grower_id: str, tenant: str, need_blocks: int, decode_id: str | None
    ) -> Victims:
        """The streams to preempt so that the growth of reservation `grower_id` (of `tenant`)
        finds `need_blocks` blocks: `decode_id`'s when the worker is full, None when the tenant
        is at its limit (policies/preemption.py has the rule). Empty: nothing may be."""
        if not self.enabled:
            return Victims((), False)
        facts = (
            StreamFacts(
                s.reservation_id,
                s.tenant,
                s.decode_id,
                s.dispatched,
                s.blocks(),
                s.preempted,
                s.priority,
            )
            for s in self.live.values()
            if s.reason is None
        )
        return choose_victims(
            facts, grower_id, tenant, need_blocks, decode_id, self.settings.max_per_stream
        )

    def preempt(self, victims: Victims, reason: str) -> None:
        """Stop each victim's decode (closing its connection: the engine aborts the sequence);
        its request's flow sees `reason` and resumes it once its room is given back."""
        for stream_id in victims.stream_ids:
            if self._cut(stream_id, reason, "preempting"):
                self.metrics.preemptions.labels(reason=reason).inc()

    def itself(self, reservation_id: str) -> Victims:
        """The stream of `reservation_id` alone, if it may still be preempted (live here, not
        stopped, under its bound); empty otherwise."""
        stream = self.live.get(reservation_id)
        if (
            not self.enabled
            or stream is None
            or stream.reason is not None
            or stream.preempted >= self.settings.max_per_stream
        ):
            return Victims((), False)
        return Victims((reservation_id,), True)

    def stop(self, reservation_id: str, reason: str) -> bool:
        """Stop the stream of `reservation_id` for good (`reason`: not a preemption, it does
        not resume); False when it is not a live stream here (not resumable, or ended)."""
        return self._cut(reservation_id, reason, "ending")

    def _cut(self, reservation_id: str, reason: str, doing: str) -> bool:
        """Mark the live stream of `reservation_id` stopped for `reason` and close its decode
        connection; False when it is not live here or was stopped already."""
        stream = self.live.get(reservation_id)
        if stream is None or stream.reason is not None:
            return False
        stream.reason = reason
        log.info(
            "%s the stream of reservation %s (tenant %s) on %s: %s",
            doing,
            reservation_id,
            stream.tenant,
            stream.decode_id,
            reason,
        )
        stream.cut()
        return True
