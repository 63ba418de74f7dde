"""A request no decode worker could ever hold gets a 400 at once, naming what to change (issue
31, item 6b); before, a retryable 429 no_decode_capacity.

The rule (router/request/admit.py `never_fits`): never fits when even the smallest reservation the
router could make for it — its prompt, each choice's own last prompt block and one output token —
exceeds the largest decode worker, empty. A request over capacity only by the reservation it would
get now (the estimate: `max_tokens` while cold) may be admitted on a smaller estimate and fit by its
real length: that one keeps its 429.

The official `openai` client against a live router and a simulated decode worker of 64 blocks
of 16 tokens (1,024 tokens).
"""

from __future__ import annotations

from typing import Any

import openai
import pytest
from openai import AsyncOpenAI

from tests.conftest import MODEL, SimCluster, sim_cluster

KV_BLOCKS = 64  # of 16 tokens: 1,024 tokens on the one decode worker


def _client(c: SimCluster) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=c.router_url + "/v1", api_key="x", max_retries=0, timeout=60)


async def _create(c: SimCluster, content: str = "hi", **kw: Any) -> Any:
    async with _client(c) as client:
        return await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": content}], **kw
        )


# id -> (the request's fields, the param the 400 names)
NEVER_FITS: dict[str, tuple[dict[str, Any], str]] = {
    # 128 choices of one token each: each holds its own copy of the prompt's last block.
    "n choices of one token": ({"n": 128, "max_tokens": 4}, "n"),
    "n choices, a long cap": ({"n": 128, "max_tokens": 100_000}, "n"),
    # ~2,000 tokens of prompt (4 characters a token)
    "the prompt alone": ({"content": "word " * 1600, "max_tokens": 1}, "messages"),
    "the prompt alone, n choices": (
        {"content": "word " * 1600, "n": 4, "max_tokens": 1},
        "messages",
    ),
}


@pytest.mark.parametrize("case", list(NEVER_FITS))
async def test_a_request_that_can_never_fit_is_a_400_naming_why(case: str) -> None:
    fields, param = NEVER_FITS[case]
    async with sim_cluster(redis_prefix=None, kv_blocks=KV_BLOCKS) as c:
        with pytest.raises(openai.BadRequestError) as info:
            await _create(c, **fields)
        body = info.value.body
        assert isinstance(body, dict), body
        assert body["code"] == "exceeds_decode_capacity" and body["param"] == param, body
        assert f"the largest decode worker holds {KV_BLOCKS} blocks" in body["message"], body
        assert info.value.response.headers.get("Retry-After") is None
        # Nothing was reserved for it, and the router still serves what fits.
        assert sum((await c.reserved_blocks()).values()) == 0
        answer = await _create(c, n=2, max_tokens=8)
        assert len(answer.choices) == 2


@pytest.mark.parametrize(
    "fields",
    [{"max_tokens": 2000}, {"max_tokens": 2000, "extra_body": {"ignore_eos": True}}],
    ids=["cap", "cap with ignore_eos"],
)
async def test_over_capacity_by_its_estimate_only_is_not_a_400(fields: dict[str, Any]) -> None:
    """max_tokens 2,000 reserves 2,000 per choice while the estimator has no history (over the
    1,024 tokens), but a smaller estimate would admit it (its answer then grows past its
    reservation, counted past capacity): the 429 that says retry, as before."""
    async with sim_cluster(redis_prefix=None, kv_blocks=KV_BLOCKS) as c:
        with pytest.raises(openai.RateLimitError) as info:
            await _create(c, **fields)
        body = info.value.body
        assert isinstance(body, dict) and body["code"] == "no_decode_capacity", body
        assert info.value.response.headers.get("Retry-After") is not None
