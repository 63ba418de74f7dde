"""Issue 31: a stream the router preempts mid-way (forced by the test setting
`preemption.force_after_tokens`) resumes — prompt + the text the client has, re-prefilled on a
real prefill engine, continued by a real decode engine — with exactly the text and the usage one
engine alone gives, chat and completions. Nothing stays reserved, no breaker pays, no retry is
spent. (The tiny model's word-level tokenizer re-encodes any text it emitted to the same tokens:
see test_resume.py.)"""

from __future__ import annotations

import uuid

import pytest
from openai import AsyncOpenAI

from tests.real_vllm.conftest import VllmCluster, ask, real_router, unique_prompt

pytestmark = pytest.mark.real_vllm

MAX_TOKENS = 200
FORCE_AT = 4  # relayed tokens (chunks) before the router stops the stream


@pytest.mark.parametrize("kind", ["chat", "completions"])
async def test_a_preempted_stream_resumes_with_the_reference_text_and_usage(
    vllm_cluster: VllmCluster, redis_prefix: str, kind: str
) -> None:
    prompt = unique_prompt(20, tag=f"preempt {kind}")
    ref = vllm_cluster.decodes[0]
    async with AsyncOpenAI(
        base_url=ref.url + "/v1", api_key="none", max_retries=0, timeout=300
    ) as client:
        salt = {"cache_salt": f"ref-{uuid.uuid4().hex}"}
        want, want_usage = await ask(
            client, kind, prompt, MAX_TOKENS, stream=False, extra_body=salt
        )
    async with real_router(
        vllm_cluster, redis_prefix, preemption={"force_after_tokens": FORCE_AT}
    ) as router:
        async with router.client() as client:
            text, usage = await ask(client, kind, prompt, MAX_TOKENS, stream=True)
        metrics = router.parts.metrics
        assert metrics.preemptions.labels(reason="forced")._value.get() == 1
        assert metrics.retries.labels(side="decode")._value.get() == 0
        assert all(w.breaker.state == "closed" for w in router.parts.pools.decode_workers)
        assert text == want
        assert usage is not None and want_usage is not None
        assert (usage.prompt_tokens, usage.completion_tokens) == (
            want_usage.prompt_tokens,
            want_usage.completion_tokens,
        )
        assert await router.settled_reserved_blocks() == {"d0": 0, "d1": 0}
        assert sum((await router.stranded()).values()) == 0
