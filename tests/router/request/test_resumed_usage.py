"""A continuation's events as the client's one answer has them (router/request/resumed_usage.py):
its opening role event dropped, its usage said as one answer's, every other event as it came."""

from __future__ import annotations

from typing import Any

import orjson

from router.request.resumed_usage import usage_rewrite


def _event(payload: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"


def _chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
    return {"id": "c1", "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


def test_the_continuations_role_event_is_dropped_and_its_text_kept() -> None:
    rewrite = usage_rewrite(5)
    role = _event(_chunk({"role": "assistant", "content": ""}))
    token = _event(_chunk({"content": " next"}))
    assert rewrite(role) == b""
    assert rewrite(role + token) == token
    assert rewrite(token) is token  # nothing to change: the same bytes, not a copy


def test_a_role_beside_text_or_an_end_is_kept() -> None:
    """SGLang-style chunks name the role on every token; an end event may carry one too."""
    rewrite = usage_rewrite(5)
    with_text = _event(_chunk({"role": "assistant", "content": " word"}))
    ending = _event(_chunk({"role": "assistant", "content": ""}, finish="length"))
    assert rewrite(with_text) == with_text
    assert rewrite(ending) == ending


def test_the_usage_counts_the_resumed_tokens_as_answer() -> None:
    rewrite = usage_rewrite(5)
    usage = {"prompt_tokens": 15, "completion_tokens": 7, "total_tokens": 22}
    out = rewrite(_event({"id": "c1", "choices": [], "usage": usage}) + b"data: [DONE]\n\n")
    first, done, _ = out.split(b"\n\n")
    assert orjson.loads(first[6:])["usage"] == {
        "prompt_tokens": 10,
        "completion_tokens": 12,
        "total_tokens": 22,
    }
    assert done == b"data: [DONE]"
