"""The reservation holds when the estimate is wrong (issue 20), through the live router: hints
only raise reservations unless trusted, a class whose live answers overrun raises its estimate
before any completes, forced growth keeps room back, and a request whose room is not expected
before its deadline is refused at once with that wait as Retry-After."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp
import pytest

from policies.base import RequestInfo
from tests.conftest import MODEL, SimCluster, sim_cluster
from tests.router.request.test_faults import assert_quiet

CHAT = "/v1/chat/completions"


def _body(i: int, max_tokens: int, stream: bool = True, ignore_eos: bool = True) -> dict[str, Any]:
    return {
        "model": MODEL,
        "max_tokens": max_tokens,
        "ignore_eos": ignore_eos,
        "stream": stream,
        "messages": [{"role": "user", "content": f"guard case {i}"}],
    }


def _counter(metric: Any) -> float:
    return float(metric._value.get())


async def _stream_all(
    s: aiohttp.ClientSession, c: SimCluster, body: dict[str, Any], **kw: Any
) -> int:
    """The streamed answer's events, checked whole: one role event, however often the answer
    was preempted and resumed, and no error."""
    async with s.post(c.router_url + CHAT, json=body, **kw) as r:
        assert r.status == 200, await r.text()
        raw = await r.read()
    assert raw.count(b'"role":') == 1 and b'"error"' not in raw, raw[-2000:]
    return raw.count(b"data: {")


@pytest.mark.parametrize("trusted", [False, True])
async def test_a_hint_of_one_on_long_answers_no_longer_over_commits(
    redis_prefix: str, trusted: bool
) -> None:
    """The hint flood: `X-Expected-Output-Tokens: 1` on answers of 200 tokens, 6 at once on a
    worker with room for ~3 of them. Untrusted (the default), the hint cannot lower the
    reservation: no overrun, no growth past capacity. Trusted, it does (and the answers then
    outgrow their reservations: what trust costs when the caller is wrong)."""
    async with sim_cluster(
        redis_prefix=redis_prefix,
        kv_blocks=45,
        time_scale=50.0,
        estimates={"estimator": "hint", "trust_hints": trusted},
    ) as c:
        gw = c.parts
        async with aiohttp.ClientSession() as s:
            counts = await asyncio.gather(
                *(
                    _stream_all(s, c, _body(i, 200), headers={"X-Expected-Output-Tokens": "1"})
                    for i in range(6)
                )
            )
        assert all(n >= 200 for n in counts), counts
        overruns = _counter(gw.metrics.reservation_overruns)
        forced = _counter(gw.metrics.reservation_forced_growth)
        if trusted:
            assert overruns >= 1
        else:
            assert (overruns, forced) == (0, 0)
        await assert_quiet(c)


async def test_live_overruns_raise_the_estimate_before_they_complete(redis_prefix: str) -> None:
    """A class learned on 8-token answers; then answers of 400 tokens in the same class start.
    While they still stream, the class's estimate has risen (no completion of them yet), and a
    new request of the class reserves for it."""
    async with sim_cluster(
        redis_prefix=redis_prefix,
        time_scale=20.0,
        estimates={"estimator": "online_quantile", "estimator_args": {"min_samples": 5}},
        loops={"histogram_refresh_s": 0.05},
    ) as c:
        gw = c.parts
        probe = RequestInfo("probe", MODEL, prompt_tokens=8, max_tokens=500)
        async with aiohttp.ClientSession() as s:
            short = {"X-Sim-Output-Tokens": "8"}  # the simulated answer's natural length
            for i in range(10):
                body = _body(i, 500, stream=False, ignore_eos=False)
                async with s.post(c.router_url + CHAT, json=body, headers=short) as r:
                    assert r.status == 200
            await asyncio.sleep(0.2)  # the histogram cache refreshes
            before = (await gw.requests.reserve.estimated(probe)).reserve_output_tokens
            assert before <= 16, before
            # Four long answers of the same class, read slowly: they overrun their reservations.
            responses = [
                await s.post(c.router_url + CHAT, json=_body(100 + i, 500)) for i in range(4)
            ]
            try:
                for r in responses:
                    assert r.status == 200
                deadline = time.monotonic() + 20
                raised = before
                while time.monotonic() < deadline and raised <= 64:
                    for r in responses:
                        await r.content.read(4096)
                    raised = (await gw.requests.reserve.estimated(probe)).reserve_output_tokens
                assert raised > 64, (before, raised, len(gw.overruns))
                assert len(gw.overruns) >= 1
            finally:
                for r in responses:
                    await r.read()
                    r.release()
        # Released: the live samples are gone, the completions are what the class learned.
        assert len(gw.overruns) == 0
        await assert_quiet(c)


async def test_forced_growth_keeps_a_margin_back_on_its_worker(redis_prefix: str) -> None:
    async with sim_cluster(
        redis_prefix=redis_prefix,
        kv_blocks=12,
        time_scale=5.0,
        estimates={"estimator": "hint", "trust_hints": True},
        # Growth is forced only where nothing may be preempted (issue 31): here, nothing may.
        preemption={"enabled": False},
    ) as c:
        gw = c.parts
        async with aiohttp.ClientSession() as s:
            await _stream_all(s, c, _body(1, 400), headers={"X-Expected-Output-Tokens": "8"})
        assert _counter(gw.metrics.reservation_forced_growth) >= 1
        held = gw.margin.margin("d0", 12, gw.clock())
        assert 1 <= held <= 3  # at most a quarter of the capacity
        await assert_quiet(c)


async def test_no_room_expected_before_the_deadline_is_refused_at_once(redis_prefix: str) -> None:
    """One long answer (6,000 tokens, ~8 ms each as the perf model predicts) fills the only
    decode worker; a second one may wait 8 s. Before, it waited the 8 s out and got a 429; now
    the leases' expected ends say room comes in tens of seconds, so it gets the 429 at once,
    with that wait as Retry-After."""
    async with sim_cluster(
        redis_prefix=redis_prefix,
        kv_blocks=400,
        time_scale=1.0,
        estimates={"estimator": "max_tokens"},
        admission={"max_wait_s": 8.0},
    ) as c:
        gw = c.parts
        async with aiohttp.ClientSession() as s:
            long = await s.post(c.router_url + CHAT, json=_body(1, 6_000))
            try:
                assert long.status == 200
                await long.content.read(64)  # admitted and streaming
                started = time.monotonic()
                async with s.post(c.router_url + CHAT, json=_body(2, 6_000)) as r:
                    waited = time.monotonic() - started
                    assert r.status == 429, await r.text()
                    error = (await r.json())["error"]
                    retry_after = float(r.headers["Retry-After"])
            finally:
                long.close()
        assert "room expected in about" in error["message"], error
        assert waited < 8.0, waited  # refused before the deadline it would have waited out
        assert retry_after > 8.0, retry_after
        rejected = gw.metrics.rejections.labels(reason="predicted_wait")
        assert _counter(rejected) == 1
        await assert_quiet(c)


async def test_a_large_request_at_the_head_does_not_hold_back_a_small_one_that_fits(
    redis_prefix: str,
) -> None:
    """Two requests wait for room on a full worker (another replica holds it: no known end, so
    no early refusal): a large one first, then a small one. Room for the small one only
    appears: the head still finds none and passes the wake-up on, the small one is served.
    Before, only the head retried and the small one waited out its deadline behind it."""
    async with sim_cluster(
        redis_prefix=redis_prefix,
        kv_blocks=100,
        time_scale=50.0,
        estimates={"estimator": "max_tokens"},
        admission={"max_wait_s": 4.0},
    ) as c:
        gw = c.parts
        assert await gw.store.reserve("d0", "other", 98, 30.0)
        async with aiohttp.ClientSession() as s:
            large = asyncio.ensure_future(s.post(c.router_url + CHAT, json=_body(1, 780)))
            for _ in range(200):
                if gw.admission.waiting == 1:
                    break
                await asyncio.sleep(0.01)
            small = asyncio.ensure_future(s.post(c.router_url + CHAT, json=_body(2, 60)))
            for _ in range(200):
                if gw.admission.waiting == 2:
                    break
                await asyncio.sleep(0.01)
            assert gw.admission.waiting == 2
            # The other replica's request ends and a smaller one of it takes most of the room.
            assert await gw.store.reserve("d0", "other-2", 60, 30.0, overbook_blocks=60)
            assert await gw.store.release("d0", "other") == 98
            async with await small as r:
                assert r.status == 200, await r.text()
                await r.read()
            assert not large.done()  # served while the large one still waits at the head
            assert gw.admission.waiting == 1
            async with await large as r:
                assert r.status == 429, await r.text()
        assert await gw.store.release("d0", "other-2") == 60
        await assert_quiet(c)


async def test_a_burst_of_pending_reservations_is_not_taken_for_forced_growth(
    redis_prefix: str,
) -> None:
    """The margin is learned from what the store holds past capacity, not from the view's
    count with this replica's reservations still on their way: a burst's pending blocks (or
    two replicas racing for the same room) are no growth, and a margin learned from them
    closed the workers to the normal clients of issue 20's reproduction."""
    async with sim_cluster(
        redis_prefix=redis_prefix, kv_blocks=100, estimates={"estimator": "max_tokens"}
    ) as c:
        gw = c.parts

        gw.pools.note_pending("d0", 5_000)
        try:
            gw.requests.reserve._with_margins(gw.pools.snapshot(model=MODEL))
            assert gw.margin.margins({"d0": 100}, gw.clock()) == {}
        finally:
            gw.pools.note_pending("d0", -5_000)
        # What the store holds past capacity (forced growth, seen by every replica) does count.
        assert await gw.store.reserve("d0", "grown", 90, 30.0)
        assert await gw.store.resize("d0", "grown", 130, force=True)
        for _ in range(100):
            if gw.pools.workers["d0"].reserved_blocks == 130:
                break
            await asyncio.sleep(0.02)
        gw.requests.reserve._with_margins(gw.pools.snapshot(model=MODEL))
        assert gw.margin.margins({"d0": 100}, gw.clock()) == {"d0": 25}  # a quarter at most
        assert await gw.store.release("d0", "grown") == 130
