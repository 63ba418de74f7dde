"""Issue 23 on real SGLang engines: what the front door does when the world misbehaves.

- 64 requests at once: each pair meets under its own bootstrap room (two requests under one
  room would cross their KV or hang), every answer exactly one engine's.
- A client that leaves mid-stream: both legs are aborted (the engines' running and queued
  counts return to 0 long before the answer could have ended), nothing stays reserved.
- A decode engine SIGKILLed mid-stream: the stream resumes on the other decode engine, and the
  client's whole answer is exactly one engine's (no token repeated, none lost).
- The prefill engine SIGKILLed while a request waits on it: the request ends with a clean
  error and the decode side is freed (its running count back to 0, nothing reserved) —
  sglang-router's gateway is known to hang forever there (lightseekorg/smg #831).

Killed engines are restarted by the next test's router fixture (`ensure_running`)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp
import pytest
from openai import AsyncOpenAI

from tests.real_sglang.conftest import (
    SERVED,
    SglangCluster,
    SglangRouter,
    SglangServer,
    unique_prompt,
)
from tests.real_sglang.test_outputs import ask, reference_client
from tests.real_vllm.conftest import wait_for

pytestmark = pytest.mark.real_sglang

# Long answers (greedy, EOS ignored): a one-thread CPU engine makes a few hundred tokens a
# second, so these outlast a kill or a disconnect by many seconds.
LONG = 4000
IGNORE_EOS = {"ignore_eos": True}


def busy(servers: list[SglangServer]) -> float:
    return sum(s.running_requests() for s in servers)


def generated(servers: list[SglangServer]) -> float:
    return sum(
        v
        for s in servers
        for (name, _), v in s.metrics().items()
        if name == "sglang:generation_tokens_total"
    )


async def nothing_reserved(router: SglangRouter) -> None:
    async def released() -> bool | dict[str, int]:
        reserved = await router.reserved_blocks()
        return not any(reserved.values()) or reserved

    await wait_for(released, 15, "reservations back to zero")


async def test_64_at_once_each_pair_under_its_own_room(
    sglang_cluster: SglangCluster, router: SglangRouter
) -> None:
    prompts = [unique_prompt(10) for _ in range(64)]
    async with reference_client(sglang_cluster.ref) as ref:
        gate = asyncio.Semaphore(16)

        async def one_ref(p: str) -> str:
            async with gate:
                return (await ask(ref, "completions", p, stream=False, max_tokens=12))[0]

        want = await asyncio.gather(*(one_ref(p) for p in prompts))
    async with router.client() as client:
        got = await asyncio.gather(
            *(ask(client, "completions", p, stream=True, max_tokens=12) for p in prompts)
        )
    assert [text for text, _ in got] == want
    await nothing_reserved(router)


async def _open_stream(client: AsyncOpenAI, prompt: str) -> Any:
    return await client.completions.create(
        model=SERVED,
        prompt=prompt,
        max_tokens=LONG,
        temperature=0,
        stream=True,
        extra_body=IGNORE_EOS,
    )


async def test_a_client_that_leaves_aborts_both_legs(
    sglang_cluster: SglangCluster, router: SglangRouter
) -> None:
    pd = sglang_cluster.pd
    before = generated(sglang_cluster.decodes)
    async with router.client() as client:
        stream = await _open_stream(client, unique_prompt(12))
        seen = 0
        async for _ in stream:
            seen += 1
            if seen == 5:
                break
        assert busy(sglang_cluster.decodes) >= 1  # generating for the client still there
        await stream.close()
        gone_at = time.monotonic()
    await wait_for(lambda: busy(pd) == 0 or busy(pd), 60, "the engines run the abandoned request")
    stopped_s = time.monotonic() - gone_at
    wasted = generated(sglang_cluster.decodes) - before
    print(f"\ndecode stopped {stopped_s:.2f} s after the client left, {wasted:.0f} of {LONG}")
    assert wasted < LONG
    await nothing_reserved(router)


async def _serving(router: SglangRouter) -> SglangServer | None:
    reserved = await router.reserved_blocks()
    on = [d for d in router.cluster.decodes if reserved.get(d.name, 0) > 0]
    return on[0] if len(on) == 1 else None


async def test_a_decode_engine_killed_mid_stream_resumes_on_the_other(
    sglang_cluster: SglangCluster, router: SglangRouter
) -> None:
    prompt = unique_prompt(16)
    answer_tokens = 600
    async with reference_client(sglang_cluster.ref) as ref:
        want = (
            (
                await ref.completions.create(
                    model=SERVED,
                    prompt=prompt,
                    max_tokens=answer_tokens,
                    temperature=0,
                    extra_body=IGNORE_EOS,
                )
            )
            .choices[0]
            .text
        )
    chunks: list[str] = []
    killed: SglangServer | None = None
    async with router.client() as client:
        stream = await client.completions.create(
            model=SERVED,
            prompt=prompt,
            max_tokens=answer_tokens,
            temperature=0,
            stream=True,
            extra_body=IGNORE_EOS,
        )
        async for piece in stream:
            chunks += [c.text for c in piece.choices if c.text]
            if killed is None and len(chunks) >= 4:
                victim = await _serving(router)
                assert victim is not None, await router.reserved_blocks()
                victim.kill()
                killed = victim
    assert killed is not None, f"the stream ended before the kill ({len(chunks)} chunks)"
    assert router.parts.metrics.resumes._value.get() >= 1
    assert "".join(chunks) == want
    await nothing_reserved(router)


async def test_a_prefill_engine_killed_ends_the_request_and_frees_the_decode(
    sglang_cluster: SglangCluster, router: SglangRouter
) -> None:
    """The request's legs go out together; the prefill engine dies before it answers. The
    client gets an error, not a hang; the decode engine, left waiting for KV that will never
    come, is told (its leg aborted) and holds nothing; the router's reservation is released."""
    prefill = sglang_cluster.prefill
    # A long prompt, so the prefill takes a moment; the kill lands while the legs are out.
    body = {
        "model": SERVED,
        "prompt": unique_prompt(3000),
        "max_tokens": 16,
        "temperature": 0,
    }
    started = time.monotonic()
    async with aiohttp.ClientSession() as session:
        request = asyncio.ensure_future(session.post(router.url + "/v1/completions", json=body))
        await wait_for(
            lambda: busy(sglang_cluster.decodes) >= 1 or busy([prefill]) >= 1,
            60,
            "the legs reached the engines",
            interval=0.05,
        )
        prefill.kill()
        async with await asyncio.wait_for(request, 120) as resp:
            status, answer = resp.status, await resp.json(content_type=None)
    print(f"\nprefill killed: {status} after {time.monotonic() - started:.1f} s: {answer}")
    assert status in (502, 503, 504), answer
    assert set(answer["error"]) >= {"message", "type", "code"}
    await wait_for(
        lambda: busy(sglang_cluster.decodes) == 0 or busy(sglang_cluster.decodes),
        60,
        "the decode engines still hold the request whose prefill died",
    )
    await nothing_reserved(router)
