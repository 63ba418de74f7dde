"""Tenants' quotas on the request path (issue 25; router/request/quota.py, state/quotas.py):
a router in front of simulated workers, on the session's real Redis, called with the official
`openai` client (no retries: each 429 is seen).

- requests per minute: the limit's worth passes, the next is a 429 naming the limit, with an
  honest Retry-After and the x-ratelimit headers; another tenant is not touched;
- tokens per minute: charged the expected tokens, corrected to the answer's at its end;
- concurrent reserved blocks: a second stream waits for the first one's end;
- two replicas behind a client that spreads one tenant's flood over both: the limit holds
  cluster-wide, exactly (the store takes every request atomically);
- a request refused or failed is not billed tokens.
"""

from __future__ import annotations

import asyncio
import math
from typing import Any

import openai
import pytest
from openai import AsyncOpenAI

from router.edge.app import SETTINGS
from tests.app_parts import parts
from tests.conftest import MODEL, running_router, sim_cluster

KEY_A = "sk-quota-a-0c9d8e7f6a5b4c3d2e1f"
KEY_B = "sk-quota-b-1f2e3d4c5b6a7f8e9d0c"


def _tenants(**limits_a: Any) -> list[dict[str, Any]]:
    return [
        {"name": "a", "keys": [KEY_A], **limits_a},
        {"name": "b", "keys": [KEY_B]},
    ]


def _client(url: str, key: str) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=30)


async def _chat(url: str, key: str, max_tokens: int = 8) -> str:
    async with _client(url, key) as client:
        resp = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=max_tokens
        )
    return resp.choices[0].message.content or ""


async def _refused(url: str, key: str, max_tokens: int = 8) -> openai.RateLimitError:
    with pytest.raises(openai.RateLimitError) as info:
        await _chat(url, key, max_tokens)
    return info.value


async def test_requests_per_minute_refuses_the_next_with_the_limit_named(
    redis_prefix: str,
) -> None:
    async with sim_cluster(redis_prefix=redis_prefix, tenants=_tenants(requests_per_minute=3)) as c:
        for _ in range(3):
            await _chat(c.router_url, KEY_A)
        err = await _refused(c.router_url, KEY_A)
        body = err.body
        assert isinstance(body, dict) and body["code"] == "requests_per_minute", body
        assert body["type"] == "rate_limit_exceeded" and "a is over its limit of 3" in str(body)
        # One request every 20 s: the bucket refills a request's worth within 20 s.
        retry_after = int(err.response.headers["Retry-After"])
        assert 1 <= retry_after <= 20
        assert err.response.headers["x-ratelimit-limit-requests"] == "3"
        assert err.response.headers["x-ratelimit-remaining-requests"] == "0"
        # The other tenant is not touched.
        for _ in range(5):
            await _chat(c.router_url, KEY_B)
        metrics = c.parts.metrics.tenant_rejections
        assert metrics.labels(tenant="a", reason="requests_per_minute")._value.get() == 1
        assert metrics.labels(tenant="b", reason="requests_per_minute")._value.get() == 0


async def test_tokens_per_minute_is_corrected_to_what_answers_cost(redis_prefix: str) -> None:
    """A cold estimator reserves (and charges) the whole `max_tokens`; the simulated worker's
    answers end by themselves well below it (128 tokens on average), so each end gives tokens
    back and more requests pass than the charge at admission alone would let through."""
    async with sim_cluster(
        redis_prefix=redis_prefix, tenants=_tenants(tokens_per_minute=2000)
    ) as c:
        passed, refused = 0, None
        for _ in range(40):
            try:
                await _chat(c.router_url, KEY_A, max_tokens=400)
            except openai.RateLimitError as err:
                refused = err
                break
            passed += 1
        assert refused is not None, f"{passed} passed, none refused"
        assert isinstance(refused.body, dict) and refused.body["code"] == "tokens_per_minute"
        assert refused.response.headers["x-ratelimit-limit-tokens"] == "2000"
        # Charged ~400 + the prompt each at admission: without the correction at most 4
        # would pass (2000 / ~410).
        assert passed > 5, passed
        billed = c.parts.metrics.tenant_output_tokens.labels(tenant="a")._value.get()
        assert 0 < billed < 400 * passed


async def test_a_request_that_produced_nothing_is_not_billed(redis_prefix: str) -> None:
    """Refused for lack of decode room (it can never fit: 429 no_decode_capacity), after its
    tenant's quota took its tokens: they all come back."""
    async with sim_cluster(
        redis_prefix=redis_prefix, kv_blocks=64, tenants=_tenants(tokens_per_minute=1000)
    ) as c:
        quota, store = c.app[SETTINGS].tenants[0].limits, c.parts.store
        err = await _refused(c.router_url, KEY_A, max_tokens=4000)
        assert isinstance(err.body, dict) and err.body["code"] == "no_decode_capacity"
        # Charged prompt + 4000 at admission (a full bucket lets a request larger than a
        # minute's worth through), all given back at its end: full again, less the probe's 1.
        probe = await store.take_quota("a", quota, "probe-1", 1, 0, 30.0, 1.0)
        assert probe.remaining_tokens == 999
        await _chat(c.router_url, KEY_A, max_tokens=8)  # answered: billed
        probe = await store.take_quota("a", quota, "probe-2", 1, 0, 30.0, 1.0)
        assert probe.remaining_tokens is not None and probe.remaining_tokens < 990


async def test_concurrent_reserved_blocks_wait_for_the_streams_holding_them(
    redis_prefix: str,
) -> None:
    """A stream of 160 tokens holds 11 blocks (16-token blocks; its prompt is small); with 15
    allowed, a second at once is refused until the first ends."""
    async with sim_cluster(
        redis_prefix=redis_prefix, time_scale=2.0, tenants=_tenants(max_reserved_blocks=15)
    ) as c:
        async with _client(c.router_url, KEY_A) as client:
            stream = await client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "hello"}],
                max_tokens=160,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            first = await anext(aiter(stream))
            assert first.choices
            err = await _refused(c.router_url, KEY_A, max_tokens=160)
            assert isinstance(err.body, dict) and err.body["code"] == "max_reserved_blocks"
            assert int(err.response.headers["Retry-After"]) >= 1
            await _chat(c.router_url, KEY_B, max_tokens=160)  # another tenant: not touched
            async for _ in stream:
                pass
        await _chat(c.router_url, KEY_A, max_tokens=160)  # the first one's blocks are back
        assert not c.parts.requests.quota.holds  # settled: nothing left to renew


async def test_one_tenants_limit_holds_across_two_replicas(redis_prefix: str) -> None:
    """A client that spreads one tenant's flood over two replicas sharing the store: exactly
    the limit's worth passes (plus what the bucket refilled meanwhile), the rest are 429s
    naming the limit, none a 5xx."""
    async with (
        sim_cluster(redis_prefix=redis_prefix, tenants=_tenants(requests_per_minute=10)) as c,
        running_router(c.app[SETTINGS]) as (b, _),
    ):
        urls = [c.router_url, b]
        start = asyncio.get_running_loop().time()

        async def one(i: int) -> str:
            try:
                await _chat(urls[i % 2], KEY_A)
            except openai.RateLimitError as err:
                assert isinstance(err.body, dict)
                return str(err.body["code"])
            return "ok"

        outcomes = await asyncio.gather(*(one(i) for i in range(30)))
        elapsed = asyncio.get_running_loop().time() - start
        ok = outcomes.count("ok")
        assert 10 <= ok <= 10 + math.ceil(elapsed * 10 / 60), (ok, elapsed)
        assert outcomes.count("requests_per_minute") == 30 - ok
        assert parts(c.app).requests.quota.holds == {}
