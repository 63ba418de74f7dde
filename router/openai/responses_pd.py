"""`POST /v1/responses` through the prefill/decode path: what the request path does differently.

vLLM 0.32's Responses endpoint carries a KV handle as chat does (docs/real-workers.md has the
references): `ResponsesRequest.kv_transfer_params` is copied into the SamplingParams' extra_args,
where the NIXL connector reads it, and `ResponsesResponse.kv_transfer_params` hands the prefill's
handle back at the top of the answer. So a stateless Responses request takes chat's path
(router/request/lifecycle.py `RequestFlow`): admission, estimate, placement, the decode reservation
before any prefill, the prefill leg, the decode leg, release. The stages ask this module for the
few places where Responses differs:

    parse             `parse_responses`: `input` + `instructions` give the prompt estimate,
                      `max_output_tokens` the token cap (router/openai/api.py's ParsedRequest)
    prefill leg       `prefill_body`: the cap is `max_output_tokens: 1` (not `max_tokens`),
                      `stream: false`, `store: false`; its answer's `kv_transfer_params` is the
                      handle (the stream has it only in `response.completed`, too late)
    decode leg        the client's body (`store: false`) plus the handle
                      (router/adapters/vllm.py decode_body)
    stream            router/relay/sse_cut.py's Responses mode: a token is a
                      `response.output_text.delta`, the stream is whole once
                      `response.completed` came; `error` / `response.failed` end it; the
                      opening events (sent before the KV pull) are held until the next one
    whole answer      asked as a stream (`upstream_body`) and answered with the `response` of
                      its `response.completed` event (`assembled`: router/request/assemble.py)
    broken stream     no resume (a Responses stream cannot be continued under the same response
                      id and sequence numbers): a try that broke before the client got an event
                      is retried, one that broke after ends with an `error` event
                      (router/errors.py `stream_error_frame`)

`serves_split` decides per request whether the path applies: only with a prefill worker in
rotation whose protocol is NIXL pull (the concurrent SGLang/Mooncake legs put their bootstrap
fields in the body, which no Responses endpoint is known to read), and only without built-in
tools (vLLM runs those as several generation turns in one request, which one KV handoff does
not cover). Otherwise the request is served whole by one worker that runs both phases, as
before (router/openai/responses.py).
"""

from __future__ import annotations

from typing import Any

from router.config import Settings
from router.errors import InvalidRequest, ModelNotFound
from router.openai.api import (
    ParsedRequest,
    PromptTokensSource,
    TokenizerLookup,
    output_cap,
    parse_json_object,
)
from router.openai.prompt_text import text_of
from router.openai.responses import RESPONSES, stateless_body
from router.workers.pools import Pools

__all__ = ["RESPONSES", "parse_responses", "prefill_body", "serves_split"]

# Worker adapters whose prefill leg answers a KV handle the decode leg pulls
# (router/request/legs.py).
_PULL_ADAPTERS = frozenset({"vllm", "sim"})
# Tokens a chat template adds around each input item (as router/openai/api.py counts chat messages).
_PER_ITEM_TOKENS = 4
_INT_MAX = 2**63 - 1


def serves_split(settings: Settings, pools: Pools, body: dict[str, Any]) -> bool:
    """Whether this request goes through the prefill/decode path (else: whole on one worker)."""
    if not settings.api.responses_split:
        return False
    tools = body.get("tools")
    if isinstance(tools, list) and any(
        not isinstance(t, dict) or t.get("type") != "function" for t in tools
    ):
        return False
    model = body.get("model")
    prefill = [
        w
        for w in pools.prefill_workers
        if w.available and w.spec.serves(model if isinstance(model, str) else None)
    ]
    return bool(prefill) and all(w.spec.adapter in _PULL_ADAPTERS for w in prefill)


def _prompt_tokens(body: dict[str, Any], chars_per_token: float) -> int:
    raw = body.get("input")
    if isinstance(raw, str):
        chars, items = len(raw), 1
    elif isinstance(raw, list) and raw:
        chars, items = len(text_of(raw)), len(raw)
    else:
        raise InvalidRequest("'input' must be a string or a non-empty list of items", param="input")
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise InvalidRequest("'instructions' must be a string", param="instructions")
        chars, items = chars + len(instructions), items + 1
    # vLLM's stateless multi-turn: the earlier response's output is part of the prompt too.
    previous = body.get("previous_response")
    if isinstance(previous, dict):
        chars += len(text_of(previous.get("output")))
    return max(1, int(items * _PER_ITEM_TOKENS + chars / chars_per_token + 0.999))


def _max_output_tokens(body: dict[str, Any]) -> int | None:
    v = body.get("max_output_tokens")
    if v is None:
        return None
    if isinstance(v, float) and v.is_integer():
        v = body["max_output_tokens"] = int(v)  # 16.0 -> 16, as router/openai/api.py does
    if not isinstance(v, int) or isinstance(v, bool):
        raise InvalidRequest(
            f"'max_output_tokens' must be an integer, not {type(v).__name__}",
            param="max_output_tokens",
        )
    if not 1 <= v <= _INT_MAX:
        raise InvalidRequest(
            f"'max_output_tokens' must be in 1..{_INT_MAX}, got {v!r}", param="max_output_tokens"
        )
    return v


def parse_responses(
    raw: bytes,
    *,
    models: tuple[str, ...],
    max_model_len: int | None,
    chars_per_token: float = 4.0,
    tokenizer_for: TokenizerLookup | None = None,
) -> ParsedRequest:
    """A Responses body as the request path's ParsedRequest (the stateful features are 400s,
    `store: false` is added: router/openai/responses.py `stateless_body`)."""
    body, stream = stateless_body(parse_json_object(raw))
    model = body.get("model")
    if model is None:
        model = models[0] if models else ""  # optional in Responses: the router's model
    if not isinstance(model, str) or not model:
        raise InvalidRequest("'model' must be a non-empty string", param="model")
    if model not in models:
        raise ModelNotFound(f"The model `{model}` does not exist.", param="model")
    prompt_tokens = _prompt_tokens(body, chars_per_token)
    # Exact when the model has a tokenizer and the input is plain messages (router/tokens/).
    tokenizer = tokenizer_for(model) if tokenizer_for is not None else None
    ids = tokenizer.responses_ids(body) if tokenizer is not None else None
    source: PromptTokensSource = "estimate"
    if ids is not None:
        prompt_tokens, source = max(1, len(ids)), "tokenizer"
    cap = _max_output_tokens(body)
    cap = output_cap(
        max_model_len, prompt_tokens, cap, prompt_param="input", cap_param="max_output_tokens"
    )
    return ParsedRequest(
        path=RESPONSES,
        body=body,
        model=model,
        stream=stream,
        include_usage=False,
        prompt_tokens=prompt_tokens,
        max_tokens=cap,
        prompt_token_ids=ids,
        prompt_tokens_source=source,
    )


def prefill_body(adapter_body: dict[str, Any]) -> dict[str, Any]:
    """The prefill leg of a Responses request, from the vLLM adapter's chat-shaped one: the
    cap that makes it a prefill is `max_output_tokens` (vLLM's ResponsesRequest builds its
    SamplingParams.max_tokens from it; `max_tokens` is an unknown field to it, ignored);
    nothing is stored."""
    dropped = ("max_tokens", "max_completion_tokens")
    out = {k: v for k, v in adapter_body.items() if k not in dropped}
    out["max_output_tokens"] = 1
    out["stream"] = False
    out["store"] = False
    return out
