"""`POST /v1/responses` through the router's prefill/decode path on real vLLM (router/
responses_pd.py): the prefill engine (kv_producer) runs the prefill leg (`max_output_tokens: 1`),
a decode engine (kv_consumer) pulls its KV over NIXL and answers. Greedy answers, whole and
streamed, equal one engine's alone, and the engines' own `prompt_tokens_by_source` counters show
the KV moved: every prompt token was computed on the prefill engine and arrived at the decode
engine as `external_kv_transfer`, none computed there."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from openai import AsyncOpenAI

from tests.real_vllm.conftest import SERVED, RealRouter, VllmServer, unique_prompt

pytestmark = pytest.mark.real_vllm

MAX_TOKENS = 12


async def _reference(server: VllmServer, prompt: str) -> str:
    """One engine alone, no disaggregation, its prefix cache bypassed (`cache_salt`), greedy."""
    async with AsyncOpenAI(
        base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=300
    ) as client:
        r = await client.responses.create(
            model=SERVED,
            input=prompt,
            max_output_tokens=MAX_TOKENS,
            temperature=0,
            store=False,
            extra_body={"cache_salt": f"ref-{uuid.uuid4().hex}"},
        )
        return r.output_text


def _by_source(router: RealRouter) -> dict[str, dict[str, float]]:
    return {s.name: s.prompt_tokens_by_source() for s in router.cluster.servers}


def _delta(a: dict[str, dict[str, float]], b: dict[str, dict[str, float]], source: str) -> Any:
    return {w: b[w].get(source, 0.0) - a[w].get(source, 0.0) for w in b}


async def test_responses_through_prefill_and_decode_equal_one_engine(router: RealRouter) -> None:
    whole_prompt = unique_prompt(30, tag="responses")
    stream_prompt = unique_prompt(36, tag="responses")
    refs = {
        p: await _reference(router.cluster.decodes[1], p) for p in (whole_prompt, stream_prompt)
    }
    assert all(refs.values())

    before = _by_source(router)
    async with router.client() as client:
        whole = await client.responses.create(
            model=SERVED, input=whole_prompt, max_output_tokens=MAX_TOKENS, temperature=0
        )
        stream = await client.responses.create(
            model=SERVED,
            input=stream_prompt,
            max_output_tokens=MAX_TOKENS,
            temperature=0,
            stream=True,
        )
        kinds, text, completed = [], "", None
        async for event in stream:
            kinds.append(event.type)
            if event.type == "response.output_text.delta":
                text += event.delta
            if event.type == "response.completed":
                completed = event.response
    after = _by_source(router)

    assert whole.object == "response" and whole.output_text == refs[whole_prompt]
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert text == refs[stream_prompt]
    assert completed is not None and completed.output_text == text
    assert whole.usage is not None and completed.usage is not None
    sent = whole.usage.input_tokens + completed.usage.input_tokens

    # The KV moved: computed on p0, pulled by the decode engines, none computed there.
    p0 = router.cluster.prefill.name
    decodes = [d.name for d in router.cluster.decodes]
    external, local = (
        _delta(before, after, "external_kv_transfer"),
        _delta(before, after, "local_compute"),
    )
    assert sum(external[d] for d in decodes) == sent
    assert sum(local[d] for d in decodes) == 0
    assert local[p0] == sent and external[p0] == 0
    placements = router.parts.metrics.placements
    assert sum(placements.labels(prefill=p0, decode=d)._value.get() for d in decodes) == 2

    assert await router.settled_reserved_blocks() == {d: 0 for d in decodes}
    assert sum((await router.stranded()).values()) == 0
