"""Issue 23: the router with the SGLang adapter in front of a real SGLang prefill/decode pair
(Mooncake over TCP), through the official `openai` client. Greedy answers, streamed and whole,
chat and completions, equal what one plain SGLang server answers alone, and the usage the
client reads equals that server's; nothing stays reserved."""

from __future__ import annotations

from typing import Any

import pytest
from openai import AsyncOpenAI

from tests.real_sglang.conftest import (
    SERVED,
    SglangCluster,
    SglangRouter,
    SglangServer,
    unique_prompt,
)

pytestmark = pytest.mark.real_sglang

MAX_TOKENS = 24


def _messages(prompt: str) -> list[dict[str, Any]]:
    return [{"role": "system", "content": "answer"}, {"role": "user", "content": prompt}]


async def ask(
    client: AsyncOpenAI, kind: str, prompt: str, *, stream: bool, max_tokens: int = MAX_TOKENS
) -> tuple[str, tuple[int, int] | None]:
    """(text, (prompt tokens, completion tokens) or None) of one greedy request."""
    common: dict[str, Any] = {"model": SERVED, "max_tokens": max_tokens, "temperature": 0}
    if stream:
        common.update(stream=True, stream_options={"include_usage": True})
    parts: list[str] = []
    usage = None
    if kind == "chat":
        if stream:
            async for chunk in await client.chat.completions.create(
                messages=_messages(prompt),  # type: ignore[arg-type]
                **common,
            ):
                parts += [c.delta.content or "" for c in chunk.choices]
                usage = chunk.usage or usage
        else:
            r = await client.chat.completions.create(messages=_messages(prompt), **common)  # type: ignore[arg-type]
            parts, usage = [r.choices[0].message.content or ""], r.usage
    elif stream:
        async for piece in await client.completions.create(prompt=prompt, **common):
            parts += [c.text for c in piece.choices]
            usage = piece.usage or usage
    else:
        c = await client.completions.create(prompt=prompt, **common)
        parts, usage = [c.choices[0].text], c.usage
    counts = None if usage is None else (usage.prompt_tokens, usage.completion_tokens)
    return "".join(parts), counts


def reference_client(server: SglangServer) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=300)


CASES = [
    ("completions", False),
    ("completions", True),
    ("chat", False),
    ("chat", True),
]


@pytest.mark.parametrize(("kind", "stream"), CASES, ids=[f"{k}-{s}" for k, s in CASES])
async def test_answers_and_usage_equal_one_engine_alone(
    sglang_cluster: SglangCluster, router: SglangRouter, kind: str, stream: bool
) -> None:
    prompt = unique_prompt(20)
    async with reference_client(sglang_cluster.ref) as ref:
        want, want_usage = await ask(ref, kind, prompt, stream=False)
    async with router.client() as client:
        got, usage = await ask(client, kind, prompt, stream=stream)
    assert got == want
    assert usage == want_usage
    assert set((await router.reserved_blocks()).values()) == {0}
