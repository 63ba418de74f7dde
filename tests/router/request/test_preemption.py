"""Preemption with exact resume (issue 31; router/request/preemption.py): a router in front of
simulated workers, on the session's real Redis, called with the official `openai` client.

- a stream the router preempts mid-way (forced by the test setting) resumes with exactly the
  text and usage the same request gets unpreempted, on the other decode worker or the same one;
  no breaker pays, no retry is spent, nothing stays reserved;
- the hostile sequence of the issue at small size: a tenant that poisoned its own estimate with
  4-token answers then streams long ones never holds more than its block limit, the decode
  worker is never reserved past its capacity (no forced growth, no engine preemption), another
  tenant's wide requests are served, every text is exact, and only the poisoner's streams are
  preempted.
"""

from __future__ import annotations

import asyncio
from typing import Any

import openai
import orjson
import pytest
from openai import AsyncOpenAI

from disagg_tools.sim.textgen import expected_answer
from policies.preemption import StreamFacts, choose_victims
from router.openai.api import CHAT
from tests.conftest import MODEL, sim_cluster

KEY_QC = "sk-preempt-qc-5e4d3c2b1a0f9e8d"
KEY_V = "sk-preempt-v-0a1b2c3d4e5f6a7b"
TENANTS = [
    {"name": "qc", "keys": [KEY_QC], "max_reserved_blocks": 100},
    {"name": "v", "keys": [KEY_V]},
]


def _client(url: str, key: str = "unused") -> AsyncOpenAI:
    return AsyncOpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=120)


def _counter(metric: Any, **labels: str) -> float:
    value: float = (metric.labels(**labels) if labels else metric)._value.get()
    return value


async def _stream(
    url: str, key: str, content: str, max_tokens: int, natural: int | None
) -> tuple[str, Any]:
    """The streamed answer's text and its usage (stream_options include_usage); the answer
    opens with one role event, however many times it was resumed."""
    headers = {} if natural is None else {"X-Sim-Output-Tokens": str(natural)}
    async with _client(url, key) as client:
        stream = await client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": content}],
            max_tokens=max_tokens,
            stream=True,
            stream_options={"include_usage": True},
            extra_headers=headers,
        )
        text, usage, roles = [], None, 0
        async for chunk in stream:
            roles += bool(chunk.choices and chunk.choices[0].delta.role)
            if chunk.choices and chunk.choices[0].delta.content:
                text.append(chunk.choices[0].delta.content)
            if chunk.usage is not None:
                usage = chunk.usage
    assert roles == 1, f"{roles} role events in one answer"
    return "".join(text), usage


def _expected(content: str, max_tokens: int, natural: int | None) -> str:
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}]}
    body["max_tokens"] = max_tokens
    headers = {} if natural is None else {"X-Sim-Output-Tokens": str(natural)}
    text, _, _ = expected_answer(CHAT, orjson.loads(orjson.dumps(body)), headers)
    return text


async def _quiet(c: Any) -> None:
    """Nothing reserved, no hold, no live preemptible stream, once the releases landed."""
    for _ in range(100):
        reserved = await c.reserved_blocks()
        if not any(reserved.values()) and not c.parts.requests.quota.holds:
            break
        await asyncio.sleep(0.05)
    assert not any(reserved.values()), reserved
    assert not c.parts.requests.quota.holds
    assert not c.parts.requests.answering.preemptor.live


async def test_a_preempted_stream_resumes_with_the_exact_text_and_usage(
    redis_prefix: str,
) -> None:
    content = "tell me a long story about preemption"
    async with sim_cluster(redis_prefix=redis_prefix, decode=2, time_scale=50.0) as plain:
        want_text, want_usage = await _stream(plain.router_url, "unused", content, 120, 90)
    assert want_text == _expected(content, 120, 90)
    async with sim_cluster(
        redis_prefix=redis_prefix,
        decode=2,
        time_scale=50.0,
        preemption={"force_after_tokens": 30},
    ) as c:
        metrics = c.parts.metrics
        text, usage = await _stream(c.router_url, "unused", content, 120, 90)
        assert text == want_text
        assert usage is not None and want_usage is not None
        assert (usage.prompt_tokens, usage.completion_tokens) == (
            want_usage.prompt_tokens,
            want_usage.completion_tokens,
        )
        assert _counter(metrics.preemptions, reason="forced") == 1
        assert _counter(metrics.preempted_tokens) >= 30
        assert _counter(metrics.resumes) == 0  # a preemption is not a broken stream
        assert _counter(metrics.retries, side="decode") == 0
        # Not the worker's fault: every decode breaker stays closed.
        assert all(w.breaker.state == "closed" for w in c.parts.pools.decode_workers)
        await _quiet(c)


async def test_a_poisoned_tenant_is_held_to_its_limit_and_the_worker_to_its_capacity(
    redis_prefix: str,
) -> None:
    """Issue 31, reproduction 1 at small size. `qc` (limit 100 blocks) teaches its estimate
    4-token answers for max_tokens 1,000, then streams eight answers of 300 tokens at once
    (~19 blocks each: 152 in all); `v` sends two requests of n = 2 under the same cap (~38
    blocks each). One decode worker of 200 blocks. Before issue 31 every one of them was
    admitted on the poisoned 4-token estimate and grown past capacity (228 blocks reserved)."""
    capacity = 200
    async with sim_cluster(
        redis_prefix=redis_prefix,
        kv_blocks=capacity,
        time_scale=100.0,
        tenants=TENANTS,
        estimates={"estimator": "online_quantile", "estimator_args": {"min_samples": 5}},
        loops={"histogram_refresh_s": 0.05},
    ) as c:
        gw, metrics = c.parts, c.parts.metrics
        for i in range(8):  # the poison: 4-token answers under max_tokens 1,000
            text, _ = await _stream(c.router_url, KEY_QC, f"short {i}", 1000, 4)
            assert text == _expected(f"short {i}", 1000, 4)
        await asyncio.sleep(0.2)  # the histogram cache refreshes

        peaks = {"reserved": 0, "hold": 0, "qc_reserved": 0}
        done = asyncio.Event()

        async def sample() -> None:
            while not done.is_set():
                reserved = await c.reserved_blocks()
                hold = sum(gw.requests.quota.holds.get("qc", {}).values())
                live = gw.requests.answering.preemptor.live.values()
                qc_reserved = sum(s.blocks() for s in live if s.tenant == "qc")
                peaks["reserved"] = max(peaks["reserved"], *reserved.values())
                peaks["hold"] = max(peaks["hold"], hold)
                peaks["qc_reserved"] = max(peaks["qc_reserved"], qc_reserved)
                await asyncio.sleep(0.005)

        async def wide(i: int) -> list[str]:
            async with _client(c.router_url, KEY_V) as client:
                resp = await client.chat.completions.create(
                    model=MODEL,
                    messages=[{"role": "user", "content": f"wide {i}"}],
                    max_tokens=1000,
                    n=2,
                    extra_headers={"X-Sim-Output-Tokens": "300"},
                )
            return [ch.message.content or "" for ch in resp.choices]

        sampler = asyncio.create_task(sample())
        try:
            long = [_stream(c.router_url, KEY_QC, f"long {i}", 1000, 300) for i in range(8)]
            results = await asyncio.gather(*long, wide(0), wide(1))
        finally:
            done.set()
            await sampler
        for i, (text, usage) in enumerate(results[:8]):
            assert text == _expected(f"long {i}", 1000, 300), i
            assert usage is not None and usage.completion_tokens == 300
        assert all(len(choices) == 2 and all(choices) for choices in results[8:])
        # The promise: the worker never reserved past its capacity, the tenant never held nor
        # reserved past its limit, and no growth was granted past either.
        assert peaks["reserved"] <= capacity, peaks
        assert peaks["hold"] <= 100 and peaks["qc_reserved"] <= 100, peaks
        assert _counter(metrics.reservation_forced_growth) == 0
        state = await c.worker_state("d0")
        assert state["counters"].get("preemptions", 0) == 0, state["counters"]
        # The poisoner paid: its streams were preempted, for its limit or the worker.
        preempted = sum(
            _counter(metrics.preemptions, reason=r) for r in ("tenant_limit", "worker_full")
        )
        assert preempted >= 1
        await _quiet(c)


def _facts(
    sid: str, tenant: str, at: float, blocks: int, decode: str = "d0", n: int = 0
) -> StreamFacts:
    return StreamFacts(sid, tenant, decode, at, blocks, n)


def test_the_rule_takes_the_growers_own_tenant_newest_first() -> None:
    streams = [
        _facts("old", "qc", 1.0, 30),
        _facts("grower", "qc", 2.0, 20),
        _facts("mid", "qc", 3.0, 10),
        _facts("new", "qc", 4.0, 5),
        _facts("other-tenant", "v", 5.0, 500),  # never taken for qc's growth
        _facts("other-worker", "qc", 6.0, 500, decode="d1"),
    ]
    # The worker is full: the newest of qc's streams on d0 until the need is met.
    got = choose_victims(streams, "grower", "qc", 12, "d0", bound=2)
    assert (got.stream_ids, got.includes_grower) == (("new", "mid"), False)
    # Reaching the grower first: it alone (its growth is moot).
    got = choose_victims(streams, "grower", "qc", 40, "d0", bound=2)
    assert (got.stream_ids, got.includes_grower) == (("grower",), True)
    # The tenant's limit: any worker, the newest first.
    got = choose_victims(streams, "grower", "qc", 100, None, bound=2)
    assert got.stream_ids == ("other-worker",)
    # Streams at their bound are no candidates; with none left nothing is chosen.
    spent = [_facts("grower", "qc", 2.0, 20, n=2), _facts("new", "qc", 4.0, 5, n=2)]
    assert not choose_victims(spent, "grower", "qc", 1, "d0", bound=2)
    # Another tenant's growth never takes qc's streams.
    assert not choose_victims(streams[:4], "x", "v", 1, "d0", bound=2)


async def test_an_answer_that_outgrows_its_tenants_whole_limit_ends_with_the_limit(
    redis_prefix: str,
) -> None:
    """Issue 31: the hold never above the limit. `qc` may hold 15 blocks (240 tokens); an
    answer of 400 tokens alone cannot be held within it: its reservation starts within the
    limit, grows up to it, and the stream then ends with the limit's error frame after the
    exact text so far — never a hold past 15 (before: the store let a request alone grow past
    its tenant's limit)."""
    tenants = [{"name": "qc", "keys": [KEY_QC], "max_reserved_blocks": 15}]
    async with sim_cluster(redis_prefix=redis_prefix, time_scale=50.0, tenants=tenants) as c:
        gw = c.parts
        peak = 0
        done = asyncio.Event()

        async def sample() -> None:
            nonlocal peak
            while not done.is_set():
                peak = max(peak, sum(gw.requests.quota.holds.get("qc", {}).values()))
                await asyncio.sleep(0.002)

        sampler = asyncio.create_task(sample())
        text: list[str] = []
        try:
            async with _client(c.router_url, KEY_QC) as client:
                stream = await client.chat.completions.create(
                    model=MODEL,
                    messages=[{"role": "user", "content": "too long"}],
                    max_tokens=400,
                    stream=True,
                    extra_headers={"X-Sim-Output-Tokens": "400"},
                )
                with pytest.raises(openai.APIError) as info:
                    async for chunk in stream:
                        if chunk.choices and chunk.choices[0].delta.content:
                            text.append(chunk.choices[0].delta.content)
        finally:
            done.set()
            await sampler
        assert "limit of 15 reserved decode blocks" in info.value.message
        assert info.value.body is not None and info.value.body["code"] == "max_reserved_blocks"
        whole = _expected("too long", 400, 400)
        assert text and whole.startswith("".join(text)) and "".join(text) != whole
        assert 0 < peak <= 15, peak
        assert _counter(gw.metrics.reservation_forced_growth) == 0
        await _quiet(c)
