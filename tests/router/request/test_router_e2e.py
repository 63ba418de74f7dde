"""The request path end to end: the official `openai` client → router → simulated prefill and
decode workers, with reservations in a real Redis."""

from __future__ import annotations

import asyncio

import aiohttp
import openai
import pytest
from openai import AsyncOpenAI

from disagg_tools.sim.textgen import expected_answer
from tests.conftest import MODEL, sim_cluster

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


def _client(url: str) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=url + "/v1", api_key="test-key", max_retries=0, timeout=30)


def _chat_body(text: str, max_tokens: int = 40, **extra: object) -> dict:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": max_tokens,
        **extra,
    }


async def test_streaming_chat_is_exact_and_reservation_released(redis_prefix: str) -> None:
    async with sim_cluster(redis_prefix=redis_prefix) as c, _client(c.router_url) as client:
        body = _chat_body("Tell me about disaggregated serving.", 48)
        want, n_tokens, finish = expected_answer(CHAT, body)
        stream = await client.chat.completions.create(
            model=MODEL,
            messages=body["messages"],
            max_tokens=48,
            stream=True,
            stream_options={"include_usage": True},
        )
        pieces, finishes, usage = [], [], None
        async for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            for choice in chunk.choices:
                if choice.delta.content:
                    pieces.append(choice.delta.content)
                if choice.finish_reason:
                    finishes.append(choice.finish_reason)
        assert "".join(pieces) == want
        assert len(pieces) == n_tokens  # one chunk per token: nothing merged, lost or repeated
        assert finishes == [finish]
        assert usage is not None and usage.completion_tokens == n_tokens
        await asyncio.sleep(0.05)
        assert await c.reserved_blocks() == {"d0": 0}
        assert await c.stranded() == {"p0": 0}


async def test_non_streaming_chat_and_completions_are_exact(redis_prefix: str) -> None:
    async with sim_cluster(redis_prefix=redis_prefix) as c, _client(c.router_url) as client:
        body = _chat_body("What is a KV cache?", 30)
        want, n_tokens, finish = expected_answer(CHAT, body)
        resp = await client.chat.completions.create(
            model=MODEL, messages=body["messages"], max_tokens=30
        )
        assert resp.choices[0].message.content == want
        assert resp.choices[0].finish_reason == finish
        assert resp.usage is not None and resp.usage.completion_tokens == n_tokens

        cbody = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 25}
        cwant, cn, _ = expected_answer(COMPLETIONS, cbody)
        cresp = await client.completions.create(
            model=MODEL, prompt="Once upon a time", max_tokens=25
        )
        assert cresp.choices[0].text == cwant
        assert cresp.usage is not None and cresp.usage.completion_tokens == cn


async def test_streaming_completions_with_token_ids_is_exact(redis_prefix: str) -> None:
    async with sim_cluster(redis_prefix=redis_prefix) as c, _client(c.router_url) as client:
        ids = [101, 2023, 2003, 1037, 3231]
        want, n_tokens, _ = expected_answer(
            COMPLETIONS, {"model": MODEL, "prompt": ids, "max_tokens": 64}
        )
        stream = await client.completions.create(
            model=MODEL, prompt=ids, max_tokens=64, stream=True
        )
        pieces = [ch.choices[0].text async for ch in stream if ch.choices and ch.choices[0].text]
        assert "".join(pieces) == want and len(pieces) == n_tokens


async def test_wire_protocol_prefill_then_decode(redis_prefix: str) -> None:
    """Prefill got max_tokens 1 + do_remote_decode; decode got the prefill's params verbatim."""
    async with sim_cluster(redis_prefix=redis_prefix) as c, _client(c.router_url) as client:
        await client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "hello there"}],
            max_tokens=20,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"min_tokens": 2},
            extra_headers={"X-Request-Id": "req-wire-1"},
        )
        (pre,) = await c.worker_requests("p0")
        (dec,) = await c.worker_requests("d0")
        pb, db = pre["body"], dec["body"]
        assert pb["max_tokens"] == 1 and pb["stream"] is False
        assert "min_tokens" not in pb and "stream_options" not in pb
        assert pb["kv_transfer_params"] == {
            "do_remote_decode": True,
            "do_remote_prefill": False,
            "remote_engine_id": None,
            "remote_block_ids": None,
            "remote_host": None,
            "remote_port": None,
        }
        kv = db["kv_transfer_params"]
        assert kv["do_remote_prefill"] is True
        assert kv["remote_engine_id"] == c.configs["p0"].engine_id
        assert kv["remote_request_id"] == "req-wire-1"
        assert kv["remote_port"] == int(c.workers["p0"].rsplit(":", 1)[1])
        # The decode leg is the client's body untouched, plus the KV handle.
        assert db["stream"] is True and db["max_tokens"] == 20 and db["min_tokens"] == 2
        assert db["stream_options"] == {"include_usage": True}
        # One request id on both legs; the client's API key never goes upstream.
        for leg in (pre, dec):
            headers = {k.lower(): v for k, v in leg["headers"].items()}
            assert headers["x-request-id"] == "req-wire-1"
            assert "authorization" not in headers


async def test_full_decode_pool_gives_429_and_sends_no_prefill(redis_prefix: str) -> None:
    # Another replica holds all of d0's room; this request waits briefly in the admission
    # queue, then gets 429 + Retry-After, and no prefill was ever sent.
    async with sim_cluster(
        redis_prefix=redis_prefix,
        kv_blocks=400,
        estimates={"estimator": "max_tokens"},
        admission={"max_wait_s": 0.3},
    ) as c:
        store = c.parts.store
        assert await store.reserve("d0", "other-replica", 400, 30.0)
        try:
            async with aiohttp.ClientSession() as s:
                async with s.post(c.router_url + CHAT, json=_chat_body("hello", 40)) as resp:
                    assert resp.status == 429
                    assert int(resp.headers["Retry-After"]) >= 1
                    err = (await resp.json())["error"]
                    assert err["type"] == "rate_limit_exceeded" and "deadline" in err["message"]
                    assert set(err) == {"message", "type", "param", "code"}
                # Larger than the whole worker: refused at once, not after waiting.
                async with s.post(c.router_url + CHAT, json=_chat_body("x" * 8000, 5000)) as resp:
                    assert resp.status == 429
                    assert "deadline" not in (await resp.json())["error"]["message"]
        finally:
            assert await store.release("d0", "other-replica") == 400
        assert await c.worker_requests("p0") == []
        assert await c.reserved_blocks() == {"d0": 0}


async def test_waiting_request_is_admitted_when_room_frees(redis_prefix: str) -> None:
    async with (
        sim_cluster(
            redis_prefix=redis_prefix,
            kv_blocks=400,
            estimates={"estimator": "max_tokens"},
            admission={"max_wait_s": 10},
        ) as c,
        _client(c.router_url) as client,
    ):
        store = c.parts.store
        assert await store.reserve("d0", "other-replica", 400, 30.0)

        async def free_later() -> None:
            await asyncio.sleep(0.3)
            assert await store.release("d0", "other-replica") == 400

        body = _chat_body("patience", 20)
        want, _, _ = expected_answer(CHAT, body)
        resp, _ = await asyncio.gather(
            client.chat.completions.create(model=MODEL, messages=body["messages"], max_tokens=20),
            free_later(),
        )
        assert resp.choices[0].message.content == want
        assert await c.reserved_blocks() == {"d0": 0}


async def test_client_errors_through_openai_client(redis_prefix: str) -> None:
    async with sim_cluster(redis_prefix=redis_prefix) as c, _client(c.router_url) as client:
        with pytest.raises(openai.NotFoundError):
            await client.chat.completions.create(
                model="no-such-model", messages=[{"role": "user", "content": "x"}]
            )
        with pytest.raises(openai.BadRequestError) as bad:
            await client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=-5
            )
        assert bad.value.body["param"] == "max_tokens"  # type: ignore[index]


async def test_many_concurrent_requests_with_disconnects_leave_nothing_reserved(
    redis_prefix: str,
) -> None:
    async with sim_cluster(redis_prefix=redis_prefix, prefill=2, decode=2, time_scale=100.0) as c:

        async def full(i: int, session: aiohttp.ClientSession) -> str:
            body = _chat_body(f"request number {i} " * (1 + i % 7), 30 + i % 50, stream=True)
            want, _, _ = expected_answer(CHAT, body)
            async with session.post(c.router_url + CHAT, json=body) as resp:
                assert resp.status == 200
                raw = await resp.read()
            assert raw.endswith(b"data: [DONE]\n\n")
            return want

        async def abandon(i: int) -> None:
            # A client that reads a few bytes of the stream and hangs up.
            body = _chat_body(f"walk away {i}", 2000, stream=True, ignore_eos=True)
            async with (
                aiohttp.ClientSession() as own,
                own.post(c.router_url + CHAT, json=body) as resp,
            ):
                assert resp.status == 200
                await resp.content.readany()

        async with aiohttp.ClientSession() as session:
            results = await asyncio.gather(
                *(full(i, session) for i in range(40)), *(abandon(i) for i in range(12))
            )
        assert all(isinstance(r, str) for r in results[:40])
        # Releases run as the handlers unwind; give the cancelled ones a moment.
        for _ in range(100):
            if sum((await c.reserved_blocks()).values()) == 0:
                break
            await asyncio.sleep(0.05)
        assert await c.reserved_blocks() == {"d0": 0, "d1": 0}
        assert await c.stranded() == {"p0": 0, "p1": 0}
        # The decode workers aborted the abandoned sequences (closing is vLLM's abort signal).
        for wid in ("d0", "d1"):
            for _ in range(100):
                if (await c.worker_state(wid))["resident_sequences"] == 0:
                    break
                await asyncio.sleep(0.05)
            assert (await c.worker_state(wid))["resident_sequences"] == 0
        assert c.parts.leases.live == {}


async def test_predictive_admission_counts_on_room_forecast_to_free(redis_prefix: str) -> None:
    """A reservation of this replica that is expected to end before the new request's prefill
    does lets the new request in (Mooncake's prediction-based admission); instant does not.
    The reservation is expected to end in 1 s, the request's prefill (~4,000 tokens) takes
    ~0.15 s: it waits (room is expected well before its deadline) and is admitted on the
    forecast once the end is within its prefill, before the reservation is released."""
    prompt = "forecast " * 1_800  # ~4,000 tokens at 4 characters a token
    for mode, admitted in (("predictive", True), ("instant", False)):
        async with sim_cluster(
            redis_prefix=redis_prefix,
            kv_blocks=400,
            estimates={"estimator": "max_tokens"},
            admission={"mode": mode},
        ) as c:
            gw = c.parts
            assert await gw.store.reserve("d0", "ending-soon", 400, 30.0)
            gw.leases.hold("d0", "ending-soon", 400, gw.clock() + 1.0)
            try:
                async with aiohttp.ClientSession() as s:
                    async with s.post(c.router_url + CHAT, json=_chat_body(prompt, 8)) as r:
                        assert (r.status == 200) is admitted, await r.text()
                assert gw.metrics.admitted_on_forecast._value.get() == (1 if admitted else 0)
            finally:
                gw.leases.drop("ending-soon")
                assert await gw.store.release("d0", "ending-soon") == 400
            assert await c.reserved_blocks() == {"d0": 0}


async def test_predictive_admission_does_not_count_on_a_reservation_past_its_expected_end(
    redis_prefix: str,
) -> None:
    """A reservation already past its expected end (its answer outran the estimate, or its
    client holds the room without reading) is not room about to free: counting it admitted
    requests onto a worker that stayed full (issue 20). Now the request waits, then is refused."""
    async with sim_cluster(
        redis_prefix=redis_prefix,
        kv_blocks=400,
        estimates={"estimator": "max_tokens"},
        admission={"mode": "predictive", "max_wait_s": 0.5},
    ) as c:
        gw = c.parts
        assert await gw.store.reserve("d0", "late", 400, 30.0)
        gw.leases.hold("d0", "late", 400, gw.clock() - 1.0)  # expected to have ended a second ago
        try:
            async with aiohttp.ClientSession() as s:
                async with s.post(c.router_url + CHAT, json=_chat_body("late", 8)) as r:
                    assert r.status == 429, await r.text()
            assert gw.metrics.admitted_on_forecast._value.get() == 0
        finally:
            gw.leases.drop("late")
            assert await gw.store.release("d0", "late") == 400


async def test_client_api_keys_are_checked_and_never_forwarded(redis_prefix: str) -> None:
    async with sim_cluster(redis_prefix=redis_prefix, auth={"api_keys": ["k-one", "k-two"]}) as c:
        url = c.router_url + CHAT
        body = _chat_body("who may ask?", 5)
        async with aiohttp.ClientSession() as s:
            for headers in (
                {},
                {"Authorization": "Bearer nope"},
                {"Authorization": "k-one"},
                {"Authorization": "Basic k-one"},
                {"Authorization": "Bearer "},
            ):
                async with s.post(url, json=body, headers=headers) as r:
                    assert r.status == 401, headers
                    err = (await r.json())["error"]
                    assert set(err) == {"message", "type", "param", "code"}
            # The scheme is case-insensitive (RFC 7235); either configured key works.
            async with s.post(url, json=body, headers={"Authorization": "bearer k-two"}) as r:
                assert r.status == 200, await r.text()
        async with AsyncOpenAI(
            base_url=c.router_url + "/v1", api_key="k-one", max_retries=0, timeout=30
        ) as client:
            answer = await client.chat.completions.create(
                model=MODEL, messages=body["messages"], max_tokens=5
            )
            assert answer.choices[0].message.content == expected_answer(CHAT, body)[0]
            with pytest.raises(openai.AuthenticationError):
                await client.with_options(api_key="k-three").chat.completions.create(
                    model=MODEL, messages=body["messages"], max_tokens=5
                )
        sent = await c.worker_requests("p0") + await c.worker_requests("d0")
        assert sent and all("Authorization" not in r["headers"] for r in sent)
