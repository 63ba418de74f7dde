"""The admission queue's places shared by the tenants' weights (issue 31, item 2: queue
lock-out; policies/queue_shares.py, router/admission.py).

Before, one tenant keeping more requests open than `max_waiters` held every place of the
queue, and every request of any other tenant got `429 the admission queue is full`. Now:

- the rule, pure: in a full queue a request of a tenant below its share takes the place of the
  newest waiter of the tenant most over its share; one at or over its share is refused; a swap
  never undoes itself; one tenant alone is refused as before;
- the bookkeeping (router/admission.py): the evicted waiter's `wait` raises `QueueFull` with
  the reason `queue_share`, its place goes to the newcomer at once, the count stays at the cap;
- live: a router in front of simulated workers, `max_waiters` 16, tenant a holding more open
  requests than that with its clients sending the next as soon as one ends (or is refused), and
  tenant b of equal weight sending 10 requests: every one of b's is served (the old code
  refused them at the door), a's refusals and evictions counted by tenant and reason. Run on
  the in-memory store and on Redis: the queue is per replica, in its process, the same on both.
"""

from __future__ import annotations

import asyncio
import itertools
import re
from typing import Any

import openai
import pytest
from hypothesis import given
from hypothesis import strategies as st
from openai import AsyncOpenAI

from policies.base import AdmissionCost, Tenant, WaitingRequest
from policies.fairness import VTCFairness
from policies.queue_shares import queue_share, queue_share_victim
from router.admission import Admission, AdmissionSettings, QueueFull
from tests.conftest import MODEL, sim_cluster

# -- the rule ----------------------------------------------------------------------------------


def test_a_tenant_with_no_place_in_a_queue_one_tenant_filled_takes_one() -> None:
    assert queue_share_victim("b", 1.0, [("a", 16, 1.0)]) == "a"


def test_at_its_share_a_tenant_is_refused_and_a_swap_is_never_undone() -> None:
    assert queue_share_victim("b", 1.0, [("a", 9, 1.0), ("b", 7, 1.0)]) == "a"
    # After that swap both hold their share, 8 of 16: either one's next request is refused.
    assert queue_share_victim("b", 1.0, [("a", 8, 1.0), ("b", 8, 1.0)]) is None
    assert queue_share_victim("a", 1.0, [("a", 8, 1.0), ("b", 8, 1.0)]) is None
    # One place apart (an odd cap): the one ahead keeps it, the other does not take it back.
    assert queue_share_victim("b", 1.0, [("a", 8, 1.0), ("b", 7, 1.0)]) is None
    assert queue_share_victim("a", 1.0, [("a", 7, 1.0), ("b", 8, 1.0)]) is None


def test_one_tenant_alone_is_refused_as_before() -> None:
    assert queue_share_victim("default", 1.0, [("default", 1024, 1.0)]) is None
    assert queue_share_victim("default", 1.0, []) is None  # max_waiters 0


def test_shares_follow_the_weights_and_the_most_loaded_tenant_gives_way() -> None:
    # b weighs 3: its share of 16 places beside a is 12, a's 4.
    assert queue_share("b", 3.0, [("a", 16, 1.0)], 16) == 12.0
    assert queue_share_victim("b", 3.0, [("a", 5, 1.0), ("b", 11, 3.0)]) == "a"
    assert queue_share_victim("b", 3.0, [("a", 4, 1.0), ("b", 12, 3.0)]) is None
    assert queue_share_victim("a", 1.0, [("a", 4, 1.0), ("b", 12, 3.0)]) is None
    # a (4 / 1) is over its share, c (6 / 2) less so: a's newest waiter gives its place.
    assert queue_share_victim("b", 1.0, [("a", 4, 1.0), ("c", 6, 2.0)]) == "a"
    # Equal loads: the one holding more places, then the first name.
    assert queue_share_victim("b", 1.0, [("c", 3, 1.0), ("a", 6, 2.0)]) == "a"
    assert queue_share_victim("b", 1.0, [("c", 3, 1.0), ("a", 3, 1.0)]) == "a"


_HOLDINGS = st.dictionaries(
    st.sampled_from("abcdef"),
    st.tuples(st.integers(0, 40), st.sampled_from([0.5, 1.0, 2.0, 3.0])),
    min_size=1,
)


@given(_HOLDINGS, st.sampled_from("abcdefg"), st.sampled_from([0.5, 1.0, 2.0, 3.0]))
def test_below_its_share_a_tenant_always_gets_in_and_never_at_anothers_fair_place(
    held: dict[str, tuple[int, float]], arriving: str, weight: float
) -> None:
    if arriving in held:
        held[arriving] = (held[arriving][0], weight)
    holders = [(name, places, w) for name, (places, w) in held.items()]
    capacity = sum(places for _, places, _ in holders)  # the queue is full
    own = held.get(arriving, (0, weight))[0]
    victim = queue_share_victim(arriving, weight, holders)
    share = queue_share(arriving, weight, holders, capacity)
    if own + 1 <= share and capacity > 0:
        assert victim is not None  # below its share by a request: it gets in
    if victim is None:
        return
    places, victim_weight = held[victim]
    assert victim != arriving
    # The victim was over its share, and is never the one to take the place back.
    assert places > queue_share(victim, victim_weight, [*holders, (arriving, 1, weight)], capacity)
    after = dict(held)
    after[victim] = (places - 1, victim_weight)
    after[arriving] = (own + 1, weight)
    again = [(name, p, w) for name, (p, w) in after.items()]
    assert queue_share_victim(victim, victim_weight, again) != arriving


# -- the bookkeeping ----------------------------------------------------------------------------

A, B = Tenant("a"), Tenant("b")
_COST = AdmissionCost(100.0, 10)


async def _park(admission: Admission, ticket: int, tenant: Tenant) -> asyncio.Task[int]:
    """A waiter of `tenant` parked in the queue (nothing wakes it in these tests)."""
    deadline = asyncio.get_running_loop().time() + 60
    request = WaitingRequest(ticket, tenant, 0, _COST)
    task = asyncio.create_task(admission.wait(0, ticket, deadline, request))
    await asyncio.sleep(0)
    return task


@pytest.mark.parametrize("policy", [None, VTCFairness()], ids=["fifo", "vtc"])
async def test_a_full_queue_gives_the_newest_place_of_the_tenant_over_its_share(
    policy: VTCFairness | None,
) -> None:
    admission = Admission(AdmissionSettings(max_waiters=4), policy)
    a_waiters = [await _park(admission, t, A) for t in range(4)]
    assert admission.waiting == 4
    with pytest.raises(QueueFull) as refused:  # a holds every place: its next is refused
        await admission.wait(
            0, 10, asyncio.get_running_loop().time() + 60, WaitingRequest(10, A, 0, _COST)
        )
    assert refused.value.reason == "queue_full"
    b_first = await _park(admission, 20, B)
    # a's newest waiter gave its place; b's request holds it, the count is still the cap.
    with pytest.raises(QueueFull, match="queue share") as evicted:
        await a_waiters[3]
    assert evicted.value.reason == "queue_share"
    assert "tenant a " in str(evicted.value)
    assert not re.search(r"\bb\b", str(evicted.value))  # the other tenant is not named
    assert admission.waiting == 4 and admission.queued == 4
    assert not any(t.done() for t in (*a_waiters[:3], b_first))
    b_second = await _park(admission, 21, B)  # b: 2 of 4, its share
    with pytest.raises(QueueFull, match="queue share"):
        await a_waiters[2]
    req = WaitingRequest(22, B, 0, _COST)
    with pytest.raises(QueueFull, match="its share by weight is 2.0") as over:
        await admission.wait(0, 22, asyncio.get_running_loop().time() + 60, req)
    assert over.value.reason == "queue_full"
    # The fairness policy saw the evicted ones leave: what it picks is still waiting.
    admission.notify(budget=1)
    await asyncio.sleep(0)
    woken = [t for t in (*a_waiters[:2], b_first, b_second) if t.done()]
    assert len(woken) == 1 and woken[0].result() == 1
    for task in (*a_waiters[:2], b_first, b_second):
        task.cancel()
    await asyncio.gather(*a_waiters[:2], b_first, b_second, return_exceptions=True)
    admission.withdraw(woken[0] is b_first and 20 or 0)  # the woken one, as its caller would
    assert admission.waiting == 0 and admission.queued == 0


async def test_one_tenant_fills_the_queue_and_is_refused_as_before() -> None:
    admission = Admission(AdmissionSettings(max_waiters=3))
    deadline = asyncio.get_running_loop().time() + 60
    tasks = [
        asyncio.create_task(admission.wait(0, t, deadline, None)) for t in range(3)
    ]  # the anonymous `default` tenant, as with no tenants configured
    await asyncio.sleep(0)
    with pytest.raises(QueueFull, match=r"^the admission queue is full \(3 waiting\)$"):
        await admission.wait(0, 3, deadline, None)
    assert admission.waiting == 3 and not any(t.done() for t in tasks)
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    assert admission.waiting == 0


# -- live: the sequence of issue 31 ------------------------------------------------------------

KEY_A = "sk-queue-a-5e1d2c3b4a69788f7e6d"
KEY_B = "sk-queue-b-9a8b7c6d5e4f30211203"
MAX_WAITERS = 16
A_CLIENTS = MAX_WAITERS + 8  # more open requests than the queue has places
B_REQUESTS = 10

# One request reserves (~8 prompt + 64 output tokens) / 16 = 5 blocks: 3 run at once on 15.
_QUEUE: dict[str, Any] = {"max_waiters": MAX_WAITERS, "max_wait_s": 60}  # with its fairness
_CLUSTER: dict[str, Any] = {
    "kv_blocks": 15,
    "estimates": {"estimator": "max_tokens"},
    "tenants": [{"name": "a", "keys": [KEY_A]}, {"name": "b", "keys": [KEY_B]}],
    "timeouts": {"ttft_s": 60},
}


def _client(url: str, key: str) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=90)


async def _ask(client: AsyncOpenAI, text: str) -> str:
    resp = await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": text}], max_tokens=64
    )
    return resp.choices[0].message.content or ""


async def _flood(url: str, counts: dict[str, int], evicted: list[openai.RateLimitError]) -> None:
    """One of tenant a's clients: its next request as soon as the last one ends, answered or
    refused (a short pause after a refusal, so the flood does not spin the shared CPU)."""
    async with _client(url, KEY_A) as client:
        for i in itertools.count():
            try:
                await _ask(client, f"flood {i}")
                counts["served"] += 1
            except openai.RateLimitError as exc:
                counts["refused"] += 1
                if "queue share" in exc.message and "held more than" in exc.message:
                    evicted.append(exc)
                await asyncio.sleep(0.05)


def _rejections(gateway: Any, tenant: str, reason: str) -> float:
    counter = gateway.metrics.tenant_rejections.labels(tenant=tenant, reason=reason)
    value: float = counter._value.get()
    return value


@pytest.mark.parametrize(
    ("store", "fairness"), [("memory", "fifo"), ("redis", "fifo"), ("memory", "vtc")]
)
async def test_a_tenant_below_its_share_is_served_while_another_floods_the_queue(
    redis_prefix: str, store: str, fairness: str
) -> None:
    async with sim_cluster(
        redis_prefix=redis_prefix if store == "redis" else None,
        time_scale=100.0,
        admission={**_QUEUE, "fairness": fairness},
        **_CLUSTER,
    ) as c:
        admission = c.parts.admission
        counts = {"served": 0, "refused": 0}
        evicted: list[openai.RateLimitError] = []
        flood = [
            asyncio.create_task(_flood(c.router_url, counts, evicted)) for _ in range(A_CLIENTS)
        ]
        try:
            for _ in range(1500):  # up to 30 s on a loaded machine; usually a fraction of one
                if admission.waiting == MAX_WAITERS and counts["refused"] >= 4:
                    break
                await asyncio.sleep(0.02)
            assert admission.waiting == MAX_WAITERS, (admission, counts)  # a holds every place
            assert _rejections(c.parts, "a", "queue_full") >= 4

            # b: five clients of two requests each, one after the other (5 places of its 8).
            answers: list[str] = []

            async def tenant_b(first: int) -> None:
                async with _client(c.router_url, KEY_B) as client:
                    for i in range(first, first + 2):
                        answers.append(await _ask(client, f"b {i}"))

            await asyncio.gather(*(tenant_b(i) for i in range(0, B_REQUESTS, 2)))
        finally:
            for task in flood:
                task.cancel()
            await asyncio.gather(*flood, return_exceptions=True)
        assert len(answers) == B_REQUESTS and all(answers), answers
        assert _rejections(c.parts, "b", "queue_full") == 0
        assert _rejections(c.parts, "b", "queue_share") == 0
        # b's requests took places of a's newest waiters (counted for a, by reason), and a,
        # over its share, kept being refused while b waited.
        assert _rejections(c.parts, "a", "queue_share") >= 1
        assert evicted, counts  # the client whose waiter gave its place was told why, and when
        assert float(evicted[0].response.headers["Retry-After"]) >= 1
        assert evicted[0].status_code == 429 and evicted[0].code == "no_decode_capacity"
        assert counts["served"] > 0, counts
