"""Issue 14 against the real engine: the passthrough endpoints (router/edge/passthrough.py), the
Responses API (router/openai/responses.py, router/openai/responses_pd.py) and the chat fields the
router
passes through unchanged (logprobs, top_logprobs, seed, stop), through real prefill → NIXL →
real decode."""

from __future__ import annotations

import uuid
from typing import Any

import aiohttp
import pytest
from openai import AsyncOpenAI

from tests.real_vllm.conftest import SERVED, RealRouter, chat_messages, unique_prompt

pytestmark = pytest.mark.real_vllm

MAX_TOKENS = 12


async def _post(url: str, body: dict[str, Any]) -> tuple[int, Any]:
    timeout = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession(timeout=timeout) as s, s.post(url, json=body) as r:
        return r.status, await r.json(content_type=None)


async def test_tokenize_and_detokenize_are_the_engines(router: RealRouter) -> None:
    d0 = router.cluster.decodes[0].url
    # Words of the tiny model's vocabulary only (a tag could be `<unk>` to it).
    body = {"model": SERVED, "prompt": unique_prompt(10), "add_special_tokens": False}
    status, routed = await _post(router.url + "/tokenize", body)
    assert status == 200
    assert routed == (await _post(d0 + "/tokenize", body))[1]
    assert routed["count"] == len(routed["tokens"]) > 0
    ids = {"model": SERVED, "tokens": routed["tokens"]}
    status, text = await _post(router.url + "/detokenize", ids)
    assert status == 200
    assert text == (await _post(d0 + "/detokenize", ids))[1]
    # The word-level tokenizer (docs/real-vllm.md): the ids spell the prompt again.
    assert text["prompt"].split() == body["prompt"].split()


async def test_embeddings_verdict_of_a_generative_model_passes_through(router: RealRouter) -> None:
    """The tiny model generates; it does not embed. Whatever the engine answers, the router
    answers the same status, in the OpenAI error shape when it is an error."""
    body = {"model": SERVED, "input": "embed me"}
    direct_status, _ = await _post(router.cluster.decodes[0].url + "/v1/embeddings", body)
    status, routed = await _post(router.url + "/v1/embeddings", body)
    assert status == direct_status
    if status >= 400:
        assert set(routed["error"]) == {"message", "type", "param", "code"}
    assert await router.settled_reserved_blocks() == {"d0": 0, "d1": 0}


def _tokens(logprobs: Any) -> list[tuple[str, list[str]]]:
    return [(t.token, [a.token for a in t.top_logprobs]) for t in logprobs.content]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
async def test_logprobs_seed_stop_pass_through_the_pd_path(
    router: RealRouter, stream: bool
) -> None:
    prompt = unique_prompt(14, tag="logprobs")
    messages: Any = chat_messages(prompt)
    fields: dict[str, Any] = {"logprobs": True, "top_logprobs": 2, "seed": 7, "stop": ["zzzz"]}
    async with AsyncOpenAI(
        base_url=router.cluster.decodes[0].url + "/v1", api_key="none", max_retries=0, timeout=300
    ) as direct:
        ref = await direct.chat.completions.create(
            model=SERVED,
            messages=messages,
            max_tokens=MAX_TOKENS,
            temperature=0,
            extra_body={"cache_salt": f"ref-{uuid.uuid4().hex}"},
            **fields,
        )
    expected = _tokens(ref.choices[0].logprobs)
    assert len(expected) == MAX_TOKENS
    async with router.client() as client:
        if stream:
            got: list[tuple[str, list[str]]] = []
            text = ""
            s = await client.chat.completions.create(
                model=SERVED,
                messages=messages,
                max_tokens=MAX_TOKENS,
                temperature=0,
                stream=True,
                **fields,
            )
            async for chunk in s:
                for choice in chunk.choices:
                    text += choice.delta.content or ""
                    if choice.logprobs is not None and choice.logprobs.content:
                        got += _tokens(choice.logprobs)
        else:
            answer = await client.chat.completions.create(
                model=SERVED,
                messages=messages,
                max_tokens=MAX_TOKENS,
                temperature=0,
                **fields,
            )
            text = answer.choices[0].message.content or ""
            got = _tokens(answer.choices[0].logprobs)
    assert text == ref.choices[0].message.content
    # The decode engine's logprobs reached the client: one entry a token, two alternatives each,
    # the same tokens the engine alone chose.
    assert got == expected
    assert await router.settled_reserved_blocks() == {"d0": 0, "d1": 0}
    assert sum((await router.stranded()).values()) == 0


def _output_text(response: dict[str, Any]) -> str:
    return "".join(
        part.get("text", "")
        for item in response["output"]
        if item.get("type") == "message"
        for part in item.get("content") or ()
    )


async def test_responses_through_the_router_equal_an_engines(router: RealRouter) -> None:
    # With a prefill engine in the pools this is the prefill/decode path
    # (router/openai/responses_pd.py;
    # tests/real_vllm/test_responses_pd.py checks the KV moved); the answer is one engine's.
    prompt = unique_prompt(12, tag="responses")
    body = {"model": SERVED, "input": prompt, "max_output_tokens": MAX_TOKENS, "temperature": 0}
    status, routed = await _post(router.url + "/v1/responses", body)
    assert status == 200, routed
    direct = {**body, "store": False}
    ref_status, ref = await _post(router.cluster.decodes[1].url + "/v1/responses", direct)
    assert ref_status == 200, ref
    assert routed["object"] == "response"
    assert _output_text(routed) == _output_text(ref) and _output_text(ref)
    status, refused = await _post(router.url + "/v1/responses", {**body, "store": True})
    assert status == 400 and "stateless" in refused["error"]["message"]


async def test_vllm_responses_endpoint_carries_kv_transfer_params(router: RealRouter) -> None:
    """The fact docs/real-workers.md rests on, checked on this engine version: its Responses
    endpoint takes `kv_transfer_params` and hands one back, so a prefill/decode split of a
    Responses request is possible (the router does it: router/openai/responses_pd.py)."""
    p0, d0 = router.cluster.prefill.url, router.cluster.decodes[0].url
    prompt = unique_prompt(40, tag="responses pd")
    body = {"model": SERVED, "input": prompt, "temperature": 0, "store": False}
    pre = {
        **body,
        "max_output_tokens": 1,
        "kv_transfer_params": {
            "do_remote_decode": True,
            "do_remote_prefill": False,
            "remote_engine_id": None,
            "remote_block_ids": None,
            "remote_host": None,
            "remote_port": None,
        },
    }
    status, first = await _post(p0 + "/v1/responses", pre)
    assert status == 200, first
    params = first.get("kv_transfer_params")
    assert isinstance(params, dict) and params.get("remote_block_ids"), first
    status, second = await _post(
        d0 + "/v1/responses",
        {**body, "max_output_tokens": MAX_TOKENS, "kv_transfer_params": params},
    )
    assert status == 200, second
    assert second["output"], second
