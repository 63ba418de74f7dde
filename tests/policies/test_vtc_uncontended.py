"""Regression (issue 25, the live flood): service taken while nothing waits is not held against
a tenant. The live router admits a request that finds room and an empty queue without queueing
it; such an admission used to charge the tenant's counter without moving the class's floor
(VTC's "last to leave"), so a tenant that started to wait later was lifted only to where the
last *waiter* had left it, and the tenant that had been served alone lost every admission
until the newcomer had caught up with all of that service (live: the victim, alone for 40 s,
got nothing for the first ~13 s of the aggressor's flood; docs/benchmarks.md, "Live flood")."""

from __future__ import annotations

import asyncio
from collections import Counter

from policies.base import AdmissionCost, Tenant, WaitingRequest
from policies.fairness import VTCFairness
from router.admission import Admission, AdmissionSettings

COST = AdmissionCost(decode_block_s=100.0, prefill_tokens=100)
EARLY, LATE = Tenant("early"), Tenant("late")


def test_service_while_nothing_waits_is_not_banked_by_a_late_tenant() -> None:
    """`early` is admitted 200 times around an empty queue; then both tenants wait with ten
    requests each. They take turns from the first pick, not `late` ten times first."""
    policy = VTCFairness()
    tickets = iter(range(10_000))
    for _ in range(200):
        policy.admit(WaitingRequest(next(tickets), EARLY, 0, COST))
    for tenant in (LATE, EARLY):
        for _ in range(10):
            policy.enqueue(WaitingRequest(next(tickets), tenant, 0, COST))
    order = []
    while (chosen := policy.pick(0.0)) is not None:
        order.append(chosen.tenant.name)
        policy.admit(chosen)
    assert Counter(order[:4]) == {"early": 2, "late": 2}, order
    assert policy.counter("early") == policy.counter("late")


def test_the_floor_follows_a_lone_tenant_admitted_without_waiting() -> None:
    policy = VTCFairness()
    for ticket in range(5):
        policy.admit(WaitingRequest(ticket, EARLY, 0, COST))
    policy.enqueue(WaitingRequest(5, LATE, 0, COST))
    assert policy.counter("late") == policy.counter("early") == 5 * 200.0


async def test_the_router_queue_serves_both_after_a_solo_run() -> None:
    """The same through router/admission.py, as the live router does it: `early` admitted
    on its first try (`admitted` without `wait`), then both wait; each wake-up is one room."""
    admission = Admission(AdmissionSettings(max_waiters=100), VTCFairness())
    for ticket in range(200):
        admission.admitted(WaitingRequest(ticket, EARLY, 0, COST))
    deadline = asyncio.get_running_loop().time() + 30
    served: list[str] = []
    admitted = asyncio.Event()

    async def wait(ticket: int, tenant: Tenant) -> None:
        request = WaitingRequest(ticket, tenant, 0, COST)
        assert await admission.wait(0, ticket, deadline, request) > 0
        served.append(tenant.name)
        admission.admitted(request)
        admitted.set()

    tasks = [asyncio.create_task(wait(1000 + i, LATE)) for i in range(6)]
    tasks += [asyncio.create_task(wait(2000 + i, EARLY)) for i in range(6)]
    await asyncio.sleep(0)
    for _ in range(12):
        admitted.clear()
        admission.notify(budget=1)
        await admitted.wait()
    await asyncio.gather(*tasks)
    assert Counter(served[:4]) == {"early": 2, "late": 2}, served


def test_a_refund_does_not_lower_the_floor_for_later_tenants() -> None:
    """The side effect of the floor following lone admissions (found in the simulator: 1,000
    tenants, 630 never admitted in a minute instead of ~170; docs/benchmarks.md, "Tenants under
    a flood"). A lone admission sets the floor at its *estimate*; `first` then starts to wait,
    is lifted to that floor, and its request settles at a tenth of the estimate: the refund
    puts it below the floor. `late`, who starts to wait after that refund, must be lifted as
    far as `early`, who started before it: the floor does not follow the refund down."""
    policy = VTCFairness()
    first, early, late = Tenant("first"), Tenant("early"), Tenant("late")
    charge = policy.admit(WaitingRequest(0, first, 0, COST))  # alone: the floor is at 200
    policy.admit(WaitingRequest(1, early, 0, COST))  # alone: the floor is at 400
    for ticket in range(10, 20):
        policy.enqueue(WaitingRequest(ticket, early, 0, COST))
    policy.enqueue(WaitingRequest(20, first, 0, COST))
    assert policy.counter("first") == policy.counter("early") == 400.0
    policy.settle(charge, AdmissionCost(decode_block_s=10.0, prefill_tokens=10))
    assert policy.counter("first") == 400.0 - 180.0  # its refund is its own
    for ticket in range(30, 40):
        policy.enqueue(WaitingRequest(ticket, late, 0, COST))
    assert policy.counter("late") == policy.counter("early") == 400.0
    policy.withdraw(20)
    order = []
    while (chosen := policy.pick(0.0)) is not None:
        order.append(chosen.tenant.name)
        policy.admit(chosen)
    assert Counter(order[:4]) == {"early": 2, "late": 2}, order
