"""`POST /v1/responses` (router/openai/responses.py) without a prefill pool: stateless Responses
requests served whole by one worker that runs both phases — a `both` worker when there is one,
else a decode worker, never a prefill worker — and the stateful features refused with a 400,
whichever path would serve them. The official `openai` client. (With a prefill pool:
tests/router/openai/test_responses_pd.py.)"""

from __future__ import annotations

import aiohttp
import openai
import pytest
from openai import AsyncOpenAI

from disagg_tools.sim.textgen import expected_answer
from tests.conftest import MODEL, SimCluster, sim_cluster

RESPONSES = "/v1/responses"


def _client(url: str) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=30)


def _expected(text: str, max_tokens: int, instructions: str | None = None) -> str:
    """The sim's greedy answer to the same conversation asked through chat completions."""
    messages = [{"role": "user", "content": text}]
    if instructions is not None:
        messages.insert(0, {"role": "system", "content": instructions})
    body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens}
    return expected_answer("/v1/chat/completions", body)[0]


async def _arrived(c: SimCluster) -> dict[str, list[dict]]:
    return {
        wid: [r["body"] for r in await c.worker_requests(wid) if r["path"] == RESPONSES]
        for wid in c.workers
    }


async def test_a_both_worker_serves_it_whole(redis_prefix: str) -> None:
    async with (
        sim_cluster(redis_prefix=redis_prefix, prefill=0, decode=1, both=1) as c,
        _client(c.router_url) as client,
    ):
        answer = await client.responses.create(
            model=MODEL, input="tell me a story", instructions="be brief", max_output_tokens=7
        )
        assert answer.object == "response"
        assert answer.output_text == _expected("tell me a story", 7, "be brief")
        arrived = await _arrived(c)
        assert [len(arrived[w]) for w in ("d0", "b0")] == [0, 1]
        sent = arrived["b0"][0]
        # The client's fields unchanged, and `store: false` added (the router keeps no state).
        assert sent["input"] == "tell me a story" and sent["instructions"] == "be brief"
        assert sent["max_output_tokens"] == 7 and sent["store"] is False
        assert "kv_transfer_params" not in sent


async def test_without_a_both_worker_a_decode_worker_serves_it(redis_prefix: str) -> None:
    async with (
        sim_cluster(redis_prefix=redis_prefix, prefill=0) as c,
        _client(c.router_url) as client,
    ):
        text = ""
        kinds = []
        stream = await client.responses.create(
            model=MODEL,
            input=[{"role": "user", "content": "stream it"}],
            max_output_tokens=5,
            stream=True,
            store=False,
        )
        async for event in stream:
            kinds.append(event.type)
            if event.type == "response.output_text.delta":
                text += event.delta
        assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
        assert text == _expected("stream it", 5)
        arrived = await _arrived(c)
        assert len(arrived["d0"]) == 1
        assert "kv_transfer_params" not in arrived["d0"][0]
        assert arrived["d0"][0]["stream"] is True and arrived["d0"][0]["store"] is False


@pytest.mark.parametrize("prefill", [0, 1])  # whole on one worker, or the PD path
@pytest.mark.parametrize(
    ("field", "value"),
    [("previous_response_id", "resp_123"), ("store", True), ("background", True)],
)
async def test_stateful_features_are_refused(
    redis_prefix: str, field: str, value: object, prefill: int
) -> None:
    async with (
        sim_cluster(redis_prefix=redis_prefix, prefill=prefill) as c,
        _client(c.router_url) as client,
    ):
        with pytest.raises(openai.BadRequestError) as err:
            await client.responses.create(
                model=MODEL, input="remember me", max_output_tokens=3, **{field: value}
            )
        body = err.value.body
        assert isinstance(body, dict) and body["param"] == field
        assert "the router is stateless" in body["message"]
        assert all(not legs for legs in (await _arrived(c)).values())  # refused before any worker


@pytest.mark.parametrize("prefill", [0, 1])
async def test_unknown_model_and_bad_stream_flag(redis_prefix: str, prefill: int) -> None:
    async with sim_cluster(redis_prefix=redis_prefix, prefill=prefill) as c:
        async with aiohttp.ClientSession() as s:
            bad = {"model": "other", "input": "x"}
            async with s.post(c.router_url + RESPONSES, json=bad) as r:
                assert r.status == 404
                assert (await r.json())["error"]["code"] == "model_not_found"
            bad = {"model": MODEL, "input": "x", "stream": "yes"}
            async with s.post(c.router_url + RESPONSES, json=bad) as r:
                assert r.status == 400
                assert (await r.json())["error"]["param"] == "stream"
            # The worker's own 4xx passes through (a bad `input`).
            bad = {"model": MODEL, "input": 42}
            async with s.post(c.router_url + RESPONSES, json=bad) as r:
                assert r.status == 400
                assert (await r.json())["error"]["message"].startswith("'input' must be")


async def test_a_stream_the_worker_breaks_ends_with_an_error_event(redis_prefix: str) -> None:
    async with (
        sim_cluster(redis_prefix=redis_prefix, prefill=0) as c,
        aiohttp.ClientSession() as s,
    ):
        fault = {"decode_die_after_tokens": 2}
        async with s.post(c.workers["d0"] + "/sim/faults", json=fault) as r:
            assert r.status == 200
        body = {"model": MODEL, "input": "break it", "max_output_tokens": 6, "stream": True}
        async with s.post(c.router_url + RESPONSES, json=body) as r:
            assert r.status == 200
            raw = (await r.read()).decode()
        events = [e for e in raw.split("\n\n") if e]
        assert [e.split("\n")[0] for e in events] == [
            "event: response.created",
            "event: response.output_text.delta",
            "event: response.output_text.delta",
            "event: error",
        ]
        assert "ended the stream early" in events[-1]
        # Charged to the worker that broke it.
        assert c.parts.pools.workers["d0"].breaker.failures == 1
