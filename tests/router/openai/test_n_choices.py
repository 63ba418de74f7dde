"""`n` > 1 through the router (docs/real-workers.md, "`n` > 1"): served whole by the decode
worker (no prefill leg, no KV handoff), every choice kept in streams, whole and assembled
answers, the reservation sized for the n choices, no mid-stream resume, bad `n` refused. The
official `openai` client, a real router and Redis, simulated workers."""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

import aiohttp
import orjson
import pytest
from openai import AsyncOpenAI

from disagg_tools.sim.textgen import expected_choice
from policies.base import RequestInfo, blocks_for, extra_choice_tokens
from tests.conftest import MODEL, SimCluster, sim_cluster

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
FAST_RETRY = {"backoff_base_s": 0.005, "backoff_max_s": 0.02}


def _client(url: str) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=30)


def _body(path: str, tag: str, **extra: Any) -> dict[str, Any]:
    prompt = f"n choices, case {tag}: tell me a story"
    body: dict[str, Any] = {"model": MODEL, "max_tokens": 12, "ignore_eos": True, **extra}
    if path == CHAT:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    return body


def _expected(path: str, body: dict[str, Any], n: int) -> list[str]:
    return [expected_choice(path, body, i)[0] for i in range(n)]


async def _quiet(c: SimCluster) -> None:
    """Nothing reserved, nothing stranded, no lease held once the cluster is idle."""
    for _ in range(100):
        if not any((await c.reserved_blocks()).values()) and not any((await c.stranded()).values()):
            break
        await asyncio.sleep(0.05)
    assert set((await c.reserved_blocks()).values()) == {0}
    assert set((await c.stranded()).values()) == {0}
    assert c.parts.leases.live == {}


async def _served_whole_on_decode(c: SimCluster, path: str, n: int) -> None:
    """The prefill worker saw nothing; the decode worker got the request with its `n` and no
    KV handle (it prefilled itself)."""
    assert [r for r in await c.worker_requests("p0") if r["path"] == path] == []
    decoded = [r["body"] for r in await c.worker_requests("d0") if r["path"] == path]
    assert decoded and all(b["n"] == n and "kv_transfer_params" not in b for b in decoded)


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS], ids=["chat", "completions"])
async def test_streamed_choices_all_arrive_by_index(redis_prefix: str, path: str) -> None:
    async with sim_cluster(redis_prefix=redis_prefix) as c, _client(c.router_url) as client:
        body = _body(path, "stream", n=3, seed=7)
        args = {k: v for k, v in body.items() if k not in ("model", "ignore_eos")}
        extra = {"ignore_eos": True}
        texts: dict[int, list[str]] = {}
        usage = None
        kwargs: dict[str, Any] = {"stream": True, "stream_options": {"include_usage": True}}
        if path == CHAT:
            stream = await client.chat.completions.create(
                model=MODEL, extra_body=extra, **args, **kwargs
            )
        else:
            stream = await client.completions.create(
                model=MODEL, extra_body=extra, **args, **kwargs
            )
        async for chunk in stream:
            for choice in chunk.choices:
                piece = choice.delta.content if path == CHAT else choice.text  # type: ignore[union-attr]
                texts.setdefault(choice.index, []).append(piece or "")
            if chunk.usage is not None:
                usage = chunk.usage
        want = _expected(path, body, 3)
        assert sorted(texts) == [0, 1, 2]
        assert ["".join(texts[i]) for i in range(3)] == want
        assert len(set(want)) == 3  # the choices differ
        assert usage is not None and usage.completion_tokens == 3 * 12
        await _served_whole_on_decode(c, path, 3)
        await _quiet(c)


@pytest.mark.parametrize("assemble", [True, False], ids=["assembled", "whole"])
@pytest.mark.parametrize("path", [CHAT, COMPLETIONS], ids=["chat", "completions"])
async def test_whole_answers_keep_every_choice(
    redis_prefix: str, path: str, assemble: bool
) -> None:
    async with (
        sim_cluster(redis_prefix=redis_prefix, upstream={"assemble_non_streaming": assemble}) as c,
        _client(c.router_url) as client,
    ):
        body = _body(path, "whole", n=3)
        args = {k: v for k, v in body.items() if k not in ("model", "ignore_eos")}
        extra = {"ignore_eos": True}
        if path == CHAT:
            answer: Any = await client.chat.completions.create(
                model=MODEL, extra_body=extra, **args
            )
            got = [ch.message.content for ch in answer.choices]
        else:
            answer = await client.completions.create(model=MODEL, extra_body=extra, **args)
            got = [ch.text for ch in answer.choices]
        assert [ch.index for ch in answer.choices] == [0, 1, 2]
        assert got == _expected(path, body, 3)
        assert [ch.finish_reason for ch in answer.choices] == ["length"] * 3
        assert answer.usage.completion_tokens == 3 * 12
        # Choice 0 is the answer an n=1 request gets.
        one = {**body, "n": 1}
        assert got[0] == expected_choice(path, one, 0)[0]
        await _served_whole_on_decode(c, path, 3)
        await _quiet(c)


async def _reserved_while_streaming(c: SimCluster, n: int) -> int:
    """The decode reservation of a streamed request of `n` choices, read at its first event."""
    body = _body(CHAT, f"reserve {n}", n=n, max_tokens=200, stream=True)
    async with aiohttp.ClientSession() as s, s.post(c.router_url + CHAT, json=body) as r:
        assert r.status == 200
        await r.content.readline()
        reserved = sum((await c.reserved_blocks()).values())
        await r.read()
    await _quiet(c)
    return reserved


async def test_reservation_grows_with_n(redis_prefix: str) -> None:
    """Four choices hold four outputs: the reservation is sized for them (at least four times
    the output blocks of one), and is back to 0 afterwards."""
    async with sim_cluster(redis_prefix=redis_prefix, time_scale=20.0) as c:
        one = await _reserved_while_streaming(c, 1)
        four = await _reserved_while_streaming(c, 4)
        assert one > 0
        assert four > one
        prompt_blocks = 1  # the prompt is a few tokens: under one block
        assert four - prompt_blocks >= 4 * (one - prompt_blocks)


async def _expected_end_while_streaming(c: SimCluster, n: int) -> float:
    """How long after placement this replica expects the answer of `n` choices to end (what
    prediction-based admission counts on freeing), read at the stream's first event."""
    body = _body(CHAT, f"ends {n}", n=n, max_tokens=200, stream=True)
    async with aiohttp.ClientSession() as s, s.post(c.router_url + CHAT, json=body) as r:
        assert r.status == 200
        await r.content.readline()
        ((_, end),) = c.parts.leases.expected.values()
        left = end - c.parts.clock()
        await r.read()
    await _quiet(c)
    return left


async def test_the_choices_decode_side_by_side_so_the_answer_ends_as_one_choice_does(
    redis_prefix: str,
) -> None:
    """Four choices are one batch on the decode worker: the lease's expected end is one choice's
    decode time (200 tokens), not four choices' back to back."""
    async with sim_cluster(redis_prefix=redis_prefix, time_scale=20.0) as c:
        one = await _expected_end_while_streaming(c, 1)
        four = await _expected_end_while_streaming(c, 4)
        assert one > 0 and four > 0
        assert four < 1.5 * one, (one, four)


def test_extra_choice_tokens_bound_the_blocks_n_choices_hold() -> None:
    """blocks_for(prompt + n * out + extra) is at least the blocks of n choices that share the
    prompt's full blocks (floor(P / bs) + n * ceil((P % bs + out) / bs)); exact for n = 1."""
    for prompt, out, n, bs in itertools.product(
        range(0, 70, 3), (1, 5, 16, 33), (1, 2, 3, 7), (4, 16)
    ):
        held = prompt // bs + n * -(-(prompt % bs + out) // bs)
        got = blocks_for(prompt + n * out + extra_choice_tokens(prompt, n, bs), bs)
        assert got >= held, (prompt, out, n, bs)
        if n == 1:
            assert got == blocks_for(prompt + out, bs)
    info = RequestInfo("r", MODEL, prompt_tokens=20, max_tokens=10, n=3, block_size=16)
    assert info.reserve_choice_tokens == 10
    assert info.reserve_output_tokens == 3 * 10 + 2 * (20 % 16 + 15)


async def test_broken_stream_of_several_choices_ends_with_an_error_not_a_resume(
    redis_prefix: str,
) -> None:
    async with sim_cluster(redis_prefix=redis_prefix, decode=2, retry=FAST_RETRY) as c:
        for wid in ("d0", "d1"):
            await _faults(c, wid, decode_die_after_tokens=5, count=1)
        body = _body(CHAT, "broken", n=2, max_tokens=30, stream=True)
        async with aiohttp.ClientSession() as s, s.post(c.router_url + CHAT, json=body) as r:
            assert r.status == 200
            raw = await r.read()
        assert raw.endswith(b"data: [DONE]\n\n")
        events = [orjson.loads(e[6:]) for e in raw.split(b"\n\n") if e and e != b"data: [DONE]"]
        errors = [e["error"] for e in events if "error" in e]
        assert len(errors) == 1 and "n > 1" in errors[0]["message"]
        tokens = [ch for e in events for ch in e.get("choices", ()) if ch["delta"].get("content")]
        assert len(tokens) == 5  # what came before the cut, nothing after
        assert c.parts.metrics.resumes._value.get() == 0
        await _quiet(c)


async def test_failure_before_the_first_token_is_retried(redis_prefix: str) -> None:
    async with sim_cluster(redis_prefix=redis_prefix, retry=FAST_RETRY) as c:
        await _faults(c, "d0", decode_fail_before_first=True, count=1)
        body = _body(CHAT, "retried", n=2, stream=True)
        async with aiohttp.ClientSession() as s, s.post(c.router_url + CHAT, json=body) as r:
            raw = await r.read()
        assert r.status == 200
        texts: dict[int, str] = {}
        for e in raw.split(b"\n\n"):
            if e and e != b"data: [DONE]":
                for ch in orjson.loads(e[6:])["choices"]:
                    texts[ch["index"]] = texts.get(ch["index"], "") + (
                        ch["delta"].get("content") or ""
                    )
        assert [texts[0], texts[1]] == _expected(CHAT, body, 2)
        assert c.parts.metrics.retries.labels(side="decode")._value.get() == 1
        await _quiet(c)


async def _faults(c: SimCluster, wid: str, **faults: Any) -> None:
    async with (
        aiohttp.ClientSession() as s,
        s.post(c.workers[wid] + "/sim/faults", json=faults) as r,
    ):
        assert r.status == 200, await r.text()


@pytest.mark.parametrize(
    ("n", "why"),
    [
        (0, "at least 1"),
        (-1, "at least 1"),
        (9, "at most 8"),
        (1000, "at most 8"),
        ("3", "integer"),
    ],
    ids=["zero", "negative", "over-cap", "far-over-cap", "string"],
)
async def test_bad_n_is_a_400_naming_n(redis_prefix: str, n: Any, why: str) -> None:
    async with sim_cluster(redis_prefix=redis_prefix, api={"max_n": 8}) as c:
        body = _body(CHAT, "bad", n=n)
        async with aiohttp.ClientSession() as s, s.post(c.router_url + CHAT, json=body) as r:
            assert r.status == 400
            error = (await r.json())["error"]
        assert error["param"] == "n" and why in error["message"]
        assert error["type"] == "invalid_request_error"
        assert await c.worker_requests("d0") == []  # refused before any worker saw it
        await _quiet(c)
