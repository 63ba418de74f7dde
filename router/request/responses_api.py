"""The Responses API's shapes on the prefill/decode path, where the request path's stages
differ from chat (router/openai/responses_pd.py says what the path is and when it applies):

    prefill leg    `prefill_body`: the cap is `max_output_tokens: 1`, not streamed, not stored
    whole answer   asked as a stream (`upstream_body`), answered with the `response` of its
                   `response.completed` event (`assembled`), its length `output_tokens`
"""

from __future__ import annotations

from typing import Any

import orjson

from router.adapters.errors import sse_data

__all__ = ["assembled", "output_tokens", "prefill_body", "upstream_body"]


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


def upstream_body(body: dict[str, Any]) -> dict[str, Any]:
    """A whole answer asked of the decode worker as a stream (router/request/assemble.py says why);
    the
    Responses stream has no `stream_options`: its `response.completed` carries the usage."""
    return {**body, "stream": True}


def assembled(chunks: list[bytes]) -> dict[str, Any] | None:
    """The whole answer a relayed Responses stream spells: the `response` object of its
    `response.completed` (or `response.incomplete`) event; None if there is none that parses."""
    for event in reversed(b"".join(chunks).split(b"\n\n")):
        lines = event.split(b"\n")
        if lines[0] not in (b"event: response.completed", b"event: response.incomplete"):
            continue
        for line in lines[1:]:
            payload = sse_data(line)
            if payload is None:
                continue
            try:
                obj = orjson.loads(payload)
            except orjson.JSONDecodeError:
                return None
            response = obj.get("response") if isinstance(obj, dict) else None
            return response if isinstance(response, dict) else None
    return None


def output_tokens(answer: dict[str, Any]) -> int:
    usage = answer.get("usage")
    tokens = usage.get("output_tokens") if isinstance(usage, dict) else None
    return tokens if isinstance(tokens, int) and not isinstance(tokens, bool) else 0
