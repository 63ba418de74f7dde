"""vLLM's OpenAI response shapes: SSE chunks one token each, and whole non-streaming answers.

Chat streams open with a role chunk (`delta: {"role": "assistant", "content": ""}`), send one
`{"content": tok}` chunk per token and close with an empty-delta chunk carrying finish_reason.
Completion streams send one `text` chunk per token, the last carrying finish_reason (as vLLM
does). With `stream_options.include_usage` a `"choices": []` chunk with usage precedes
`data: [DONE]`; `continuous_usage_stats` adds running usage to every chunk.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import orjson
from aiohttp import web

__all__ = ["AnswerFormat", "sse", "DONE", "malformed_response"]

DONE = b"data: [DONE]\n\n"
CHAT_PATH = "/v1/chat/completions"


def sse(obj: Any) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


class AnswerFormat:
    """Formats one request's answer; knows its id, model, prompt size and stream options."""

    def __init__(
        self, path: str, request_id: str, model: str, prompt_tokens: int, body: Mapping[str, Any]
    ) -> None:
        self.chat = path == CHAT_PATH
        self.id = ("chatcmpl-" if self.chat else "cmpl-") + request_id
        self.model = model
        self.prompt_tokens = prompt_tokens
        self.created = int(time.time())
        self.stream = body.get("stream") is True
        options = body.get("stream_options")
        options = options if isinstance(options, dict) else {}
        self.include_usage = bool(options.get("include_usage"))
        self.continuous_usage = self.include_usage and bool(options.get("continuous_usage_stats"))

    def usage(self, completion_tokens: int) -> dict[str, int]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": self.prompt_tokens + completion_tokens,
        }

    def _chunk(self, choice: dict[str, Any] | None, sent: int) -> bytes:
        obj: dict[str, Any] = {
            "id": self.id,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [] if choice is None else [choice],
        }
        if self.continuous_usage or choice is None:
            obj["usage"] = self.usage(sent)
        return sse(obj)

    def _choice(
        self, payload: dict[str, Any], finish: str | None, index: int = 0
    ) -> dict[str, Any]:
        return {"index": index, **payload, "logprobs": None, "finish_reason": finish}

    def role_event(self, index: int = 0) -> bytes:
        """The opening chunk of a chat stream (one per choice); nothing for completions."""
        if not self.chat:
            return b""
        role = {"delta": {"role": "assistant", "content": ""}}
        return self._chunk(self._choice(role, None, index), 0)

    def events(
        self, tok: str, finish: str | None, sent: int, index: int = 0, last: bool = True
    ) -> bytes:
        """Bytes for one produced token of choice `index` (`sent` counts it, over all choices);
        with the stream's tail when it ends the last choice still running (`last`)."""
        out = b""
        if self.chat:
            if tok:
                out += self._chunk(self._choice({"delta": {"content": tok}}, None, index), sent)
            if finish is not None:
                out += self._chunk(self._choice({"delta": {}}, finish, index), sent)
        elif tok or finish is not None:
            out += self._chunk(self._choice({"text": tok}, finish, index), sent)
        if finish is not None and last:
            if self.include_usage:
                out += self._chunk(None, sent)
            out += DONE
        return out

    def full(
        self,
        text: str,
        finish: str,
        completion_tokens: int,
        kv_transfer_params: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """The non-streaming answer object (vLLM puts kv_transfer_params at the top level)."""
        return self.full_choices([(text, finish)], completion_tokens, kv_transfer_params)

    def full_choices(
        self,
        choices: list[tuple[str, str]],
        completion_tokens: int,
        kv_transfer_params: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """The non-streaming answer of one or more choices ((text, finish) each, by index);
        usage counts every choice's tokens."""
        out = []
        for index, (text, finish) in enumerate(choices):
            if self.chat:
                message = {"role": "assistant", "content": text, "tool_calls": []}
                choice = self._choice({"message": message}, finish, index)
            else:
                choice = self._choice({"text": text}, finish, index)
            choice["stop_reason"] = None
            out.append(choice)
        return {
            "id": self.id,
            "object": "chat.completion" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": out,
            "usage": self.usage(completion_tokens),
            "kv_transfer_params": kv_transfer_params,
        }

    def __repr__(self) -> str:
        return f"AnswerFormat({self.id!r}, chat={self.chat}, stream={self.stream})"


def malformed_response(stream: bool) -> web.Response:
    """An injected 200 whose body does not parse: a truncated JSON object (or SSE event)."""
    if stream:
        return web.Response(
            status=200,
            body=b'data: {"id": "cmpl-broken", "choices": [{"text": \n\n' + DONE,
            content_type="text/event-stream",
        )
    return web.Response(
        status=200, body=b'{"id": "cmpl-broken", "choices": [', content_type="application/json"
    )
