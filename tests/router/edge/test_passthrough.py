"""Endpoints passed through to one worker (router/edge/passthrough.py) — embeddings, tokenize,
detokenize — and the chat fields the router passes through unchanged to the prefill and the
decode worker. The official `openai` client, a real router and Redis, simulated workers."""

from __future__ import annotations

import aiohttp
import openai
import pytest
from multidict import CIMultiDict
from openai import AsyncOpenAI

from disagg_tools.sim.extra_endpoints import embedding_of
from disagg_tools.sim.textgen import VOCAB, expected_answer
from tests.conftest import MODEL, SimCluster, sim_cluster

CHAT = "/v1/chat/completions"


def _client(url: str, api_key: str = "unused") -> AsyncOpenAI:
    return AsyncOpenAI(base_url=url + "/v1", api_key=api_key, max_retries=0, timeout=30)


class Answer(dict):
    """A JSON answer's body, with its status and (case-insensitive) headers."""

    status: int
    headers: CIMultiDict[str]


async def _post(
    url: str, body: object, headers: dict[str, str] | None = None
) -> tuple[int, Answer]:
    async with aiohttp.ClientSession() as s, s.post(url, json=body, headers=headers) as r:
        answer = Answer(await r.json(content_type=None))
        answer.status, answer.headers = r.status, CIMultiDict(r.headers)
        return r.status, answer


async def _all_requests(c: SimCluster, path: str) -> dict[str, list[dict]]:
    return {
        wid: [r for r in await c.worker_requests(wid) if r["path"] == path] for wid in c.workers
    }


async def test_embeddings_through_the_openai_client_are_the_workers(redis_prefix: str) -> None:
    async with sim_cluster(redis_prefix=redis_prefix) as c, _client(c.router_url) as client:
        texts = ["the first text", "a second, longer text to embed"]
        answer = await client.embeddings.create(model=MODEL, input=texts)  # base64 on the wire
        assert [d.index for d in answer.data] == [0, 1]
        for d, text in zip(answer.data, texts, strict=True):
            assert d.embedding == pytest.approx(embedding_of(text), abs=1e-6)
        floats = await client.embeddings.create(
            model=MODEL, input=[[1, 2, 3]], encoding_format="float", dimensions=8
        )
        assert floats.data[0].embedding == pytest.approx(embedding_of([1, 2, 3], 8))
        # The body reached one worker exactly as the client sent it.
        seen = [r for rs in (await _all_requests(c, "/v1/embeddings")).values() for r in rs]
        assert len(seen) == 2
        assert any(r["body"]["input"] == [[1, 2, 3]] and r["body"]["dimensions"] == 8 for r in seen)
        # In its tenant's requests too (open mode: the `default` tenant's).
        counted = c.parts.metrics.tenant_requests.labels(tenant="default", status="200")
        assert counted._value.get() == 2


async def test_tokenize_and_detokenize_pass_through_unchanged(redis_prefix: str) -> None:
    async with sim_cluster(redis_prefix=redis_prefix) as c:
        body = {"model": MODEL, "prompt": "count these tokens please", "add_special_tokens": False}
        status, via_router = await _post(c.router_url + "/tokenize", body)
        assert status == 200
        _, direct = await _post(c.workers["d0"] + "/tokenize", body)
        assert via_router == direct
        assert via_router["count"] == len(via_router["tokens"]) == 7
        assert via_router.headers["X-Request-Id"]
        ids = [3, 1, 4, 1, 5]
        status, text = await _post(c.router_url + "/detokenize", {"model": MODEL, "tokens": ids})
        assert status == 200
        assert text == {"prompt": "".join(" " + VOCAB[i] for i in ids)}
        # No model named: any worker answers (vLLM's tokenize takes none either).
        status, _ = await _post(c.router_url + "/detokenize", {"tokens": [1]})
        assert status == 200
        arrived = [r for rs in (await _all_requests(c, "/tokenize")).values() for r in rs]
        assert [r["body"] for r in arrived if r["body"] == body] == [body, body]


async def test_requests_spread_over_the_workers_of_the_model(redis_prefix: str) -> None:
    async with sim_cluster(redis_prefix=redis_prefix, prefill=2, decode=2) as c:
        for i in range(8):
            status, _ = await _post(c.router_url + "/tokenize", {"model": MODEL, "prompt": f"{i}"})
            assert status == 200
        counts = {wid: len(rs) for wid, rs in (await _all_requests(c, "/tokenize")).items()}
        # Least busy first, least recently picked among equals: one sequential request after
        # another goes round all four workers.
        assert counts == {"p0": 2, "p1": 2, "d0": 2, "d1": 2}


async def test_front_door_errors_are_openai_shaped(redis_prefix: str) -> None:
    async with (
        sim_cluster(
            redis_prefix=redis_prefix, auth={"api_keys": ["k-one"]}, server={"max_body_bytes": 4096}
        ) as c,
        _client(c.router_url, "k-one") as client,
    ):
        with pytest.raises(openai.NotFoundError) as err:
            await client.embeddings.create(model="no-such-model", input="x")
        assert err.value.code == "model_not_found"
        with pytest.raises(openai.AuthenticationError):
            await client.with_options(api_key="wrong").embeddings.create(model=MODEL, input="x")
        auth = {"Authorization": "Bearer k-one"}
        for path in ("/v1/embeddings", "/tokenize", "/detokenize", "/v1/responses"):
            status, r = await _post(c.router_url + path, {"model": MODEL})
            assert status == 401, path
            status, r = await _post(c.router_url + path, [1, 2], auth)
            assert status == 400 and r["error"]["type"] == "invalid_request_error"
            status, r = await _post(c.router_url + path, {"model": "x" * 5000}, auth)
            assert status == 413 and set(r["error"]) == {"message", "type", "param", "code"}
        # A worker's own 4xx passes through with its status and message.
        status, r = await _post(c.router_url + "/detokenize", {"tokens": ["a"]}, auth)
        assert status == 400 and "'tokens' must be a list of token ids" in r["error"]["message"]
        assert sum(len(rs) for rs in (await _all_requests(c, "/detokenize")).values()) == 1


async def test_a_failing_worker_is_retried_elsewhere_and_charged(redis_prefix: str) -> None:
    async with sim_cluster(redis_prefix=redis_prefix, prefill=1, decode=1) as c:
        async with aiohttp.ClientSession() as s:
            fault = {"error_rate": 1.0, "error_status": 500}
            async with s.post(c.workers["p0"] + "/sim/faults", json=fault) as r:
                assert r.status == 200
        gw = c.parts
        for i in range(4):
            status, r = await _post(c.router_url + "/tokenize", {"model": MODEL, "prompt": str(i)})
            assert status == 200, r
        p0 = gw.pools.workers["p0"].breaker
        assert p0.failures >= 1 or p0.state != "closed"
        ok = [r for r in await c.worker_requests("d0") if r["path"] == "/tokenize"]
        assert len(ok) == 4  # every request was answered by d0 in the end
        retried = gw.metrics.retries.labels(side="prefill")._value.get()
        assert retried >= 1


async def test_a_malformed_answer_is_retried_and_no_worker_gives_503(redis_prefix: str) -> None:
    async with sim_cluster(redis_prefix=redis_prefix, prefill=1, decode=1) as c:
        async with aiohttp.ClientSession() as s:
            bad = {"error_rate": 1.0, "error_status": "malformed", "count": 1}
            async with s.post(c.workers["p0"] + "/sim/faults", json=bad) as r:
                assert r.status == 200
            async with s.post(c.workers["d0"] + "/sim/faults", json=bad) as r:
                assert r.status == 200
        status, r = await _post(c.router_url + "/v1/embeddings", {"model": MODEL, "input": "x"})
        assert status == 200 and r["data"][0]["embedding"] == pytest.approx(embedding_of("x"))
        for w in c.parts.pools.workers.values():
            w.healthy = False  # as the health prober marks workers that stopped answering
        status, r = await _post(c.router_url + "/v1/embeddings", {"model": MODEL, "input": "x"})
        assert status == 503 and int(r.headers["Retry-After"]) >= 1
        assert r["error"]["type"] == "service_unavailable"


async def test_every_worker_failing_ends_in_503_within_the_attempts(redis_prefix: str) -> None:
    async with sim_cluster(redis_prefix=redis_prefix, prefill=1, decode=1) as c:
        async with aiohttp.ClientSession() as s:
            for wid in ("p0", "d0"):
                fault = {"error_rate": 1.0, "error_status": 503}
                async with s.post(c.workers[wid] + "/sim/faults", json=fault) as r:
                    assert r.status == 200
        status, r = await _post(c.router_url + "/tokenize", {"model": MODEL, "prompt": "x"})
        assert status == 503 and "Retry-After" in r.headers
        tries = sum(len(rs) for rs in (await _all_requests(c, "/tokenize")).values())
        assert tries == c.parts.settings.retry.max_attempts


# --- chat fields pass through unchanged ----------------------------------------------------

_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]
_FIELDS = {
    "tools": _TOOLS,
    "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
    "response_format": {
        "type": "json_schema",
        "json_schema": {"name": "w", "schema": {"type": "object"}},
    },
    "logprobs": True,
    "top_logprobs": 3,
    "seed": 1234,
    "stop": ["\n\n", "END"],
    "temperature": 0.0,
    "user": "someone",
}


@pytest.mark.parametrize("stream", [False, True])
async def test_chat_fields_reach_prefill_and_decode_unchanged(
    redis_prefix: str, stream: bool
) -> None:
    async with sim_cluster(redis_prefix=redis_prefix) as c, _client(c.router_url) as client:
        messages = [{"role": "user", "content": "what is the weather in Paris?"}]
        extra: dict = {"stream_options": {"include_usage": True}} if stream else {}
        if stream:
            text = ""
            usage = None
            async for chunk in await client.chat.completions.create(
                model=MODEL, messages=messages, max_tokens=6, stream=True, **_FIELDS, **extra
            ):
                for choice in chunk.choices:
                    text += choice.delta.content or ""
                usage = chunk.usage or usage
            assert usage is not None and usage.completion_tokens == 6  # stream_options honoured
        else:
            answer = await client.chat.completions.create(
                model=MODEL, messages=messages, max_tokens=6, **_FIELDS
            )
            text = answer.choices[0].message.content or ""
        body = {"model": MODEL, "messages": messages, "max_tokens": 6}
        assert text == expected_answer(CHAT, body)[0]
        (prefill,) = [r["body"] for r in await c.worker_requests("p0") if r["path"] == CHAT]
        (decode,) = [r["body"] for r in await c.worker_requests("d0") if r["path"] == CHAT]
        for key, value in _FIELDS.items():
            assert prefill[key] == value, key
            assert decode[key] == value, key
        assert decode["messages"] == prefill["messages"] == messages
        if stream:
            assert decode["stream_options"] == {"include_usage": True}
        else:
            # A whole answer is streamed from the decode worker and assembled
            # (router/request/assemble.py).
            assert decode["stream"] is True and decode["stream_options"] == {"include_usage": True}
