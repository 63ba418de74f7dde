"""The usage of a resumed stream, as the client's one answer (issue 31: "usage stays exact").

A stream that resumes (its decode worker died, or the router preempted it: router/request/
resume.py) goes on as a new request whose prompt is the original prompt plus the `resumed`
tokens the client already has. The worker's usage of that continuation counts those tokens as
prompt; the client asked one question and got one answer, so its final usage event says what one
engine alone would: prompt_tokens − resumed, completion_tokens + resumed (the total is the same).

`usage_rewrite(resumed)` is the relay's `rewrite` (router/relay/contract.py) for a
continuation's stream only — a stream never resumed costs nothing. The relay hands it whole
events; only an event holding a usage object is parsed and rewritten.
"""

from __future__ import annotations

from typing import Any

import orjson

from router.relay.contract import Rewrite

__all__ = ["corrected_usage", "usage_rewrite"]

_MARKS = (b'"usage":{', b'"usage": {')


def corrected_usage(usage: dict[str, Any], resumed: int) -> dict[str, Any]:
    """`usage` of a continuation that was given `resumed` answer tokens as prompt."""
    prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
    if not isinstance(prompt, int) or not isinstance(completion, int):
        return usage
    moved = min(resumed, prompt)
    return {**usage, "prompt_tokens": prompt - moved, "completion_tokens": completion + moved}


def _rewrite_event(event: bytes, resumed: int) -> bytes:
    if not event.startswith(b"data: ") or not any(m in event for m in _MARKS):
        return event
    try:
        payload = orjson.loads(event[6:])
    except orjson.JSONDecodeError:
        return event
    usage = payload.get("usage") if isinstance(payload, dict) else None
    if not isinstance(usage, dict):
        return event
    payload["usage"] = corrected_usage(usage, resumed)
    return b"data: " + orjson.dumps(payload)


def usage_rewrite(resumed: int) -> Rewrite:
    """The rewrite of a continuation's events that were given `resumed` tokens as prompt."""

    def rewrite(data: bytes) -> bytes:
        if not any(m in data for m in _MARKS):
            return data
        return b"\n\n".join(_rewrite_event(e, resumed) for e in data.split(b"\n\n"))

    return rewrite
