"""The usage of a resumed stream, as the client's one answer (issue 31: "usage stays exact").

A stream that resumes (its decode worker died, or the router preempted it: router/request/
resume.py) goes on as a new request whose prompt is the original prompt plus the `resumed`
tokens the client already has. The worker's usage of that continuation counts those tokens as
prompt; the client asked one question and got one answer, so its final usage event says what one
engine alone would: prompt_tokens − resumed, completion_tokens + resumed (the total is the same).

A continuation is a new chat stream, so the worker opens it as it opens every stream, with a
role event (`delta: {"role": "assistant", "content": ""}`). The client's one answer had that
event already: a second one is dropped, so the client sees one answer's events, exactly.

`usage_rewrite(resumed)` is the relay's `rewrite` (router/relay/contract.py) for a
continuation's stream only — a stream never resumed costs nothing. The relay hands it whole
events; only an event holding a usage object or a role is parsed.
"""

from __future__ import annotations

from typing import Any

import orjson

from router.relay.contract import Rewrite

__all__ = ["corrected_usage", "usage_rewrite"]

_MARKS = (b'"usage":{', b'"usage": {')
_ROLE_MARKS = (b'"role":', b'"role" :')


def corrected_usage(usage: dict[str, Any], resumed: int) -> dict[str, Any]:
    """`usage` of a continuation that was given `resumed` answer tokens as prompt."""
    prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
    if not isinstance(prompt, int) or not isinstance(completion, int):
        return usage
    moved = min(resumed, prompt)
    return {**usage, "prompt_tokens": prompt - moved, "completion_tokens": completion + moved}


def _only_a_role(payload: dict[str, Any]) -> bool:
    """An event that opens a chat stream and says nothing else: a role, no text, no end."""
    choices = payload.get("choices")
    if not isinstance(choices, list) or not choices or payload.get("usage"):
        return False
    for choice in choices:
        if not isinstance(choice, dict) or choice.get("finish_reason") is not None:
            return False
        delta = choice.get("delta")
        if not isinstance(delta, dict) or "role" not in delta:
            return False
        if any(value for key, value in delta.items() if key != "role"):
            return False
    return True


def _rewrite_event(event: bytes, resumed: int) -> bytes | None:
    """The event as the client's one answer has it; None when it has no place there."""
    if not event.startswith(b"data: "):
        return event
    usage_mark = any(m in event for m in _MARKS)
    if not usage_mark and not any(m in event for m in _ROLE_MARKS):
        return event
    try:
        payload = orjson.loads(event[6:])
    except orjson.JSONDecodeError:
        return event
    if not isinstance(payload, dict):
        return event
    if _only_a_role(payload):
        return None
    usage = payload.get("usage")
    if not usage_mark or not isinstance(usage, dict):
        return event
    payload["usage"] = corrected_usage(usage, resumed)
    return b"data: " + orjson.dumps(payload)


def usage_rewrite(resumed: int) -> Rewrite:
    """The rewrite of a continuation's events that were given `resumed` tokens as prompt."""

    def rewrite(data: bytes) -> bytes:
        if not any(m in data for m in _MARKS) and not any(m in data for m in _ROLE_MARKS):
            return data  # the same bytes back: the relay sends them as they came
        events = (_rewrite_event(e, resumed) for e in data.split(b"\n\n"))
        return b"\n\n".join(e for e in events if e is not None)

    return rewrite
