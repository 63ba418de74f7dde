"""`n` > 1 against the real engine (docs/real-workers.md, "`n` > 1"): serving it whole on a
decode engine gives the engine's own answer, every choice of it, and the prefill engine computes
nothing for it.

Why the router does not split such a request is in the doc, from vLLM's code: each of the n
children pulls the one handle, and the prefill frees its blocks at the first pull. Splitting by
hand on these engines shows the late read (`vllm:nixl_num_notifications_after_expiry` rises) only
when the second child's pull starts before the first one's blocks are in the decode's prefix
cache, a race: it is not a test here, since whether it shows depends on the scheduling."""

from __future__ import annotations

import uuid
from typing import Any

import aiohttp
import pytest

from tests.real_vllm.conftest import (
    SERVED,
    RealRouter,
    VllmServer,
    chat_messages,
    unique_prompt,
)

pytestmark = pytest.mark.real_vllm

MAX_TOKENS = 10


async def _post(url: str, body: dict[str, Any]) -> tuple[int, Any]:
    timeout = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession(timeout=timeout) as s, s.post(url, json=body) as r:
        return r.status, await r.json(content_type=None)


def _counter(server: VllmServer, name: str) -> float:
    """A counter of `server`, summed over its labels (0 before its first event)."""
    return sum(v for (n, _), v in server.metrics().items() if n in (name, name + "_total"))


def _sampled(tag: str) -> dict[str, Any]:
    return {
        "model": SERVED,
        "messages": chat_messages(unique_prompt(20, tag=tag)),
        "max_tokens": MAX_TOKENS,
        "n": 2,
        "temperature": 1.0,
        "seed": 11,
    }


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
async def test_seeded_choices_through_the_router_are_the_engines(
    router: RealRouter, stream: bool
) -> None:
    body = _sampled(f"n choices {stream}")
    ref_status, ref = await _post(
        router.cluster.decodes[0].url + "/v1/chat/completions",
        {**body, "cache_salt": f"ref-{uuid.uuid4().hex}"},
    )
    assert ref_status == 200, ref
    want = [c["message"]["content"] for c in sorted(ref["choices"], key=lambda c: c["index"])]
    assert len(want) == 2
    prefill_prompts = _counter(router.cluster.prefill, "vllm:prompt_tokens")
    async with router.client() as client:
        args = {k: v for k, v in body.items() if k != "model"}
        if stream:
            texts: dict[int, str] = {}
            usage = None
            s = await client.chat.completions.create(
                model=SERVED, stream=True, stream_options={"include_usage": True}, **args
            )
            async for chunk in s:
                for choice in chunk.choices:
                    texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
                if chunk.usage is not None:
                    usage = chunk.usage
            got = [texts[i] for i in sorted(texts)]
        else:
            answer = await client.chat.completions.create(model=SERVED, **args)
            got = [c.message.content or "" for c in answer.choices]
            usage = answer.usage
    assert got == want
    assert usage is not None and usage.completion_tokens == ref["usage"]["completion_tokens"]
    # Served whole by a decode engine: the prefill engine computed nothing for it.
    assert _counter(router.cluster.prefill, "vllm:prompt_tokens") == prefill_prompts
    assert await router.settled_reserved_blocks() == {"d0": 0, "d1": 0}
    assert sum((await router.stranded()).values()) == 0


async def test_greedy_n_above_one_is_the_engines_400(router: RealRouter) -> None:
    """vLLM refuses n > 1 with greedy sampling; its verdict reaches the client as a 400."""
    body = {**_sampled("greedy"), "temperature": 0}
    status, answer = await _post(router.url + "/v1/chat/completions", body)
    assert status == 400, answer
    assert "n must be 1" in answer["error"]["message"]
    assert await router.settled_reserved_blocks() == {"d0": 0, "d1": 0}
