"""The admission decision as pure functions (router/request/admit.py): frozen facts in, a decision
out, run by router/request/reserve.py `_admit_and_reserve`.

- properties over every state hypothesis draws: a refusal carries a known reason, a message
  ending with why there was no room, and a positive Retry-After; past its deadline a request
  never waits; a patient request (a preempted stream's continuation) is never refused early;
  a 503 comes before any 429; the wake-up's rest goes on exactly once; under a fair order
  (`queue_first`) a request the queue did not wake never places while others are queued, and a
  request with a slot that is first places; the same state always gets the same decision;
- a reference model: the decision agrees with the rules as the loop spelled them out inline
  before they were drawn out of it (transcribed below from the code of a323b9a);
- examples that pin today's messages and Retry-Afters, the forecast's arithmetic, and the full
  queue's door (`Admission.door`) against the refusal a real `Admission.wait` raises.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from policies.base import AdmissionCost, DecodeView, KVLayout, Rejection, Tenant, WaitingRequest
from router.admission import Admission, AdmissionSettings, QueueFull
from router.errors import NotInRotation
from router.request.admit import (
    Forecast,
    Line,
    Miss,
    Refuse,
    Turn,
    Unavailable,
    Wait,
    after_miss,
    after_wait,
    queue_refused,
    room_expected_in,
    turn,
)

REASONS = {"no_room", "predicted_wait", "deadline", "queue_full", "queue_share"}

rejections = st.builds(
    Rejection,
    st.text(min_size=1, max_size=30).filter(str.strip),
    st.floats(min_value=0.001, max_value=600.0),
)
lines = st.builds(
    Line,
    admitted=st.booleans(),
    slot_free=st.booleans(),
    queue_first=st.booleans(),
    queued=st.integers(0, 50),
    baton=st.integers(0, 8),
)
_UNAVAILABLE = NotInRotation("decode worker", "w0: drained", retry_after_s=5.0)
_FULL = QueueFull("the admission queue is full (4 waiting)")
_SHARE = QueueFull("the admission queue is full (4 waiting) and tenant a ...", "queue_share")
_NO_COST = AdmissionCost(0.0, 0)
times = st.floats(min_value=0.0, max_value=1_000.0)
forecasts = st.none() | st.floats(min_value=0.0, max_value=1_000.0)
misses = st.builds(
    Miss,
    why=rejections,
    admitted=st.booleans(),
    in_line=st.booleans(),
    baton=st.integers(0, 8),
    patient=st.booleans(),
    instant=st.booleans(),
    never_fits=st.booleans(),
    unavailable=st.sampled_from([None, _UNAVAILABLE]),
    deadline=times,
    now=times,
    door=st.sampled_from([None, _FULL]),
)


def decided(miss: Miss, forecast: float | None) -> Wait | Refuse | Unavailable:
    """The decision as the loop takes it: asked again with the forecast when it asks for one."""
    decision = after_miss(miss)
    if isinstance(decision, Forecast):
        decision = after_miss(replace(miss, room_in=forecast))
        assert not isinstance(decision, Forecast), "a forecast is asked for once"
    return decision


# -- properties ---------------------------------------------------------------------------------


@settings(max_examples=400, deadline=None, database=None)
@given(miss=misses, forecast=forecasts)
def test_a_refusal_says_why_and_when_to_come_back(miss: Miss, forecast: float | None) -> None:
    decision = decided(miss, forecast)
    if isinstance(decision, Refuse):
        assert decision.reason in REASONS
        assert decision.message.endswith(miss.why.reason)
        assert decision.retry_after_s > 0
        if decision.reason == "predicted_wait":
            assert decision.retry_after_s >= 1.0


@settings(max_examples=400, deadline=None, database=None)
@given(miss=misses, forecast=forecasts)
def test_past_its_deadline_a_request_never_waits(miss: Miss, forecast: float | None) -> None:
    decision = decided(miss, forecast)
    if miss.now >= miss.deadline:
        assert not isinstance(decision, Wait), decision
    if isinstance(decision, Wait):
        assert decision.until == miss.deadline > miss.now


@settings(max_examples=400, deadline=None, database=None)
@given(miss=misses, forecast=forecasts)
def test_a_patient_request_is_never_refused_early(miss: Miss, forecast: float | None) -> None:
    patient = replace(miss, patient=True)
    assert not isinstance(after_miss(patient), Forecast)
    decision = decided(patient, forecast)
    if isinstance(decision, Refuse):
        assert decision.reason not in ("no_room", "predicted_wait")
        assert patient.now >= patient.deadline  # only at its deadline (or the queue's door)


@settings(max_examples=400, deadline=None, database=None)
@given(miss=misses, forecast=forecasts)
def test_no_worker_in_rotation_is_a_503_before_any_429(miss: Miss, forecast: float | None) -> None:
    decision = decided(replace(miss, unavailable=_UNAVAILABLE), forecast)
    assert isinstance(decision, Unavailable) and decision.error is _UNAVAILABLE


@settings(max_examples=400, deadline=None, database=None)
@given(miss=misses, forecast=forecasts)
def test_what_is_left_of_the_wake_up_goes_on(miss: Miss, forecast: float | None) -> None:
    decision = decided(miss, forecast)
    assert decision.pass_on == max(0, miss.baton - 1)


@settings(max_examples=400, deadline=None, database=None)
@given(miss=misses, forecast=forecasts)
def test_the_forecast_is_asked_for_only_when_it_decides(miss: Miss, forecast: float | None) -> None:
    asks = isinstance(after_miss(miss), Forecast)
    assert asks == (
        miss.unavailable is None
        and not miss.patient
        and not miss.instant
        and not miss.never_fits
        and miss.admitted
        and not miss.in_line
    )
    assert not isinstance(after_miss(replace(miss, room_in=forecast)), Forecast)


@settings(max_examples=400, deadline=None, database=None)
@given(miss=misses, forecast=forecasts, line=lines)
def test_the_same_state_gets_the_same_decision(
    miss: Miss, forecast: float | None, line: Line
) -> None:
    assert decided(miss, forecast) == decided(replace(miss), forecast)
    assert turn(line) == turn(replace(line))


@settings(max_examples=400, deadline=None, database=None)
@given(line=lines)
def test_under_a_fair_order_one_not_woken_never_places_ahead_of_the_queue(line: Line) -> None:
    step = turn(line)
    if line.queue_first and line.baton == 0 and line.queued > 0:
        assert step.held is not None and step.in_line
    if step.held is None:  # it places: it holds a slot, and it is first in line
        assert line.admitted or line.slot_free
        assert not line.queue_first or line.baton > 0 or line.queued == 0


@settings(max_examples=400, deadline=None, database=None)
@given(line=lines)
def test_with_a_slot_and_first_in_line_it_places(line: Line) -> None:
    step = turn(line)
    has_slot = line.admitted or line.slot_free
    first = not line.queue_first or line.baton > 0 or line.queued == 0
    assert (step.held is None) == (has_slot and first)
    assert step.enter == (not line.admitted and line.slot_free)  # a slot is taken once


@settings(max_examples=200, deadline=None, database=None)
@given(baton=st.integers(0, 8), why=rejections)
def test_a_wait_ends_woken_or_refused_at_the_deadline(baton: int, why: Rejection) -> None:
    refusal = after_wait(baton, why)
    if baton:
        assert refusal is None
    else:
        assert refusal is not None and refusal.reason == "deadline"
        assert refusal.retry_after_s == why.retry_after_s


# -- the rules as the loop spelled them out before (a323b9a's reserve.py) -------------------------


def _before(miss: Miss, forecast: float | None) -> tuple[object, ...]:
    """What the inline loop did with a miss: (kind, reason, message, Retry-After, passed on).
    Its wait refused at once past the deadline: at a full queue's door, else with 0."""
    outcome, baton = miss.why, miss.baton
    passed = baton - 1 if baton > 1 else 0
    if miss.unavailable is not None:
        return ("503", passed)
    if not miss.patient and (miss.instant or miss.never_fits):
        return ("no_room", outcome.reason, outcome.retry_after_s, passed)
    if miss.admitted and not miss.in_line and not miss.patient:
        room_in = forecast
        if room_in is not None and room_in > miss.deadline - miss.now:
            message = (
                f"no decode room is expected before the request's deadline (room "
                f"expected in about {room_in:.0f} s): {outcome.reason}"
            )
            return ("predicted_wait", message, max(1.0, room_in), passed)
    if miss.door is not None and miss.deadline <= miss.now:
        return (miss.door.reason, f"{miss.door}; {outcome.reason}", outcome.retry_after_s, passed)
    if miss.deadline <= miss.now:
        message = f"no decode room before the request's deadline: {outcome.reason}"
        return ("deadline", message, outcome.retry_after_s, passed)
    return ("wait", miss.deadline, passed)


def _now(decision: Wait | Refuse | Unavailable) -> tuple[object, ...]:
    if isinstance(decision, Unavailable):
        return ("503", decision.pass_on)
    if isinstance(decision, Wait):
        return ("wait", decision.until, decision.pass_on)
    if decision.reason == "no_room":
        return ("no_room", decision.message, decision.retry_after_s, decision.pass_on)
    return (decision.reason, decision.message, decision.retry_after_s, decision.pass_on)


@settings(max_examples=600, deadline=None, database=None)
@given(miss=misses, forecast=forecasts)
def test_the_decision_is_the_loops_rules_as_they_were(miss: Miss, forecast: float | None) -> None:
    assert _now(decided(miss, forecast)) == _before(miss, forecast)


# -- examples -----------------------------------------------------------------------------------

_WHY = Rejection("no decode worker has 40 free blocks", 2.5)
_MISS = Miss(
    why=_WHY,
    admitted=True,
    in_line=False,
    baton=3,
    patient=False,
    instant=False,
    never_fits=False,
    unavailable=None,
    deadline=100.0,
    now=70.0,
    door=None,
)


def test_the_holds_before_placement_say_why() -> None:
    capped = turn(Line(admitted=False, slot_free=False, queue_first=False, queued=0, baton=0))
    assert capped == Turn(False, Rejection("the router is at its concurrency cap", 1.0), False)
    in_line = turn(Line(admitted=False, slot_free=True, queue_first=True, queued=3, baton=0))
    held = Rejection("3 requests wait for decode room before it", 1.0)
    assert in_line == Turn(True, held, True)  # it takes its slot, and waits its turn
    # fifo: an arrival that finds room goes before the waiters.
    assert turn(Line(True, False, queue_first=False, queued=3, baton=0)).held is None
    # Woken by the queue: it tries.
    assert turn(Line(True, False, queue_first=True, queued=3, baton=2)).held is None


def test_refused_at_once_in_instant_mode_with_placements_reason() -> None:
    assert after_miss(replace(_MISS, instant=True)) == Refuse("no_room", _WHY.reason, 2.5, 2)
    assert after_miss(replace(_MISS, never_fits=True, baton=0)) == Refuse(
        "no_room", _WHY.reason, 2.5, 0
    )


def test_refused_early_when_room_is_not_expected_before_the_deadline() -> None:
    assert after_miss(_MISS) == Forecast()
    late = after_miss(replace(_MISS, room_in=42.4))
    assert late == Refuse(
        "predicted_wait",
        "no decode room is expected before the request's deadline (room expected in about "
        f"42 s): {_WHY.reason}",
        42.4,
        2,
    )
    assert after_miss(replace(_MISS, room_in=29.0)) == Wait(100.0, 2)  # in time: it waits
    assert after_miss(replace(_MISS, room_in=None)) == Wait(100.0, 2)  # unknown: it waits
    soon = after_miss(replace(_MISS, room_in=0.2, now=100.5))
    assert isinstance(soon, Refuse) and soon.retry_after_s == 1.0  # never under a second


def test_past_the_deadline_refused_or_at_a_full_queues_door() -> None:
    past = replace(_MISS, admitted=False, now=100.0)
    assert after_miss(past) == Refuse(
        "deadline", f"no decode room before the request's deadline: {_WHY.reason}", 2.5, 2
    )
    assert after_miss(replace(past, door=_FULL)) == Refuse(
        "queue_full", f"{_FULL}; {_WHY.reason}", 2.5, 2, cause=_FULL
    )
    # Before its deadline a full queue is the wait's to settle (it may give it a place).
    assert after_miss(replace(_MISS, admitted=False, door=_FULL)) == Wait(100.0, 2)
    assert queue_refused(_SHARE, _WHY) == Refuse(
        "queue_share", f"{_SHARE}; {_WHY.reason}", 2.5, 0, cause=_SHARE
    )


def _view(worker: str, free: int, reserved: int, healthy: bool = True) -> DecodeView:
    layout = KVLayout(block_size=16)
    return DecodeView(worker, layout, free + reserved, reserved_blocks=reserved, healthy=healthy)


def test_room_is_expected_when_enough_known_ends_free_it() -> None:
    ends = {"d0": [(102.0, 2), (105.0, 2)], "d1": [(101.0, 8)]}
    need = 6 * 16  # 6 blocks
    # d0: 2 short, holds 4 of this replica's 4: its first end frees them, in 2 s.
    assert room_expected_in(need, [_view("d0", 4, 4)], ends.__getitem__, 100.0) == 2.0
    # 4 short: both its ends; but when d0 holds 8 reserved and this replica 4 of them, each
    # end stands for twice its blocks (the other replicas' share): the first.
    assert room_expected_in(need + 32, [_view("d0", 4, 4)], ends.__getitem__, 100.0) == 5.0
    assert room_expected_in(need + 32, [_view("d0", 4, 8)], ends.__getitem__, 100.0) == 2.0
    # 6 short: every known end frees too little, the rest is unknown.
    assert room_expected_in(need + 64, [_view("d0", 4, 4)], ends.__getitem__, 100.0) is None
    both = [_view("d0", 4, 4), _view("d1", 0, 8)]
    assert room_expected_in(need, both, ends.__getitem__, 100.0) == 1.0  # the soonest
    # A healthy worker with room now: the refusal was for another reason.
    assert room_expected_in(need, [*both, _view("d2", 6, 0)], ends.__getitem__, 100.0) is None
    assert room_expected_in(need, [_view("d2", 6, 0, healthy=False)], ends.get, 100.0) is None
    # Short of room, none of this replica's reservations there: it cannot be told.
    assert room_expected_in(need, [_view("d3", 0, 8)], lambda _: [], 100.0) is None


async def test_a_full_queues_door_is_the_refusal_its_wait_gives_past_the_deadline() -> None:
    admission = Admission(AdmissionSettings(max_waiters=1))
    tenant = Tenant("b")
    assert admission.door(tenant) is None
    now = asyncio.get_running_loop().time()
    holder = WaitingRequest(0, Tenant("a"), 0, _NO_COST)
    parked = asyncio.create_task(admission.wait(0, 0, now + 60, holder))
    await asyncio.sleep(0)
    door = admission.door(tenant)
    assert door is not None and door.reason == "queue_full"
    late = WaitingRequest(1, tenant, 0, _NO_COST)
    try:
        await admission.wait(0, 1, now - 1, late)
    except QueueFull as refused:
        assert str(refused) == str(door) and refused.reason == door.reason
    else:
        raise AssertionError("a full queue let a request past its deadline in")
    assert not parked.done()  # past its deadline it took no one's place
    parked.cancel()
