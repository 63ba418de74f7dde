"""`POST /v1/responses` through the prefill/decode path (router/openai/responses_pd.py): the
official
`openai` client in front of 1 prefill + 1 decode simulated worker. The prefill worker gets the
prefill leg (`max_output_tokens: 1`, not streamed, not stored, the `do_remote_decode` skeleton),
the decode worker pulls its KV and streams; nothing is left reserved or stranded after, whatever
failed. Also the Responses mode of the SSE cutter (router/relay/sse_cut.py) and the sim's side of
the
protocol (a decode refuses KV that is not its prompt's, as for chat)."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import orjson
import pytest
from openai import AsyncOpenAI

from disagg_tools.sim.textgen import expected_answer
from router.errors import InvalidRequest
from router.openai.responses_pd import parse_responses, prefill_body
from router.relay.sse_cut import SseCutter
from router.request.assemble import assembled
from tests.conftest import MODEL, SimCluster, sim_cluster

RESPONSES = "/v1/responses"


def _client(url: str) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=30)


def _expected(text: str, max_tokens: int, instructions: str | None = None) -> tuple[str, int]:
    """The sim's greedy answer to the same conversation asked through chat completions."""
    messages = [{"role": "user", "content": text}]
    if instructions is not None:
        messages.insert(0, {"role": "system", "content": instructions})
    body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens}
    answer, n, _ = expected_answer("/v1/chat/completions", body)
    return answer, n


async def _legs(c: SimCluster, wid: str) -> list[dict[str, Any]]:
    return [r["body"] for r in await c.worker_requests(wid) if r["path"] == RESPONSES]


async def _counters(c: SimCluster, wid: str) -> dict[str, int]:
    return dict((await c.worker_state(wid))["counters"])


async def _nothing_held(c: SimCluster) -> None:
    """Every reservation released and every stranded entry cleared (the unstrand is a
    background job: give it a moment)."""
    for _ in range(100):
        if set((await c.reserved_blocks()).values()) == {0} and set(
            (await c.stranded()).values()
        ) == {0}:
            break
        await asyncio.sleep(0.02)
    assert set((await c.reserved_blocks()).values()) == {0}
    assert set((await c.stranded()).values()) == {0}
    assert not c.parts.leases.live


async def _fault(c: SimCluster, wid: str, fault: dict[str, Any]) -> None:
    async with (
        aiohttp.ClientSession() as s,
        s.post(c.workers[wid] + "/sim/faults", json=fault) as r,
    ):
        assert r.status == 200, await r.text()


def _assert_prefill_leg(leg: dict[str, Any], client_body: dict[str, Any]) -> None:
    assert leg["max_output_tokens"] == 1 and "max_tokens" not in leg
    assert leg["stream"] is False and leg["store"] is False
    assert leg["kv_transfer_params"]["do_remote_decode"] is True
    assert leg["input"] == client_body["input"]


async def test_a_stream_is_prefilled_on_p0_and_decoded_on_d0(redis_prefix: str) -> None:
    async with sim_cluster(redis_prefix=redis_prefix) as c, _client(c.router_url) as client:
        want, n = _expected("tell me a story", 9, "be brief")
        stream = await client.responses.create(
            model=MODEL,
            input="tell me a story",
            instructions="be brief",
            max_output_tokens=9,
            stream=True,
        )
        kinds, text, completed = [], "", None
        async for event in stream:
            kinds.append(event.type)
            if event.type == "response.output_text.delta":
                text += event.delta
            if event.type == "response.completed":
                completed = event.response
        assert text == want
        assert kinds == ["response.created"] + ["response.output_text.delta"] * n + [
            "response.completed"
        ]
        assert completed is not None and completed.output_text == want
        assert completed.usage is not None and completed.usage.output_tokens == n

        (p_leg,) = await _legs(c, "p0")
        (d_leg,) = await _legs(c, "d0")
        _assert_prefill_leg(p_leg, {"input": "tell me a story"})
        assert d_leg["stream"] is True and d_leg["store"] is False
        assert d_leg["max_output_tokens"] == 9 and d_leg["instructions"] == "be brief"
        assert d_leg["kv_transfer_params"]["do_remote_prefill"] is True
        # The workers' own accounting: p0 ran a prefill, d0 pulled its KV instead of computing.
        p0, d0 = await _counters(c, "p0"), await _counters(c, "d0")
        assert p0["requests:prefill"] == 1 and p0["prompt_by_source:local_compute"] > 0
        assert d0["requests:remote_decode"] == 1 and d0["kv_pulled"] == 1
        assert d0.get("prompt_by_source:local_compute", 0) == 0
        assert d0["prompt_by_source:external_kv_transfer"] > 0
        # The router's: one placement p0 -> d0, reserved and released.
        placed = c.parts.metrics.placements.labels(prefill="p0", decode="d0")._value.get()
        assert placed == 1
        await _nothing_held(c)


async def test_a_whole_answer_is_assembled_from_the_decode_stream(redis_prefix: str) -> None:
    async with sim_cluster(redis_prefix=redis_prefix) as c, _client(c.router_url) as client:
        want, n = _expected("one more", 6)
        items = [{"role": "user", "content": [{"type": "input_text", "text": "one more"}]}]
        answer = await client.responses.create(model=MODEL, input=items, max_output_tokens=6)
        assert answer.object == "response" and answer.output_text == want
        assert answer.usage is not None and answer.usage.output_tokens == n
        (p_leg,) = await _legs(c, "p0")
        (d_leg,) = await _legs(c, "d0")
        _assert_prefill_leg(p_leg, {"input": items})
        # Asked whole, streamed from the decode worker (the first event clears the stranded KV).
        assert d_leg["stream"] is True and "stream_options" not in d_leg
        await _nothing_held(c)


async def test_a_failed_prefill_is_retried(redis_prefix: str) -> None:
    async with sim_cluster(redis_prefix=redis_prefix) as c, _client(c.router_url) as client:
        await _fault(c, "p0", {"prefill_fail": True, "count": 1})
        want, _ = _expected("try again", 5)
        answer = await client.responses.create(model=MODEL, input="try again", max_output_tokens=5)
        assert answer.output_text == want
        legs = await _legs(c, "p0")
        assert len(legs) == 2 and all(leg["max_output_tokens"] == 1 for leg in legs)
        assert len(await _legs(c, "d0")) == 1  # the decode leg only after a prefill that worked
        assert c.parts.metrics.retries.labels(side="prefill")._value.get() == 1
        await _nothing_held(c)


@pytest.mark.parametrize(
    "fault",
    [
        {"decode_fail_before_first": True, "count": 1},  # a 500 before any token
        {"decode_error_event_after_tokens": 0, "count": 1},  # 200, then an error event
    ],
)
async def test_a_decode_failure_before_the_first_token_is_retried(
    redis_prefix: str, fault: dict[str, Any]
) -> None:
    async with sim_cluster(redis_prefix=redis_prefix) as c, _client(c.router_url) as client:
        await _fault(c, "d0", fault)
        want, n = _expected("again please", 7)
        stream = await client.responses.create(
            model=MODEL, input="again please", max_output_tokens=7, stream=True
        )
        kinds, text = [], ""
        async for event in stream:
            kinds.append(event.type)
            if event.type == "response.output_text.delta":
                text += event.delta
        # One clean stream: the failed try sent the client nothing (not even response.created).
        assert text == want and kinds.count("response.created") == 1
        assert kinds[-1] == "response.completed" and "error" not in kinds
        assert len(await _legs(c, "p0")) == 2 and len(await _legs(c, "d0")) == 2
        await _nothing_held(c)


async def test_a_decode_break_mid_stream_ends_with_an_error_event(redis_prefix: str) -> None:
    async with sim_cluster(redis_prefix=redis_prefix) as c, _client(c.router_url) as client:
        await _fault(c, "d0", {"decode_die_after_tokens": 3})
        want, _ = _expected("break it", 8)
        stream = await client.responses.create(
            model=MODEL, input="break it", max_output_tokens=8, stream=True
        )
        events = [event async for event in stream]
        kinds = [e.type for e in events]
        assert kinds == ["response.created"] + ["response.output_text.delta"] * 3 + ["error"]
        deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        assert want.startswith(deltas) and deltas != want  # what came was right, then the error
        assert "ended the stream early" in events[-1].message
        # No resume for Responses: the decode worker got one leg, and is charged for the break.
        assert len(await _legs(c, "d0")) == 1
        assert c.parts.pools.workers["d0"].breaker.failures == 1
        assert c.parts.metrics.resumes._value.get() == 0
        await _nothing_held(c)


async def test_an_answer_longer_than_reserved_grows_the_reservation(redis_prefix: str) -> None:
    """The reservation is sized by the client's hint (2 tokens); the answer streams 96 output
    text deltas, counted as tokens, so the reservation grows while it streams."""
    async with (
        sim_cluster(
            redis_prefix=redis_prefix, estimates={"estimator": "hint", "trust_hints": True}
        ) as c,
        aiohttp.ClientSession() as s,
    ):
        body = {
            "model": MODEL,
            "input": "a long answer",
            "max_output_tokens": 96,
            "ignore_eos": True,
            "stream": True,
        }
        hint = {"X-Expected-Output-Tokens": "2"}
        async with s.post(c.router_url + RESPONSES, json=body, headers=hint) as r:
            assert r.status == 200
            raw = await r.read()
        assert raw.count(b"event: response.output_text.delta\n") == 96
        assert raw.rstrip().split(b"\n\n")[-1].startswith(b"event: response.completed\n")
        m = c.parts.metrics
        assert m.reservation_overruns._value.get() == 1  # the delta count outgrew 2 tokens
        assert m.output_tokens._sum.get() == 96  # the release recorded the whole answer
        await _nothing_held(c)


async def test_a_client_that_leaves_mid_stream_leaves_nothing_held(redis_prefix: str) -> None:
    async with sim_cluster(redis_prefix=redis_prefix) as c, aiohttp.ClientSession() as s:
        body = {"model": MODEL, "input": "long one", "max_output_tokens": 400, "stream": True}
        async with s.post(c.router_url + RESPONSES, json=body) as r:
            assert r.status == 200
            await r.content.readuntil(b"event: response.output_text.delta\n")
        await _nothing_held(c)


async def test_without_a_prefill_pool_a_decode_worker_serves_it_whole(redis_prefix: str) -> None:
    async with (
        sim_cluster(redis_prefix=redis_prefix, prefill=0, decode=1) as c,
        _client(c.router_url) as client,
    ):
        want, _ = _expected("no prefill", 4)
        answer = await client.responses.create(model=MODEL, input="no prefill", max_output_tokens=4)
        assert answer.output_text == want
        (d_leg,) = await _legs(c, "d0")
        assert "kv_transfer_params" not in d_leg and d_leg["store"] is False
        assert (await _counters(c, "d0"))["requests:local"] == 1
        # The whole-on-one-worker path holds no reservation.
        assert c.parts.metrics.placements.labels(prefill="local", decode="d0")._value.get() == 0


async def test_built_in_tools_are_served_whole(redis_prefix: str) -> None:
    async with sim_cluster(redis_prefix=redis_prefix) as c, aiohttp.ClientSession() as s:
        body = {
            "model": MODEL,
            "input": "search it",
            "max_output_tokens": 3,
            "tools": [{"type": "web_search_preview"}],
        }
        async with s.post(c.router_url + RESPONSES, json=body) as r:
            assert r.status == 200, await r.text()
        assert await _legs(c, "p0") == [] and len(await _legs(c, "d0")) == 1


async def test_responses_split_false_serves_it_whole_beside_a_prefill_pool(
    redis_prefix: str,
) -> None:
    """The operator's switch for a vLLM before 0.32 (it ignores kv_transfer_params on Responses):
    every Responses request whole on one worker, chat still split."""
    async with (
        sim_cluster(redis_prefix=redis_prefix, api={"responses_split": False}) as c,
        _client(c.router_url) as client,
    ):
        want, _ = _expected("whole please", 4)
        answer = await client.responses.create(
            model=MODEL, input="whole please", max_output_tokens=4
        )
        assert answer.output_text == want
        assert await _legs(c, "p0") == []
        (d_leg,) = await _legs(c, "d0")
        assert "kv_transfer_params" not in d_leg
        chat = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "split"}], max_tokens=3
        )
        assert chat.choices[0].message.content
        assert (await _counters(c, "p0")).get("requests:prefill") == 1


async def test_the_sim_decode_refuses_kv_that_is_not_its_prompts(redis_prefix: str) -> None:
    async with sim_cluster(redis_prefix=redis_prefix) as c, aiohttp.ClientSession() as s:
        skeleton = {"do_remote_decode": True, "do_remote_prefill": False}
        pre = {"model": MODEL, "input": "prompt A", "max_output_tokens": 1, "stream": False}
        async with s.post(
            c.workers["p0"] + RESPONSES, json={**pre, "kv_transfer_params": skeleton}
        ) as r:
            assert r.status == 200
            params = (await r.json())["kv_transfer_params"]
        assert params["do_remote_prefill"] is True and params["remote_block_ids"]
        crossed = {"model": MODEL, "input": "prompt B", "kv_transfer_params": params}
        async with s.post(c.workers["d0"] + RESPONSES, json=crossed) as r:
            assert r.status == 400
            err = (await r.json())["error"]
        assert err["param"] == "kv_transfer_params" and "do not match" in err["message"]
        unknown = {**params, "remote_request_id": "never-prefilled"}
        bogus = {"model": MODEL, "input": "prompt A", "kv_transfer_params": unknown}
        async with s.post(c.workers["d0"] + RESPONSES, json=bogus) as r:
            assert r.status == 400
            assert "is not held by" in (await r.json())["error"]["message"]
        # Without do_remote_decode a prefill worker refuses it, as a generation request.
        async with s.post(c.workers["p0"] + RESPONSES, json=pre) as r:
            assert r.status == 400


# -- the pieces, without a cluster ---------------------------------------------------------------


def _event(kind: str, **fields: Any) -> bytes:
    return (
        b"event: " + kind.encode() + b"\ndata: " + orjson.dumps({"type": kind, **fields}) + b"\n\n"
    )


CREATED = _event("response.created", response={"id": "r", "status": "in_progress"})
DELTA = _event("response.output_text.delta", delta=" tok")
DONE = _event("response.completed", response={"id": "r", "usage": {"output_tokens": 2}})


def test_the_cutter_holds_the_opening_events_until_the_decode_produces() -> None:
    cutter = SseCutter(chat=False, responses=True)
    assert cutter.feed(CREATED) == b""  # held: vLLM sends it before the KV pull
    assert cutter.feed(_event("response.in_progress")) == b""
    out = cutter.feed(DELTA[:10])
    assert out == b""
    out = cutter.feed(DELTA[10:] + DELTA)
    assert out == CREATED + _event("response.in_progress") + DELTA + DELTA
    assert cutter.tokens == 2 and not cutter.finished
    assert cutter.feed(DONE) == DONE and cutter.finished and cutter.stop is None


def test_the_cutter_stops_at_an_error_event_and_sends_nothing_of_it() -> None:
    cutter = SseCutter(chat=False, responses=True)
    failed = _event("error", code="server_error", message="KV pull failed")
    assert cutter.feed(CREATED + failed) == b""  # before any output: the client gets nothing
    assert cutter.stop is not None and "KV pull failed" in cutter.stop
    cutter = SseCutter(chat=False, responses=True)
    gone = _event("response.failed", response={"error": {"message": "engine died"}})
    assert cutter.feed(CREATED + DELTA + gone) == CREATED + DELTA
    assert cutter.stop is not None and "engine died" in cutter.stop and not cutter.finished
    # A delta whose text mentions the events is just text.
    tricky = _event("response.output_text.delta", delta="event: error\n")
    cutter = SseCutter(chat=False, responses=True)
    assert cutter.feed(tricky) == tricky and cutter.stop is None and cutter.tokens == 1


def test_assembled_is_the_completed_events_response() -> None:
    assert assembled([CREATED, DELTA, DONE]) == {"id": "r", "usage": {"output_tokens": 2}}
    assert assembled([CREATED, DELTA]) is None


def test_the_prefill_leg_caps_max_output_tokens() -> None:
    adapter_body = {"input": "x", "max_tokens": 1, "stream": False, "max_output_tokens": 50}
    leg = prefill_body(adapter_body)
    assert leg == {"input": "x", "stream": False, "max_output_tokens": 1, "store": False}


def test_parse_estimates_and_validates() -> None:
    def parse(body: dict[str, Any], max_model_len: int | None = 1000) -> Any:
        return parse_responses(orjson.dumps(body), models=(MODEL,), max_model_len=max_model_len)

    p = parse({"input": "x" * 400, "instructions": "y" * 40, "max_output_tokens": 16.0})
    assert p.model == MODEL and p.max_tokens == 16 and p.body["max_output_tokens"] == 16
    assert 100 <= p.prompt_tokens <= 120 and p.body["store"] is False and p.stream is False
    items = [{"role": "user", "content": [{"type": "input_text", "text": "z" * 400}]}] * 2
    assert parse({"input": items}).prompt_tokens >= 200
    assert parse({"input": "x"}).max_tokens == 1000 - parse({"input": "x"}).prompt_tokens
    for bad, param in [
        ({"input": 42}, "input"),
        ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
        ({"input": "x", "max_output_tokens": "9"}, "max_output_tokens"),
        ({"input": "x", "max_output_tokens": 5000}, "max_output_tokens"),
        ({"input": "x", "instructions": 3}, "instructions"),
        ({"input": "x", "store": True}, "store"),
        # Schema booleans (the schema fuzz once saw a float accepted as "not true").
        ({"input": "x", "store": 1.2e-201}, "store"),
        ({"input": "x", "store": 0}, "store"),
        ({"input": "x", "background": "no"}, "background"),
    ]:
        with pytest.raises(InvalidRequest) as err:
            parse(bad)
        assert err.value.param == param, bad


def test_responses_prompts_get_prefix_hashes_like_chat() -> None:
    """Placement's prefix affinity reads a Responses prompt (instructions, then the input items)
    as it reads a chat one: prompts sharing a prefix share exactly its leading hashes."""
    from router.openai.api import RESPONSES
    from router.openai.prompt_text import BLOCK_CHARS, prefix_hashes

    system = "s" * (2 * BLOCK_CHARS)

    def body(tail: str) -> dict[str, object]:
        items = [{"role": "user", "content": [{"type": "input_text", "text": tail}]}]
        return {"instructions": system, "input": items}

    a = prefix_hashes(RESPONSES, body("a" * BLOCK_CHARS))
    b = prefix_hashes(RESPONSES, body("b" * BLOCK_CHARS))
    assert len(a) == len(b) == 3 and a[:2] == b[:2] and a[2] != b[2]
    as_string = prefix_hashes(RESPONSES, {"instructions": system, "input": "a" * BLOCK_CHARS})
    assert as_string == a  # an input string and one text item are the same prompt
    assert prefix_hashes(RESPONSES, {"input": "short"}) == ()
