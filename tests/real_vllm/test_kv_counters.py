"""Issue 7, test 2: the KV really moved. On the decode servers, vLLM's
`prompt_tokens_by_source{source="external_kv_transfer"}` rises by exactly the prompt tokens the
router sent, `local_compute` (and `local_cache_hit`) by none; the prefill server computed them."""

from __future__ import annotations

import itertools

import pytest

from tests.real_vllm.conftest import RealRouter, ask, unique_prompt

pytestmark = pytest.mark.real_vllm


async def test_decode_pulls_every_prompt_token(router: RealRouter) -> None:
    cluster = router.cluster
    before = {s.name: s.prompt_tokens_by_source() for s in cluster.servers}
    # Several lengths: under one block, several blocks, an exact multiple of the block size.
    cases = [
        ("completions", unique_prompt(5), False),
        ("chat", unique_prompt(40), True),
        ("completions", unique_prompt(64), True),
        ("chat", unique_prompt(200), False),
        ("completions", unique_prompt(300), False),
    ]
    prompts: list[int] = []
    async with router.client() as client:
        for kind, prompt, stream in cases:
            _, usage = await ask(client, kind, prompt, 8, stream=stream)
            assert usage is not None
            prompts.append(usage.prompt_tokens)
    sent = sum(prompts)
    after = {s.name: s.prompt_tokens_by_source() for s in cluster.servers}

    def delta(name: str, source: str) -> float:
        return after[name].get(source, 0.0) - before[name].get(source, 0.0)

    decodes = [d.name for d in cluster.decodes]
    assert sum(delta(d, "external_kv_transfer") for d in decodes) == sent
    assert [delta(d, "local_compute") for d in decodes] == [0, 0]
    assert [delta(d, "local_cache_hit") for d in decodes] == [0, 0]
    # The prefill server computed those prompts (fresh prompts: no prefix-cache hits there).
    # A retried request (a decode that failed on a loaded machine) is prefilled again; then the
    # excess must be whole prompts, and the router must have counted the retries.
    p = cluster.prefill.name
    excess = delta(p, "local_compute") + delta(p, "local_cache_hit") - sent
    retries = sum(
        router.parts.metrics.retries.labels(side=side)._value.get()
        for side in ("prefill", "decode")
    )
    if excess or retries:
        print(f"\n{retries:.0f} retries; the prefill server computed {excess:.0f} tokens again")
        repeats = itertools.product(range(3), repeat=len(prompts))  # up to 3 attempts each
        assert any(
            sum(n * t for n, t in zip(r, prompts, strict=True)) == excess
            for r in repeats
            if sum(r) <= retries
        ), f"{excess} extra prefill tokens are not whole retried prompts ({prompts})"
    assert excess >= 0
    assert delta(p, "external_kv_transfer") == 0
    assert await router.settled_reserved_blocks() == {"d0": 0, "d1": 0}
