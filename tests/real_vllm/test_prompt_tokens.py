"""Issue 22, "Exact prompt tokens", on real vLLM: with the tiny model's own directory as its
tokenizer (settings `tokenizers`), the prompt tokens the router reserves for equal the
`usage.prompt_tokens` vLLM answers, for completions, chat, a multi-turn chat and a tools
request. The router's count is read where it is used: the request's RequestInfo as placement
and the estimator see it (the decode reservation is that plus the reserved output).

The tiny model (scripts/build_tiny_model.py) has a word-level tokenizer without a BOS
post-processor and a chat template that writes `bos_token`, the roles and `eos_token` itself,
joins text parts and ignores tools: so chat is encoded without special tokens, and a tools
request counts as the same messages without them.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from policies.base import OutputHistograms, RequestInfo
from policies.estimators import MaxTokensEstimator
from tests.real_vllm.conftest import (
    MODEL_DIR,
    SERVED,
    RealRouter,
    VllmCluster,
    chat_messages,
    real_router,
    unique_prompt,
)

pytestmark = pytest.mark.real_vllm

MAX_TOKENS = 4


class Recording(MaxTokensEstimator):
    """max_tokens as the reservation (its parent), and each request's prompt tokens kept."""

    seen: list[int] = []

    def estimate(self, request: RequestInfo, histograms: OutputHistograms) -> Any:
        if request.model != "smoke":  # the load-time smoke test's probe
            Recording.seen.append(request.prompt_tokens)
        return super().estimate(request, histograms)


@pytest.fixture
async def exact_router(vllm_cluster: VllmCluster, redis_prefix: str) -> AsyncIterator[RealRouter]:
    Recording.seen = []
    async with real_router(
        vllm_cluster,
        redis_prefix,
        estimates={"tokenizers": {SERVED: str(MODEL_DIR)}, "estimator": f"{__name__}:Recording"},
    ) as r:
        yield r


async def _usage_prompt_tokens(router: RealRouter, path: str, body: dict[str, Any]) -> int:
    body = {"model": SERVED, "max_tokens": MAX_TOKENS, "temperature": 0, **body}
    async with aiohttp.ClientSession() as s, s.post(router.url + path, json=body) as resp:
        answer = await resp.json()
        assert resp.status == 200, answer
    return int(answer["usage"]["prompt_tokens"])


_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "the weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


def _cases() -> list[tuple[str, str, dict[str, Any]]]:
    multi_turn = [
        *chat_messages(unique_prompt(10, tag="first")),
        {"role": "assistant", "content": unique_prompt(8)},
        {"role": "user", "content": [{"type": "text", "text": unique_prompt(6, tag="parts")}]},
    ]
    return [
        ("completions", "/v1/completions", {"prompt": unique_prompt(24, tag="completion")}),
        ("chat", "/v1/chat/completions", {"messages": chat_messages(unique_prompt(16))}),
        ("multi-turn chat", "/v1/chat/completions", {"messages": multi_turn}),
        (
            "tools",
            "/v1/chat/completions",
            # `none`: the engines run without a tool-call parser; the tools still reach the
            # template (vLLM drops them for `none` only when told to).
            {
                "messages": chat_messages(unique_prompt(12, tag="tools")),
                "tools": [_TOOL],
                "tool_choice": "none",
            },
        ),
    ]


async def test_the_routers_count_is_vllms_usage(exact_router: RealRouter) -> None:
    cases = _cases()
    answered = {}
    for name, path, body in cases:
        answered[name] = await _usage_prompt_tokens(exact_router, path, body)
    assert dict(zip(answered, Recording.seen, strict=True)) == answered
    async with aiohttp.ClientSession() as s, s.get(exact_router.url + "/metrics") as resp:
        metrics = await resp.text()
    assert f'disagg_router_prompt_tokens_source_total{{source="tokenizer"}} {len(cases)}.0' in (
        metrics
    )
