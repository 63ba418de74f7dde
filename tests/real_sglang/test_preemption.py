"""Issue 31: a stream the router preempts mid-way (forced by the test setting
`preemption.force_after_tokens`) resumes on real SGLang engines — prompt + the text the client
has, re-prefilled, its KV handed over by Mooncake again — with exactly the text a plain SGLang
server gives for the same continuation, and one answer's usage; nothing stays reserved.

**Which reference, and why.** The continuation's KV for the tokens already sent is computed
again by a prefill (an extend after the cached prompt), not by the decode steps that made it
first. On a bf16 model the two paths round differently, and this tiny random model's near-tied
greedy logits turn on such differences: against one uninterrupted answer, the resumed text
parted after 80-190 characters in 4 of 12 runs on a loaded machine (2026-12-05; more tokens go
out per chunk under load, so more are re-prefilled: k was 4-28). That is a property of
recompute-style preemption in any engine, not of the router. So the reference runs the same
computation on the plain server: its first k tokens (k: what the prefill engine was asked to
re-prefill, read from its own prompt-token counter), then, with only the prompt in its prefix
cache as the prefill engine had it, the continuation of prompt + those tokens' text, asked as
the router asks it. The test checks both engines' cache hits agree, so the two computations are
one; the text must then be equal to the character (12 of 12 under the same load, chat and
completions), and the first k tokens must be the uninterrupted answer's."""

from __future__ import annotations

import asyncio
import time

import pytest
from openai import AsyncOpenAI

from tests.real_sglang.conftest import (
    SERVED,
    SglangCluster,
    SglangServer,
    sglang_router,
    unique_prompt,
)
from tests.real_sglang.test_outputs import _messages, ask, reference_client

pytestmark = pytest.mark.real_sglang

MAX_TOKENS = 48
FORCE_AT = 4  # relayed chunks before the router stops the stream (one token each, or more)


def _counters(server: SglangServer) -> tuple[float, float]:
    """(prompt tokens, cached tokens) the server has counted, over all their label sets, from
    one scrape of its /metrics (tests/engines.py `EngineProcess.metrics`)."""
    scraped = server.metrics()

    def total(wanted: str) -> float:
        return sum(v for (name, _), v in scraped.items() if name == wanted)

    return total("sglang:prompt_tokens_total"), total("sglang:cached_tokens_total")


async def _counters_after(
    server: SglangServer, before: tuple[float, float], at_least: float
) -> tuple[float, float]:
    """(prompt tokens, cached tokens) the server counted since `before`, once its prompt-token
    count reaches `at_least` (its tokenizer manager counts a request as it finishes it)."""
    deadline = time.monotonic() + 10.0
    while True:
        prompt, cached = _counters(server)
        now = (prompt - before[0], cached - before[1])
        if now[0] >= at_least or time.monotonic() > deadline:
            return now
        await asyncio.sleep(0.1)


async def _continuation(
    ref: AsyncOpenAI, kind: str, prompt: str, sent: str, max_tokens: int
) -> str:
    """The plain server's continuation of the answer `sent` so far, asked as the router asks
    it (router/request/resume.py `resume_body`): completions append the text to the prompt,
    chat continues the partial assistant message."""
    if kind == "completions":
        rest, _ = await ask(ref, kind, prompt + sent, stream=False, max_tokens=max_tokens)
        return rest
    messages = [*_messages(prompt), {"role": "assistant", "content": sent}]
    r = await ref.chat.completions.create(
        model=SERVED,
        messages=messages,  # type: ignore[arg-type]
        max_tokens=max_tokens,
        temperature=0,
        extra_body={"continue_final_message": True, "add_generation_prompt": False},
    )
    return r.choices[0].message.content or ""


@pytest.mark.parametrize("kind", ["completions", "chat"])
async def test_a_preempted_stream_resumes_with_the_reference_text_and_usage(
    sglang_cluster: SglangCluster, redis_prefix: str, kind: str
) -> None:
    cluster = sglang_cluster
    async with sglang_router(
        cluster, redis_prefix, preemption={"force_after_tokens": FORCE_AT}
    ) as router:
        prompt = unique_prompt(20)
        async with reference_client(cluster.ref) as ref:
            whole, want_usage = await ask(ref, kind, prompt, stream=False, max_tokens=MAX_TOKENS)
        assert want_usage is not None
        prompt_tokens = want_usage[0]

        prefill_before = _counters(cluster.prefill)
        async with router.client() as client:
            got, usage = await ask(client, kind, prompt, stream=True, max_tokens=MAX_TOKENS)
        metrics = router.parts.metrics
        assert metrics.preemptions.labels(reason="forced")._value.get() == 1
        assert usage == want_usage  # one answer's usage, whatever was re-prefilled
        assert set((await router.reserved_blocks()).values()) == {0}

        # What the prefill engine computed: the prompt, then prompt + k sent tokens, the prompt
        # read from its prefix cache.
        asked, cached = await _counters_after(
            cluster.prefill, prefill_before, 2 * prompt_tokens + 1
        )
        k = int(asked) - 2 * prompt_tokens
        assert 0 < k < MAX_TOKENS, (asked, cached)
        assert cached == prompt_tokens, (asked, cached)

    # The same computation on the plain server: its first k tokens from scratch, then only the
    # prompt in its cache (a one-token answer leaves exactly that), then the continuation.
    async with reference_client(cluster.ref) as ref:
        cluster.flush_prefix_caches()
        sent, _ = await ask(ref, kind, prompt, stream=False, max_tokens=k)
        assert whole.startswith(sent)  # the tokens before the preemption are the answer's own
        cluster.flush_prefix_caches()
        await ask(ref, kind, prompt, stream=False, max_tokens=1)
        ref_before = _counters(cluster.ref)
        rest = await _continuation(ref, kind, prompt, sent, MAX_TOKENS - k)
        ref_asked, ref_cached = await _counters_after(cluster.ref, ref_before, prompt_tokens + k)
    assert (ref_asked, ref_cached) == (prompt_tokens + k, cached), "not the same computation"
    assert got == sent + rest
