"""`POST /v1/responses` (OpenAI's Responses API): stateless requests only, and the route's
whole-on-one-worker path.

A Responses request goes through the prefill/decode path like chat when a NIXL-pull prefill
worker is in rotation (router/openai/responses_pd.py: vLLM 0.32 carries `kv_transfer_params` on
this endpoint); otherwise, and for requests with built-in tools, it is served whole by one worker
that runs both phases (`RESPONSES_ROUTE`, router/edge/passthrough.py): one registered as `both`,
else a decode worker (a kv_consumer prefills locally any request without `kv_transfer_params`).
docs/real-workers.md has the vLLM references.

The router keeps no state, so the stateful features are refused with a 400 that says so:
`previous_response_id` (the response it names lives in no worker the router could find again),
`store: true` and `background: true` (which needs `store`). A request that does not say is sent
with `store: false`, so no worker keeps a response that nobody can fetch through the router
(OpenAI's default is `true`). vLLM's stateless multi-turn (`previous_response` carrying the
whole earlier response) passes through.
"""

from __future__ import annotations

from typing import Any

from router.errors import InvalidRequest
from router.openai.api import RESPONSES

__all__ = ["RESPONSES", "stateless_body"]


_STATELESS = (
    "the router is stateless: {what} is not supported. Send the whole conversation in 'input' "
    "(or vLLM's 'previous_response'), with 'store' false or absent."
)


def stateless_body(body: dict[str, Any]) -> tuple[dict[str, Any], bool]:
    """The body to send (store false unless it said) and whether it streams; 400 for state."""
    if body.get("previous_response_id") is not None:
        raise InvalidRequest(
            _STATELESS.format(what="'previous_response_id'"), param="previous_response_id"
        )
    for flag in ("store", "background"):  # the schema's booleans: 1.2e-201 is not false
        if body.get(flag) is not None and not isinstance(body[flag], bool):
            raise InvalidRequest(f"'{flag}' must be a boolean", param=flag)
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
