"""The admission decision, apart from I/O: what a request that needs decode room does next.

router/request/reserve.py `_admit_and_reserve` is the loop that runs it: it reads the queue
(router/admission.py), the workers and the clock into frozen facts, asks here, does what it is
told (takes a slot, places and reserves, passes a wake-up on, waits, refuses) and asks again.
Nothing here awaits, reads a clock, calls the store or counts a metric: facts in, a decision
out, so the rules are tested as functions (tests/router/request/test_admit.py), as the
policies are.

Each pass of the loop asks up to three questions:

1. `turn(Line)`, before placement. A request without a concurrency slot takes one when one is
   free, and is held ("at its concurrency cap") when none is. Under an order that is not fifo
   (`queue_first`: every admission must be seen by the order while something waits) a request
   the queue did not wake is held while others are queued ("N requests wait ... before it"):
   it tries when the queue wakes it. Under fifo an arrival that finds room may go before the
   waiters (a small request fits where the head does not). Otherwise it places (`Turn.held`
   None): the placement policy and the store, the loop's to run.
2. `after_miss(Miss)`, when it got no room (placement's `Rejection`, or the hold's). First the
   wake-up it woke with goes on to the next in line, with what is left of it (`pass_on`); then,
   in this order:
   - no worker in rotation on one side for its model: a 503 (`Unavailable`), waiting is vain;
   - refused at once, `no_room` (placement's reason and Retry-After): admission mode `instant`,
     or larger than any decode worker even when idle — never a patient request (`patient`: the
     continuation of a preempted stream, whose client waits mid-stream);
   - refused early, `predicted_wait`: an admitted request that tried, not patient, whose room
     is not expected before its deadline (said with when it is: `Forecast` asks the loop for
     that forecast, `room_expected_in`, read only when it decides);
   - past its deadline: refused, `deadline` (or, when the queue is full, at its door);
   - else it waits in the queue until woken or its deadline (`Wait`).
3. `after_wait`: woken (a budget >= 1) it goes round again; the deadline passed (0), refused
   `deadline`. A wait the queue refuses (`QueueFull`: full, or its place given to a tenant
   below its share) is refused with the queue's reason (`queue_refused`).

Every refusal is a 429 (`Refuse`) with a reason the metrics count it by, a message that ends
with why there was no room, and a Retry-After.

**A request that can never fit** on any decode worker (`never_fits`, asked once before the loop)
is no 429 to retry but a 400 at once.

The rule (issue 31, item 6b): a request never fits when even the smallest reservation the router
could ever make for it does not fit the largest decode worker serving its model, empty: its
prompt, plus each of its `n` choices' own copy of the prompt's last partial block and one output
token (the estimate at its floor). Counted per worker in that worker's block size, as
`RequestInfo.reserve_output_tokens` counts a reservation (policies/base.py).

Not the reservation the router would make now (the estimator's upper quantile per choice, or
`max_tokens` while it has no history): that one shrinks as the estimator learns (or with a
trusted `X-Expected-Output-Tokens` hint), and an answer may then outgrow it, counted past
capacity (docs/policies.md, overruns) — even one forced long by `ignore_eos`. A request over
capacity by its estimate alone is still refused at once, with the 429 that says when to retry
(router/request/reserve.py `_never_fits`).

The 400 names what to change: the prompt when one token after it does not fit, else `n`.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from policies.base import DecodeView, Rejection, RequestInfo, blocks_for, extra_choice_tokens
from router.admission import QueueFull
from router.errors import InvalidRequest, NotInRotation
from router.openai.api import CHAT, RESPONSES, ParsedRequest
from router.workers.worker_state import WorkerState

__all__ = [
    "UNASKED",
    "Forecast",
    "Line",
    "Miss",
    "Refuse",
    "Turn",
    "Unavailable",
    "Wait",
    "after_miss",
    "after_wait",
    "never_fits",
    "queue_refused",
    "room_expected_in",
    "turn",
]


class _Unasked(enum.Enum):
    UNASKED = "not forecast yet"


UNASKED = _Unasked.UNASKED  # `Miss.room_in` before the loop was asked for it (`Forecast`)


@dataclass(frozen=True, slots=True)
class Line:
    """The queue as the request finds it at the top of a pass."""

    admitted: bool  # it holds a concurrency slot
    slot_free: bool  # the router is under its concurrency cap
    queue_first: bool  # the order sees every admission while something waits (not fifo)
    queued: int  # requests in the queue's order: parked, or woken and trying
    baton: int  # what is left of the wake-up it woke with; 0: not woken


@dataclass(frozen=True, slots=True)
class Turn:
    """What the pass does before placement: take a slot (`enter`), then place (`held` None) or
    not (`held`: why not, as a rejection); `in_line`: held for the queue's order."""

    enter: bool
    held: Rejection | None
    in_line: bool


def turn(line: Line) -> Turn:
    admitted = line.admitted or line.slot_free
    in_line = line.queue_first and not line.baton and line.queued > 0
    held: Rejection | None = None
    if not admitted:
        held = Rejection("the router is at its concurrency cap", 1.0)
    elif in_line:
        held = Rejection(f"{line.queued} requests wait for decode room before it", 1.0)
    return Turn(enter=admitted and not line.admitted, held=held, in_line=in_line)


@dataclass(frozen=True, slots=True)
class Miss:
    """The request got no room this pass: what decides whether it waits."""

    why: Rejection  # placement's rejection, or the turn's hold
    admitted: bool  # it holds a concurrency slot
    in_line: bool  # it was held for the queue's order (`Turn.in_line`)
    baton: int  # the wake-up it woke with (0: not woken)
    patient: bool  # a preempted stream's continuation: waits until its deadline
    instant: bool  # admission mode `instant`: no waiting at all
    never_fits: bool  # larger than every decode worker even idle, by its estimate
    unavailable: NotInRotation | None  # no worker in rotation on a side for its model
    deadline: float  # event-loop time
    now: float  # event-loop time, read for this decision
    door: QueueFull | None  # the refusal of a full queue to one that may take no one's place
    room_in: float | None | _Unasked = UNASKED  # seconds until room is expected; None: unknown


@dataclass(frozen=True, slots=True)
class Forecast:
    """Asks the loop when room is expected (`room_expected_in`, into `Miss.room_in`)."""


@dataclass(frozen=True, slots=True)
class Wait:
    """Wait in the queue until woken or `until` (event-loop time), after passing `pass_on` of
    the wake-up on to the next in line (0: nothing to pass)."""

    until: float
    pass_on: int


@dataclass(frozen=True, slots=True)
class Refuse:
    """A 429: `reason` is what the metrics count it by; `cause` the queue's own refusal."""

    reason: str
    message: str
    retry_after_s: float
    pass_on: int = 0
    cause: QueueFull | None = None


@dataclass(frozen=True, slots=True)
class Unavailable:
    """A 503: no worker in rotation to wait for."""

    error: NotInRotation
    pass_on: int


MissDecision = Forecast | Wait | Refuse | Unavailable


def after_miss(miss: Miss) -> MissDecision:
    why = miss.why
    # No room for this one: the next in line may be smaller (router/admission.py `pass_on`).
    pass_on = miss.baton - 1 if miss.baton > 1 else 0
    if miss.unavailable is not None:
        return Unavailable(miss.unavailable, pass_on)
    if not miss.patient and (miss.instant or miss.never_fits):
        return Refuse("no_room", why.reason, why.retry_after_s, pass_on)
    if miss.admitted and not miss.in_line and not miss.patient:
        # Honest early refusal: waiting is pointless when the room is not expected to free
        # before the deadline; say when it is expected instead of waiting it out.
        if miss.room_in is UNASKED:
            return Forecast()
        room_in = miss.room_in
        if room_in is not None and room_in > miss.deadline - miss.now:
            return Refuse(
                "predicted_wait",
                f"no decode room is expected before the request's deadline (room expected in "
                f"about {room_in:.0f} s): {why.reason}",
                max(1.0, room_in),
                pass_on,
            )
    if miss.deadline <= miss.now:
        # The queue would not take it (router/admission.py `wait`): it would take a place only
        # to leave it, and a full queue refuses it at the door before its deadline is looked at.
        if miss.door is not None:
            return queue_refused(miss.door, why, pass_on)
        return _past_deadline(why, pass_on)
    return Wait(miss.deadline, pass_on)


def after_wait(baton: int, why: Rejection) -> Refuse | None:
    """What a wait that ended with `baton` comes to: woken (None: go round again), or the
    deadline (0). `why`: the rejection the request waited on."""
    return None if baton else _past_deadline(why, 0)


def queue_refused(full: QueueFull, why: Rejection, pass_on: int = 0) -> Refuse:
    """The queue refused the request (full, or its place given to a tenant below its share:
    router/admission.py), which waited on `why`."""
    return Refuse(full.reason, f"{full}; {why.reason}", why.retry_after_s, pass_on, cause=full)


def _past_deadline(why: Rejection, pass_on: int) -> Refuse:
    message = f"no decode room before the request's deadline: {why.reason}"
    return Refuse("deadline", message, why.retry_after_s, pass_on)


def room_expected_in(
    need_tokens: int,
    decode: Sequence[DecodeView],
    ends_on: Callable[[str], Sequence[tuple[float, int]]],
    now: float,
) -> float | None:
    """Seconds until a decode worker of `decode` should have room for `need_tokens`, read off
    the expected ends (`ends_on(worker)`: this replica's reservations there, soonest first, as
    (end, blocks)); None when that cannot be told: a worker has room now (the refusal was for
    another reason), or a worker short of room holds none of this replica's reservations with a
    known end (another replica's, or answers past their expected end).

    This replica knows only its own reservations' ends; other replicas behind the same load
    balancer serve the same mix, so each known end stands for its share of the worker's
    reservations (the store's reserved count over this replica's)."""
    soonest: float | None = None
    for d in decode:
        if not d.healthy:
            continue
        short = blocks_for(need_tokens, d.layout.block_size) - d.free_blocks
        if short <= 0:
            return None
        ends = ends_on(d.worker_id)
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


# A request that can never fit (the module docstring's last part): a 400 naming what to change.
_PROMPT_PARAMS = ("messages", "prompt", "input")


def _blocks(prompt: int, n: int, block_size: int) -> int:
    """KV blocks `prompt` and `n` choices of one token each hold (policies/base.py)."""
    return blocks_for(prompt + n + extra_choice_tokens(prompt, n, block_size), block_size)


def never_fits(
    parsed: ParsedRequest, info: RequestInfo, decode_workers: Iterable[WorkerState]
) -> InvalidRequest | None:
    """The 400 for a request that cannot fit on any of `decode_workers` even when it is empty
    (the module docstring), or None. None too when that cannot be told: no decode worker for
    the model (room comes with a worker), or one whose KV layout is not known yet."""
    workers = [
        w for w in decode_workers if not w.spec.layout.model or w.spec.layout.model == info.model
    ]
    if not workers or not all(w.layout_known for w in workers):
        return None
    prompt, n = info.prompt_tokens, max(1, info.n)

    def fits(choices: int) -> bool:
        return any(
            _blocks(prompt, choices, w.spec.layout.block_size) <= w.capacity_blocks for w in workers
        )

    if fits(n):
        return None
    largest = max(workers, key=lambda w: w.capacity_blocks * w.spec.layout.block_size)
    size = largest.spec.layout.block_size
    if not fits(1):
        param = (
            "messages" if parsed.path == CHAT else "input" if parsed.path == RESPONSES else "prompt"
        )
        why, need = f"its prompt (about {prompt} tokens) and one token", _blocks(prompt, 1, size)
    else:
        param, need = "n", _blocks(prompt, n, size)
        why = f"its prompt and {n} choices, each with its own last prompt block and one token"
    return InvalidRequest(
        f"This request can never fit on a decode worker: it needs at least {need} KV blocks of "
        f"{size} tokens for {why}, and the largest decode worker holds {largest.capacity_blocks} "
        f"blocks even when empty. {'Shorten' if param in _PROMPT_PARAMS else 'Lower'} "
        f"'{param}'.",
        param=param,
        code="exceeds_decode_capacity",
    )
