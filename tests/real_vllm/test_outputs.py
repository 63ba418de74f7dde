"""Issue 7, test 1: through the router (real prefill → NIXL → real decode), greedy output equals
the answer one engine computes alone, token for token: chat and completions, streamed and not."""

from __future__ import annotations

import pytest

from tests.real_vllm.conftest import RealRouter, ask, reference, unique_prompt

pytestmark = pytest.mark.real_vllm

MAX_TOKENS = 32


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("kind", ["chat", "completions"])
async def test_routed_answer_equals_reference(router: RealRouter, kind: str, stream: bool) -> None:
    prompt = unique_prompt(20, tag=f"{kind} {'stream' if stream else 'whole'}")
    async with router.client() as client:
        text, usage = await ask(client, kind, prompt, MAX_TOKENS, stream=stream)
    expected = await reference(router.cluster.decodes[0], kind, prompt, MAX_TOKENS)
    assert text == expected
    assert usage is not None and usage.completion_tokens == MAX_TOKENS
    assert await router.settled_reserved_blocks() == {"d0": 0, "d1": 0}
    assert sum((await router.stranded()).values()) == 0


async def test_what_real_clients_send(router: RealRouter) -> None:
    """Chat content as a list of parts, max_completion_tokens instead of max_tokens,
    stream_options with continuous usage: still exactly the reference."""
    prompt = unique_prompt(16, tag="parts")
    async with router.client() as client:
        chunks, last_usage = [], None
        s = await client.chat.completions.create(
            model="tiny-llama",
            messages=[
                {"role": "system", "content": "answer the question"},
                {"role": "user", "content": [{"type": "text", "text": prompt}]},
            ],
            max_completion_tokens=MAX_TOKENS,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": True},
        )
        async for chunk in s:
            if chunk.choices and chunk.choices[0].delta.content:
                chunks.append(chunk.choices[0].delta.content)
            if chunk.usage is not None:
                last_usage = chunk.usage
    expected = await reference(router.cluster.decodes[0], "chat", prompt, MAX_TOKENS, parts=True)
    assert "".join(chunks) == expected
    # The router forwards vLLM's events as they are, never merging them; vLLM itself puts
    # several tokens in one event when its API server falls behind, so this is a bound only.
    assert 0 < len(chunks) <= MAX_TOKENS
    assert last_usage is not None and last_usage.completion_tokens == MAX_TOKENS
