"""Room taken back is the waiter's it was taken for (issue 33; router/admission.py `earmark`,
called by router/request/fair_takeback.py for a waiter on its own replica).

The take-back chooses by each tenant's occupancy (blocks held against its share); the queue's
order (vtc) by its served counters. The two can disagree: a paced victim lifted to the floor
when it starts to wait is not behind the flooder by counters, though it holds far less. In the
simulator, only ~21 % of the room taken back for the victim reached it; the rest went to the
order's next, most often the flooder. An earmark wakes the earmarked tenant's oldest waiter
first, until one of its requests is admitted or the mark expires."""

from __future__ import annotations

import asyncio

from policies.base import Tenant, WaitingRequest
from policies.fairness import VTCFairness
from router.admission import Admission, AdmissionSettings
from tests.policies.test_tenant_queues import _COST, _park

FLOODER, VICTIM = Tenant("flooder"), Tenant("victim")


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


async def _woken(tasks: dict[int, asyncio.Task[int]]) -> list[int]:
    await asyncio.sleep(0)
    return [t for t, task in tasks.items() if task.done()]


async def _close(admission: Admission, tasks: dict[int, asyncio.Task[int]]) -> None:
    for task in tasks.values():
        task.cancel()
    await asyncio.gather(*tasks.values(), return_exceptions=True)
    for ticket in tasks:
        admission.withdraw(ticket)


async def test_an_earmarked_tenant_is_woken_before_the_orders_next_until_admitted() -> None:
    clock = Clock()
    admission = Admission(AdmissionSettings(), VTCFairness(), clock=clock)
    # The flooder waited first; by the order (equal counters, older ticket) it goes first.
    tasks = {t: await _park(admission, t, FLOODER) for t in (1, 2)}
    tasks[3] = await _park(admission, 3, VICTIM)
    admission.notify(budget=1)
    first = await _woken(tasks)
    assert first != [3]  # without a mark the order's pick is not the victim
    admission.withdraw(first[0])  # (its caller leaves the queue)
    tasks.pop(first[0])

    admission.earmark(0, "victim", 0.2)
    admission.notify(budget=1)
    assert await _woken(tasks) == [3]
    # Woken, it found the room not free yet (the preempted stream's release is on its way):
    # the wake-up is not passed on, or the order's next, the flooder, would take the room.
    admission.pass_on(0, 3, 1)
    assert await _woken(tasks) == [3]
    # It waits again, and the release's wake-up is its.
    tasks[3] = await _park(admission, 3, VICTIM)
    admission.notify(budget=1)
    assert await _woken(tasks) == [3]
    # Admitted, the mark is spent.
    admission.admitted(WaitingRequest(3, VICTIM, 0, _COST))
    assert not admission._earmarks
    await _close(admission, tasks)


async def test_an_earmark_expires_and_one_without_a_waiter_changes_nothing() -> None:
    clock = Clock()
    admission = Admission(AdmissionSettings(), VTCFairness(), clock=clock)
    tasks = {t: await _park(admission, t, FLOODER) for t in (1, 2)}
    admission.earmark(0, "victim", 0.2)  # no victim waits here: the order's pick
    admission.notify(budget=1)
    assert await _woken(tasks) == [1]
    tasks[3] = await _park(admission, 3, VICTIM)
    admission.withdraw(1)
    tasks.pop(1).cancel()
    clock.now += 0.3  # expired: the order again
    admission.notify(budget=1)
    assert await _woken(tasks) == [2]
    assert not admission._earmarks
    await _close(admission, tasks)


async def test_once_the_mark_lapses_a_failed_wake_up_is_passed_on() -> None:
    """The hold is bounded by the mark: an earmarked waiter that still finds no room after it
    lapses passes its wake-up on as any waiter does (the room is not left idle)."""
    clock = Clock()
    admission = Admission(AdmissionSettings(), VTCFairness(), clock=clock)
    tasks = {1: await _park(admission, 1, FLOODER), 3: await _park(admission, 3, VICTIM)}
    admission.earmark(0, "victim", 0.2)
    admission.notify(budget=2)
    assert await _woken(tasks) == [3]
    clock.now += 0.3
    admission.pass_on(0, 3, 1)
    assert sorted(await _woken(tasks)) == [1, 3]
    await _close(admission, tasks)
