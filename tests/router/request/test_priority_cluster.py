"""Priority classes across two router replicas (issue 33; policies/fair_share.py
`take_back_for_class`, router/request/fair_takeback.py): simulated workers, one Redis key
prefix, the official `openai` client.

- a batch tenant's long streams fill the decode pool from replica 2; an interactive tenant's
  requests arriving on replica 1 do not wait for them to end: streams of the batch class are
  preempted for them (preemptions_total{reason="priority"}), their text is exact after the
  resume, nothing is left reserved;
- a tenant allowed only `default` that asks for `interactive` (header and body) gets no more
  than default: nothing is preempted for it, it waits for room like any default request;
- on one replica, under `fifo` and `vtc` alike, a request of a more urgent class (by its
  tenant's class name) is admitted before a less urgent one (asked by the header) that waited
  longer.

The batch tenant's weight is large, so it is never over its share of the pool: whatever is
preempted is the class's doing, not the share's (reason="fair_share" stays 0).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import orjson
import pytest
from openai import AsyncOpenAI

from disagg_tools.sim.textgen import expected_answer
from router.openai.api import CHAT
from tests.conftest import MODEL, SimCluster, sim_cluster
from tests.router.request.test_fair_share_cluster import two_replicas
from tests.router.request.test_faults import assert_quiet

LONG_TOKENS = 3000  # ~190 blocks: two streams hold 380 of the pool's 400, each ~8 s
SHORT_TOKENS = 400  # ~26 blocks: more than the 20 the two long streams leave


def _key(name: str) -> str:
    return f"sk-class-{name}-5e0b2d9c7a1f3486"


def _tenant(name: str, priority: str, weight: float = 1.0) -> dict[str, Any]:
    return {"name": name, "priority": priority, "weight": weight, "keys": [_key(name)]}


def _natural(max_tokens: int) -> dict[str, str]:
    """The simulated answer runs to its cap (the estimate, `max_tokens`, is then exact)."""
    return {"X-Sim-Output-Tokens": str(max_tokens)}


def _expected(content: str, max_tokens: int) -> str:
    body: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": content}]}
    body["max_tokens"] = max_tokens
    text, _, _ = expected_answer(CHAT, orjson.loads(orjson.dumps(body)), _natural(max_tokens))
    return text


class Streamed:
    """One streamed answer: its text, when its first token came and when it ended (the test's
    clock: only compared with each other, never with a bound)."""

    def __init__(self, content: str, max_tokens: int) -> None:
        self.content, self.max_tokens = content, max_tokens
        self.text = ""
        self.first = self.end = float("inf")

    @property
    def exact(self) -> bool:
        return self.text == _expected(self.content, self.max_tokens)


async def _stream(
    url: str, tenant: str, out: Streamed, headers: dict[str, str] | None = None, **extra: Any
) -> None:
    async with AsyncOpenAI(
        base_url=url + "/v1", api_key=_key(tenant), max_retries=0, timeout=120
    ) as client:
        stream = await client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": out.content}],
            max_tokens=out.max_tokens,
            stream=True,
            extra_headers={**_natural(out.max_tokens), **(headers or {})},
            extra_body=extra or None,
        )
        parts: list[str] = []
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                if not parts:
                    out.first = time.monotonic()
                parts.append(chunk.choices[0].delta.content)
    out.text = "".join(parts)
    out.end = time.monotonic()


def _counter(metric: Any, **labels: str) -> float:
    value: float = metric.labels(**labels)._value.get()
    return value


async def _filled(c: SimCluster, blocks: int) -> None:
    """Until the decode pool holds at least `blocks` reserved (the long streams are placed)."""
    for _ in range(400):
        if sum((await c.reserved_blocks()).values()) >= blocks:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"the long streams never held {blocks} blocks")


SETTINGS: dict[str, Any] = {
    "decode": 1,
    "kv_blocks": 400,
    "time_scale": 2.0,
    "admission": {"fairness": "vtc", "max_wait_s": 60},
    "estimates": {"estimator": "max_tokens"},
    "timeouts": {"ttft_s": 60},
}


async def test_an_interactive_request_preempts_batch_streams_across_replicas(
    redis_prefix: str,
) -> None:
    tenants = [_tenant("bulk", "batch", weight=100), _tenant("chat", "interactive")]
    async with two_replicas(redis_prefix, tenants=tenants, **SETTINGS) as (c, url2, r2):
        r1 = c.parts
        long = [Streamed(f"batch report {i}", LONG_TOKENS) for i in range(2)]
        short = [Streamed(f"quick question {i}", SHORT_TOKENS) for i in range(2)]
        async with asyncio.timeout(120):
            batch = [asyncio.create_task(_stream(url2, "bulk", s)) for s in long]
            await _filled(c, 2 * 180)
            await asyncio.gather(*(_stream(c.router_url, "chat", s) for s in short))
            await asyncio.gather(*batch)
        assert all(s.exact for s in short), [s.text[:40] for s in short]
        assert all(s.exact for s in long)  # preempted, resumed: the exact text all the same
        # Neither waited for a batch stream to end: the class took the room back.
        assert max(s.first for s in short) < min(s.end for s in long)
        taken = _counter(r2.metrics.preemptions, reason="priority")
        assert 1 <= taken <= 2 * 2  # each batch stream at most max_per_stream (2) times
        for parts in (r1, r2):
            assert _counter(parts.metrics.preemptions, reason="fair_share") == 0
        assert _counter(r1.metrics.preemptions, reason="priority") == 0  # no batch stream there
        await assert_quiet(c)
        assert not r1.requests.answering.preemptor.live
        assert not r2.requests.answering.preemptor.live


async def test_a_tenant_allowed_default_gets_no_more_by_asking_interactive(
    redis_prefix: str,
) -> None:
    tenants = [_tenant("bulk", "default", weight=100), _tenant("pushy", "default")]
    async with two_replicas(redis_prefix, tenants=tenants, **SETTINGS) as (c, url2, r2):
        r1 = c.parts
        long = [Streamed(f"default report {i}", LONG_TOKENS) for i in range(2)]
        pushy = Streamed("me first", SHORT_TOKENS)
        async with asyncio.timeout(120):
            filler = [asyncio.create_task(_stream(url2, "bulk", s)) for s in long]
            await _filled(c, 2 * 180)
            asks = {"X-Priority-Class": "interactive"}
            await _stream(c.router_url, "pushy", pushy, asks, priority=-1)
            await asyncio.gather(*filler)
        assert pushy.exact and all(s.exact for s in long)
        # Served as default: it waited for a default stream to end, none was preempted for it.
        assert pushy.first > min(s.end for s in long)
        for parts in (r1, r2):
            for reason in ("priority", "fair_share"):
                assert _counter(parts.metrics.preemptions, reason=reason) == 0
        await assert_quiet(c)


async def _waiting(c: SimCluster, n: int) -> None:
    """Until `n` requests wait in the replica's admission queue."""
    gauge = c.parts.metrics.admission_waiting
    for _ in range(400):
        if gauge._value.get() >= n:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"never {n} waiting")


@pytest.mark.parametrize("fairness", ["fifo", "vtc"])
async def test_a_more_urgent_class_is_admitted_first_by_its_name(
    redis_prefix: str, fairness: str
) -> None:
    tenants = [_tenant("bulk", "default", weight=100), _tenant("chat", "interactive")]
    settings = {**SETTINGS, "admission": {"fairness": fairness, "max_wait_s": 60}}
    async with sim_cluster(redis_prefix=redis_prefix, tenants=tenants, **settings) as c:
        long = [Streamed(f"holder {i}", LONG_TOKENS) for i in range(2)]
        later = Streamed("a batch job", LONG_TOKENS)  # ~190 blocks: it fits once one ends
        urgent = Streamed("a chat turn", SHORT_TOKENS)  # ~26: both do not fit then
        async with asyncio.timeout(120):
            holders = [asyncio.create_task(_stream(c.router_url, "bulk", s)) for s in long]
            await _filled(c, 2 * 180)
            batch = asyncio.create_task(
                _stream(c.router_url, "bulk", later, {"X-Priority-Class": "batch"})
            )
            await _waiting(c, 1)
            await _stream(c.router_url, "chat", urgent)
            await asyncio.gather(batch, *holders)
        assert urgent.exact and later.exact and all(s.exact for s in long)
        assert urgent.first < later.first  # came later, admitted first
        if fairness == "fifo":  # no take-back: it waited for a holder to end
            assert urgent.first > min(s.end for s in long)
            assert _counter(c.parts.metrics.preemptions, reason="priority") == 0
        else:  # vtc: a default holder preempted for it
            assert _counter(c.parts.metrics.preemptions, reason="priority") >= 1
        await assert_quiet(c)


async def test_a_request_held_at_the_concurrency_cap_preempts_nothing(redis_prefix: str) -> None:
    """Hostile to the take-back: an interactive request waits on replica 1 only for its
    concurrency slot (cap 1, held by a batch stream there), while batch streams fill the pool.
    Preempting one would give it nothing (no slot frees: the preempted stream keeps its own), so
    nothing is preempted for it; it is served once the slot frees, its text exact."""
    tenants = [_tenant("bulk", "batch", weight=100), _tenant("chat", "interactive")]
    settings = {**SETTINGS, "admission": {**SETTINGS["admission"], "max_inflight": 1}}
    async with two_replicas(redis_prefix, tenants=tenants, **settings) as (c, url2, r2):
        r1 = c.parts
        here, there = Streamed("batch here", LONG_TOKENS), Streamed("batch there", LONG_TOKENS)
        urgent = Streamed("a chat turn at the cap", SHORT_TOKENS)
        async with asyncio.timeout(120):
            batch = [
                asyncio.create_task(_stream(c.router_url, "bulk", here)),
                asyncio.create_task(_stream(url2, "bulk", there)),
            ]
            await _filled(c, 2 * 180)
            await _stream(c.router_url, "chat", urgent)
            await asyncio.gather(*batch)
        assert urgent.exact and here.exact and there.exact
        assert urgent.first > here.end  # it waited for the slot, not for room
        for parts in (r1, r2):
            for reason in ("priority", "fair_share"):
                assert _counter(parts.metrics.preemptions, reason=reason) == 0
        await assert_quiet(c)
