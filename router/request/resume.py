"""Resuming a stream whose decode worker died: the request that continues it.

Entry point: `Resumer.ask(call, sent)`: from the events the client already has, the `Ask` of the
next try (router/request/attempt.py), which the orchestrator runs like any other.

The new request carries the prompt plus the answer so far, so the new decode worker picks up at
the next token — the way greedy decoding of the same model would continue. Chat continues the
partial assistant message (`continue_final_message`, which vLLM and SGLang support);
completions append the text to the prompt. The token cap shrinks by what was already sent.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson

from router.config import Settings
from router.errors import UpstreamError
from router.openai.api import CHAT, ParsedRequest
from router.request.attempt import Ask, Call
from router.tokens.loaded import tokenizer_for
from router.workers.membership import Membership

__all__ = ["AnswerComplete", "Resumer", "end_frames", "resume_body", "sent_text"]


class AnswerComplete(Exception):
    """The client already has every token its `max_tokens` allows (a stream cut, or preempted,
    after its last token but before its end): nothing is left to ask, the stream is ended with
    the frames a finished answer ends with (`end_frames`), never an error."""

    def __init__(self, tokens: int) -> None:
        super().__init__(f"the answer is complete at {tokens} tokens")
        self.tokens = tokens


@dataclass(frozen=True, slots=True)
class Resumer:
    """The resume stage: what it needs of the replica, handed to it once."""

    settings: Settings
    session: aiohttp.ClientSession
    members: Membership

    def __repr__(self) -> str:
        return "Resumer()"

    async def ask(self, call: Call, sent: list[bytes]) -> Ask:
        """The try that continues the answer whose events so far are `sent`."""
        parsed = call.parsed
        text, resumed = sent_text(sent, parsed.path == CHAT)
        resumed = max(resumed, await self.tokens_in(call, text))
        body, prompt_tokens, max_tokens = resume_body(
            parsed, text, resumed, self.settings.estimates.chars_per_token
        )
        return Ask(body, prompt_tokens, max_tokens, resumed, resume=True)

    async def tokens_in(self, call: Call, text: str) -> int:
        """How many tokens `text` is: by the model's own tokenizer when the router has it
        (settings `tokenizers`: no call, and the only way for SGLang workers, which this asks
        nothing), else by a real vLLM worker's (`POST /tokenize`); 0 when neither can tell.

        Counting chunks undercounts what was sent: vLLM merges several tokens into one chunk when
        its API server falls behind, and a resumed answer would then run past `max_tokens`. The
        simulated worker always sends one token per chunk (and its /tokenize only approximates),
        so it is not asked. Resuming is rare; one extra call then is cheap."""
        if not text:
            return 0
        model = call.parsed.body.get("model")
        tokenizer = (
            tokenizer_for(self.settings.estimates.tokenizers, model)
            if isinstance(model, str)
            else None
        )
        if tokenizer is not None:
            return len(tokenizer.encode(text, add_special_tokens=False))
        count = await self._count_by_worker({"model": model, "prompt": text})
        return count or 0

    async def prompt_tokens(self, call: Call) -> int:
        """The prompt's tokens as the engine counts them, for the usage of an answer the router
        ends itself: exact already when the router counted them (a tokenizer, token ids), else
        by a real vLLM worker's `/tokenize` of the same prompt, else the router's estimate."""
        parsed = call.parsed
        if parsed.prompt_tokens_source != "estimate":
            return parsed.prompt_tokens
        body = parsed.body
        payload: dict[str, Any] = {"model": body.get("model")}
        if parsed.path == CHAT:
            payload.update(messages=body.get("messages"), add_generation_prompt=True)
        else:
            payload["prompt"] = body.get("prompt")
        count = await self._count_by_worker(payload)
        return parsed.prompt_tokens if count is None else count

    async def _count_by_worker(self, payload: dict[str, Any]) -> int | None:
        """`count` of a vLLM worker's `POST /tokenize` (at most two asked), None if none told."""
        asked = 0
        for w in list(self.members.workers.values()):
            if w.spec.adapter not in ("vllm", "mooncake") or not w.healthy or asked >= 2:
                continue
            asked += 1
            try:
                async with asyncio.timeout(self.settings.timeouts.connect_s + 5.0):
                    async with self.session.post(
                        w.spec.url + "/tokenize",
                        data=orjson.dumps({**payload, "add_special_tokens": False}),
                        headers={"Content-Type": "application/json"},
                    ) as resp:
                        if resp.status != 200:
                            continue
                        count = orjson.loads(await resp.read()).get("count")
            except (aiohttp.ClientError, TimeoutError, orjson.JSONDecodeError, AttributeError):
                continue
            if isinstance(count, int) and count >= 0:
                return count
        return None


def resume_body(
    parsed: ParsedRequest, sent_text: str, sent_tokens: int, chars_per_token: float
) -> tuple[dict[str, Any], int, int]:
    """(body, prompt tokens, max tokens) of the request that continues the answer."""
    if sent_tokens == 0 and not sent_text:  # nothing reached the client: simply start again
        return dict(parsed.body), parsed.prompt_tokens, parsed.max_tokens
    remaining = parsed.max_tokens - sent_tokens
    if remaining < 1:
        raise AnswerComplete(parsed.max_tokens)
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
    # An exact prompt grows by the tokens sent, which are exact too (the engine's own, counted
    # by a worker's tokenizer when chunks merged); an estimated one by the text's estimate.
    if parsed.prompt_token_ids is not None:
        prompt_tokens = parsed.prompt_tokens + sent_tokens
    else:
        prompt_tokens = parsed.prompt_tokens + int(len(sent_text) / chars_per_token + 0.999)
    return body, prompt_tokens, remaining


def _sent_events(chunks: list[bytes]) -> Iterator[dict[str, Any]]:
    """The JSON objects of the whole events the client has received, in order.

    Only whole events count: a trailing partial event never reached the client (its SSE parser
    drops it), so it is not part of what was sent."""
    raw = b"".join(chunks)
    events = raw.split(b"\n\n")
    if not raw.endswith(b"\n\n"):
        events = events[:-1]
    for event in events:
        for line in event.split(b"\n"):
            if not line.startswith(b"data: {"):
                continue
            try:
                payload = orjson.loads(line[6:])
            except orjson.JSONDecodeError:
                continue
            if isinstance(payload, dict):
                yield payload


def sent_text(chunks: list[bytes], chat: bool) -> tuple[str, int]:
    """The answer text and token count the client has received, from the relayed raw chunks."""
    parts: list[str] = []
    for payload in _sent_events(chunks):
        for choice in payload.get("choices") or ():
            piece = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
            if piece:
                parts.append(piece)
    return "".join(parts), len(parts)


def end_frames(parsed: ParsedRequest, sent: list[bytes], prompt_tokens: int) -> bytes:
    """The events that end a complete answer the worker did not end: a last chunk whose
    finish_reason is `length` (every token `max_tokens` allows was sent), the usage event when
    the request asked for it (stream_options.include_usage), and [DONE]; what of these the
    client already has is not sent again. The chunks' id, object, model and creation time are
    those of the events the client has."""
    head: dict[str, Any] = {}
    finished = used = False
    for payload in _sent_events(sent):
        if not head:
            head = {k: payload[k] for k in ("id", "object", "created", "model") if k in payload}
        choices = payload.get("choices") or ()
        finished |= any(isinstance(c, dict) and c.get("finish_reason") for c in choices)
        used |= isinstance(payload.get("usage"), dict)
    frames: list[dict[str, Any]] = []
    if not finished:
        choice: dict[str, Any] = {"index": 0, "finish_reason": "length"}
        if parsed.path == CHAT:
            choice["delta"] = {}
        else:
            choice["text"] = ""
        frames.append({**head, "choices": [choice]})
    if parsed.include_usage and not used:
        completion = parsed.max_tokens
        usage = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion,
        }
        frames.append({**head, "choices": [], "usage": usage})
    out = b"".join(b"data: " + orjson.dumps(f) + b"\n\n" for f in frames)
    return out + b"data: [DONE]\n\n"
