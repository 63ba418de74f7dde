"""The text of a request's prompt, per endpoint, without a tokenizer: chat messages, a
completion's prompt, a Responses request's instructions and input items. The prefix hashes
(`prefix_hashes`, below) and the Responses token estimate (router/openai/responses_pd.py) read the
same text, so a Responses prompt gets prefix affinity like a chat one.

`prefix_hashes`: no tokenizer is at hand, so blocks are cut on characters. Each hash covers the
whole prompt up to the end of its block, so two prompts share their leading hashes exactly as far
as they share a prefix: what a prefill worker's prefix cache would reuse. The two-sided policy
prefers a prefill worker that recently prefilled the same prefix."""

from __future__ import annotations

import zlib
from typing import Any

from router.openai.api import CHAT, RESPONSES

__all__ = ["BLOCK_CHARS", "prefix_hashes", "prompt_text", "text_of"]

# Prefix blocks are cut on characters: 4 a token, 512-token blocks, as Mooncake's traces count.
BLOCK_CHARS = 512 * 4
_MAX_BLOCKS = 64  # enough to tell prompts apart; the rest would only cost time


def text_of(value: Any) -> str:
    """The text an input item carries to the model: strings, and the `text`/`content`/`output`/
    `arguments`/`summary` of nested parts (a rough count, as chat's; the workers tokenize for
    real). Walked with a stack, not recursion: a body may nest as deep as the JSON parser allows."""
    parts: list[str] = []
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            parts.append(v)
        elif isinstance(v, list):
            stack.extend(reversed(v))
        elif isinstance(v, dict):
            stack.extend(v.get(k) for k in ("summary", "arguments", "output", "content", "text"))
    return "".join(parts)


def _chat_text(body: dict[str, Any]) -> str:
    parts = []
    for msg in body.get("messages") or ():
        content = msg.get("content")
        if isinstance(content, list):
            content = "".join(p.get("text", "") for p in content if p.get("type") == "text")
        parts.append(f"{msg.get('role')}\n{content or ''}\n")
    return "".join(parts)


def _responses_text(body: dict[str, Any]) -> str:
    # Instructions first: they lead the prompt the worker builds, so they are its prefix.
    instructions = body.get("instructions")
    head = instructions + "\n" if isinstance(instructions, str) else ""
    return head + text_of(body.get("input"))


def prompt_text(path: str, body: dict[str, Any]) -> str:
    """The prompt's text as the request carries it (the body is already validated)."""
    if path == CHAT:
        return _chat_text(body)
    if path == RESPONSES:
        return _responses_text(body)
    prompt = body.get("prompt")
    if isinstance(prompt, list):
        prompt = prompt[0] if prompt and isinstance(prompt[0], str) else " ".join(map(str, prompt))
    return prompt if isinstance(prompt, str) else ""


def prefix_hashes(path: str, body: dict[str, Any]) -> tuple[int, ...]:
    data = prompt_text(path, body).encode()
    out, state = [], 0
    for i in range(min(len(data) // BLOCK_CHARS, _MAX_BLOCKS)):
        state = zlib.crc32(data[i * BLOCK_CHARS : (i + 1) * BLOCK_CHARS], state)
        out.append(state)
    return tuple(out)
