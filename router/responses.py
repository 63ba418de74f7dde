"""`POST /v1/responses` (OpenAI's Responses API), stateless requests, on one worker.

Not through the prefill/decode path: vLLM's Responses endpoint has no way to carry a KV handle.
Its request model (`ResponsesRequest`, vllm/entrypoints/openai/responses/protocol.py) has no
`kv_transfer_params` field — unknown fields are dropped — and builds its SamplingParams with
`extra_args=self.vllm_xargs`, whose values may only be strings, numbers or lists of them, so the
NIXL connector never sees a `do_remote_decode`/`do_remote_prefill` object; nor does its answer
(`ResponsesResponse`) return one. Chat and completions differ exactly there (their requests
copy `kv_transfer_params` into `extra_args`, their answers carry it back). So a Responses
request is served whole by one worker that runs both phases: one registered as `both`, else a
decode worker (a kv_consumer prefills locally any request without `kv_transfer_params`).
docs/real-workers.md has the references.

The router keeps no state, so the stateful features are refused with a 400 that says so:
`previous_response_id` (the response it names lives in no worker the router could find again),
`store: true` and `background: true` (which needs `store`). A request that does not say is sent
with `store: false`, so no worker keeps a response that nobody can fetch through the router
(OpenAI's default is `true`). vLLM's stateless multi-turn (`previous_response` carrying the
whole earlier response) passes through.
"""

from __future__ import annotations

from typing import Any

import orjson

from router.errors import InvalidRequest, RouterError
from router.passthrough import BOTH_PHASES, Route

__all__ = ["RESPONSES", "RESPONSES_ROUTE", "stateless_body"]

RESPONSES = "/v1/responses"

_STATELESS = (
    "the router is stateless: {what} is not supported. Send the whole conversation in 'input' "
    "(or vLLM's 'previous_response'), with 'store' false or absent."
)


def _error_event(err: RouterError) -> bytes:
    """The Responses API's stream error event."""
    event = {"type": "error", "code": err.type, "message": err.message, "param": err.param}
    return b"event: error\ndata: " + orjson.dumps(event) + b"\n\n"


def stateless_body(body: dict[str, Any]) -> tuple[dict[str, Any], bool]:
    """The body to send (store false unless it said) and whether it streams; 400 for state."""
    if body.get("previous_response_id") is not None:
        raise InvalidRequest(
            _STATELESS.format(what="'previous_response_id'"), param="previous_response_id"
        )
    if body.get("store") is True:
        raise InvalidRequest(_STATELESS.format(what="'store': true"), param="store")
    if body.get("background") is True:
        raise InvalidRequest(_STATELESS.format(what="'background': true"), param="background")
    stream = body.get("stream", False)
    if stream is not None and not isinstance(stream, bool):
        raise InvalidRequest("'stream' must be a boolean", param="stream")
    if "store" not in body or body["store"] is None:
        body = {**body, "store": False}
    return body, bool(stream)


RESPONSES_ROUTE = Route(RESPONSES, BOTH_PHASES, error_event=_error_event, shape=stateless_body)
