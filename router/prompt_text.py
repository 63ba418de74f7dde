"""The text of a request's prompt, per endpoint, without a tokenizer: chat messages, a
completion's prompt, a Responses request's instructions and input items. The prefix hashes
(router/workers/prefixes.py) and the Responses token estimate (router/responses_pd.py) read the same
text, so a Responses prompt gets prefix affinity like a chat one."""

from __future__ import annotations

from typing import Any

from router.api import CHAT, RESPONSES

__all__ = ["prompt_text", "text_of"]


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
