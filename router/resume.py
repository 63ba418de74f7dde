"""Resuming a stream whose decode worker died: the request that continues it.

The new request carries the prompt plus the answer so far, so the new decode worker picks up at
the next token — the way greedy decoding of the same model would continue. Chat continues the
partial assistant message (`continue_final_message`, which vLLM and SGLang support);
completions append the text to the prompt. The token cap shrinks by what was already sent.
"""

from __future__ import annotations

from typing import Any

from router.api import CHAT, ParsedRequest
from router.errors import UpstreamError

__all__ = ["resume_body"]


def resume_body(
    parsed: ParsedRequest, sent_text: str, sent_tokens: int, chars_per_token: float
) -> tuple[dict[str, Any], int, int]:
    """(body, prompt tokens, max tokens) of the request that continues the answer."""
    if sent_tokens == 0 and not sent_text:  # nothing reached the client: simply start again
        return dict(parsed.body), parsed.prompt_tokens, parsed.max_tokens
    remaining = parsed.max_tokens - sent_tokens
    if remaining < 1:
        raise UpstreamError(
            "the decode worker died after the last token but before the end of "
            "the stream; the answer is complete"
        )
    body = dict(parsed.body)
    if parsed.path == CHAT:
        body["messages"] = [*parsed.body["messages"], {"role": "assistant", "content": sent_text}]
        body["continue_final_message"] = True
        body["add_generation_prompt"] = False
    else:
        prompt = parsed.body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str):
            raise UpstreamError(
                "the decode worker died mid-stream and a prompt of token ids "
                "cannot be resumed without a tokenizer"
            )
        body["prompt"] = prompt + sent_text
    for key in ("max_tokens", "max_completion_tokens"):
        if key in body and body[key] is not None:
            body[key] = remaining
    if "max_tokens" not in body and "max_completion_tokens" not in body:
        body["max_tokens"] = remaining
    for key in ("min_tokens", "min_completion_tokens"):
        if isinstance(body.get(key), int):
            body[key] = max(0, body[key] - sent_tokens)
    prompt_tokens = parsed.prompt_tokens + int(len(sent_text) / chars_per_token + 0.999)
    return body, prompt_tokens, remaining
