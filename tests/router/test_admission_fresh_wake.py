"""Room that frees while a backfill chain is on its way goes to the head of the queue, not to
the waiter the chain woke (router/admission.py `_supersede_behind`).

CI once saw fifo serve request 6 before 3, 4 and 5 (tests/router/edge/test_tenants.py): the
state refresher's wake-up went down the full queue as a chain (each waiter finding no room
and passing it on), a release landed while the chain's next waiter was woken but had not run,
and the release's own wake-up went to the head — which the loop ran second, as it was woken
second. The chain's waiter took the room. Here the same turns, lined up exactly."""

from __future__ import annotations

import asyncio

import pytest

from policies.base import AdmissionCost, FairnessPolicy, Tenant, WaitingRequest
from policies.fairness import FifoFairness, VTCFairness
from router.admission import Admission, AdmissionSettings

COST = AdmissionCost(decode_block_s=100.0, prefill_tokens=100)


class Room:
    """Decode room as a count of requests it holds; `free_soon` frees one a loop turn later,
    as a release's answer landing between two waiters' turns."""

    def __init__(self) -> None:
        self.free = 0
        self.freed_at_turn_of: int | None = None

    def free_soon(self, admission: Admission) -> None:
        def land() -> None:
            self.free += 1
            admission.notify()  # what the release's `finish` does (router/request/holdings.py)

        asyncio.get_running_loop().call_soon(land)


async def _serve_in_order(policy: FairnessPolicy, free_during: int) -> tuple[list[int], int]:
    """Three waiters of one tenant; a wake-up goes down the full queue as a chain, and room
    frees while the waiter `free_during` passes it on. Returns the order in which the waiters
    got room, and how many tries found none."""
    admission = Admission(AdmissionSettings(), policy=policy)
    room, served, misses = Room(), [], 0
    deadline = asyncio.get_running_loop().time() + 10
    tenant = Tenant("t")

    async def waiter(ticket: int) -> None:
        nonlocal misses
        request = WaitingRequest(ticket, tenant, 0, COST)
        baton = await admission.wait(0, ticket, deadline, request)
        while True:
            assert baton, "a waiter ran past its deadline"
            if room.free:
                room.free -= 1
                admission.admitted(request)
                served.append(ticket)
                if admission.waiting:
                    admission.notify()  # as router/request/reserve.py does once it holds room
                return
            misses += 1
            if ticket == free_during and room.freed_at_turn_of is None:
                room.freed_at_turn_of = ticket
                room.free_soon(admission)  # lands after this turn, before the next waiter's
            admission.pass_on(0, ticket, baton - 1)
            baton = await admission.wait(0, ticket, deadline, request)

    tasks = [asyncio.create_task(waiter(t)) for t in range(3)]
    for _ in range(3):
        await asyncio.sleep(0)  # all three parked
    assert admission.waiting == 3
    admission.notify()  # the refresher's: no room yet, so it goes down the line
    for _ in range(50):
        await asyncio.sleep(0)
        if len(served) == 1:
            break
    room.free += 2  # the rest, so every waiter ends
    admission.notify()
    async with asyncio.timeout(5):
        await asyncio.gather(*tasks)
    return served, misses


@pytest.mark.parametrize("policy", [FifoFairness, VTCFairness], ids=["fifo", "vtc"])
@pytest.mark.parametrize("free_during", [0, 1])
async def test_room_freed_mid_chain_goes_to_the_head(
    policy: type[FairnessPolicy], free_during: int
) -> None:
    served, misses = await _serve_in_order(policy(), free_during)
    assert served == [0, 1, 2]
    # The chain was real: the head and the waiters up to the one the room freed under found
    # none before it freed.
    assert misses >= free_during + 1


async def test_a_pass_on_ahead_of_the_fresh_head_keeps_its_try() -> None:
    """Only waiters behind the fresh wake-up's head step back: one ahead of it (the head was
    itself awake, so the fresh wake-up went to the next) tries as it was woken to."""
    admission = Admission(AdmissionSettings())
    deadline = asyncio.get_running_loop().time() + 10
    woken: list[tuple[int, int]] = []

    async def wait(ticket: int) -> None:
        woken.append((ticket, await admission.wait(0, ticket, deadline)))

    tasks = [asyncio.create_task(wait(t)) for t in range(3)]
    await asyncio.sleep(0)
    admission.notify(4)  # 0 woken, and it has not run yet...
    admission.pass_on(0, 0, 3)  # ...yet passes it on (a test's shortcut): 1 woken by the chain
    admission.notify(4)  # fresh: 0 and 1 awake, it goes to 2, behind both
    async with asyncio.timeout(5):
        await asyncio.gather(*tasks)
    assert sorted(woken) == [(0, 4), (1, 3), (2, 4)]
