"""A non-streaming answer, assembled from the decode worker's SSE stream.

The router asks decode workers to stream even when the client did not (`stream_upstream`), for
three reasons a non-streamed answer defeats: the first token is what tells the router that the
decode worker took the KV (the stranded-KV entry is cleared then, not when a long answer ends);
the TTFT deadline and the idle timeout mean what they say (a 3,000-token answer that takes two
minutes is not a silent upstream for two minutes); and the reservation grows as the answer
outgrows it. The client still gets one JSON body in the OpenAI shape of its endpoint.

Merging follows the OpenAI stream format: per choice `index`, text and string delta fields are
concatenated, tool-call fragments are joined by their `index` (arguments concatenated), logprob
lists are concatenated, the last non-null `finish_reason` wins, usage comes from the final
`include_usage` chunk. Top-level fields (`id`, `created`, `model`, `system_fingerprint`) come
from the first chunk.

A Responses API answer (router/openai/responses_pd.py) is asked as a stream the same way
(`upstream_body`: its stream has no `stream_options`) and answered with the `response` of its
`response.completed` event (`assembled`), its length `output_tokens`.
"""

from __future__ import annotations

from typing import Any

import orjson

from router.adapters.errors import WorkerError, sse_data, stream_error

__all__ = [
    "DISCARD",
    "assemble",
    "assembled",
    "output_tokens",
    "stream_upstream",
    "streamable",
    "upstream_body",
]

_TOP_LEVEL = ("id", "created", "model", "system_fingerprint", "service_tier")


def streamable(body: dict[str, Any]) -> bool:
    """Whether a worker can stream this request: vLLM refuses to stream beam search and
    `best_of` above `n`."""
    best_of = body.get("best_of")
    return not body.get("use_beam_search") and (best_of is None or best_of == (body.get("n") or 1))


def stream_upstream(body: dict[str, Any]) -> dict[str, Any]:
    """The body asking the worker to stream what the client asked for whole, usage included."""
    out = dict(body)
    out["stream"] = True
    out["stream_options"] = {"include_usage": True}
    return out


def upstream_body(body: dict[str, Any]) -> dict[str, Any]:
    """A whole Responses answer asked of the decode worker as a stream (the module docstring
    says why): the Responses stream has no `stream_options`, its `response.completed` carries
    the usage."""
    return {**body, "stream": True}


class _Discard:
    """Stands in for the client's stream in the relay while an answer is assembled: the relay
    already keeps every event it passes on (`RelayResult.chunks`)."""

    __slots__ = ()

    async def write(self, data: bytes) -> None:
        pass


DISCARD = _Discard()


def _events(raw: bytes) -> list[tuple[bytes, dict[str, Any]]]:
    out = []
    for line in raw.split(b"\n"):
        payload = sse_data(line)
        if payload is None or payload == b"[DONE]":
            continue
        try:
            obj = orjson.loads(payload)
        except orjson.JSONDecodeError:
            continue
        if isinstance(obj, dict):
            out.append((payload, obj))
    return out


def _merge_logprobs(into: dict[str, Any] | None, part: Any) -> dict[str, Any] | None:
    if not isinstance(part, dict):
        return into
    if into is None:
        into = {}
    for key, value in part.items():
        if isinstance(value, list):
            into.setdefault(key, []).extend(value)
        elif value is not None or key not in into:
            into[key] = value
    return into


def _merge_tool_calls(calls: dict[int, dict[str, Any]], fragments: Any) -> None:
    for frag in fragments if isinstance(fragments, list) else ():
        if not isinstance(frag, dict):
            continue
        call = calls.setdefault(
            int(frag.get("index", len(calls))),
            {"id": None, "type": "function", "function": {"name": None, "arguments": ""}},
        )
        if frag.get("id"):
            call["id"] = frag["id"]
        if frag.get("type"):
            call["type"] = frag["type"]
        fn = frag.get("function") or {}
        if fn.get("name"):
            call["function"]["name"] = fn["name"]
        if fn.get("arguments"):
            call["function"]["arguments"] += fn["arguments"]


class _Choice:
    __slots__ = ("index", "text", "fields", "tool_calls", "logprobs", "finish_reason", "extra")

    def __init__(self, index: int) -> None:
        self.index = index
        self.text: list[str] = []  # completions' text, chat's content
        self.fields: dict[str, Any] = {}  # other delta fields (role, reasoning_content, ...)
        self.tool_calls: dict[int, dict[str, Any]] = {}
        self.logprobs: dict[str, Any] | None = None
        self.finish_reason: Any = None
        self.extra: dict[str, Any] = {}  # per-choice fields such as vLLM's stop_reason

    def add(self, choice: dict[str, Any], chat: bool) -> None:
        if chat:
            delta = choice.get("delta") or {}
            for key, value in delta.items():
                if key == "content":
                    if value:
                        self.text.append(value)
                elif key == "tool_calls":
                    _merge_tool_calls(self.tool_calls, value)
                elif isinstance(value, str) and key != "role":
                    self.fields[key] = self.fields.get(key, "") + value
                elif value is not None or key not in self.fields:
                    self.fields[key] = value
        elif choice.get("text"):
            self.text.append(choice["text"])
        self.logprobs = _merge_logprobs(self.logprobs, choice.get("logprobs"))
        if choice.get("finish_reason") is not None:
            self.finish_reason = choice["finish_reason"]
        for key, value in choice.items():
            if key not in ("index", "delta", "text", "logprobs", "finish_reason"):
                if value is not None or key not in self.extra:
                    self.extra[key] = value

    def render(self, chat: bool) -> dict[str, Any]:
        text = "".join(self.text)
        out: dict[str, Any] = {"index": self.index}
        if chat:
            message: dict[str, Any] = {"role": self.fields.pop("role", None) or "assistant"}
            calls = [self.tool_calls[k] for k in sorted(self.tool_calls)]
            # OpenAI's shape: content is null when the answer is only tool calls.
            message["content"] = text if text or not calls else None
            message.update((k, v) for k, v in self.fields.items() if v is not None)
            if calls:
                message["tool_calls"] = calls
            out["message"] = message
        else:
            out["text"] = text
        out["logprobs"] = self.logprobs
        out["finish_reason"] = self.finish_reason
        out.update(self.extra)
        return out


def assemble(chunks: list[bytes], chat: bool) -> dict[str, Any] | WorkerError:
    """The non-streaming answer the stream in `chunks` spells, or the error event it carried
    (a 4xx the relay passed through: the worker's verdict on the request)."""
    answer: dict[str, Any] = {}
    choices: dict[int, _Choice] = {}
    usage: Any = None
    for payload, event in _events(b"".join(chunks)):
        err = stream_error(payload) if "error" in event else None
        if err is not None:
            return err
        for key in _TOP_LEVEL:
            if key not in answer and event.get(key) is not None:
                answer[key] = event[key]
        for choice in event.get("choices") or ():
            if isinstance(choice, dict):
                index = int(choice.get("index") or 0)
                choices.setdefault(index, _Choice(index)).add(choice, chat)
        if event.get("usage"):
            usage = event["usage"]
    answer["object"] = "chat.completion" if chat else "text_completion"
    answer["choices"] = [choices[i].render(chat) for i in sorted(choices)]
    answer["usage"] = usage
    return answer


def assembled(chunks: list[bytes]) -> dict[str, Any] | None:
    """The whole answer a relayed Responses stream spells: the `response` object of its
    `response.completed` (or `response.incomplete`) event; None if there is none that parses."""
    for event in reversed(b"".join(chunks).split(b"\n\n")):
        lines = event.split(b"\n")
        if lines[0] not in (b"event: response.completed", b"event: response.incomplete"):
            continue
        for line in lines[1:]:
            payload = sse_data(line)
            if payload is None:
                continue
            try:
                obj = orjson.loads(payload)
            except orjson.JSONDecodeError:
                return None
            response = obj.get("response") if isinstance(obj, dict) else None
            return response if isinstance(response, dict) else None
    return None


def output_tokens(answer: dict[str, Any]) -> int:
    """The output tokens of a whole Responses answer (its usage's; 0 if it has none)."""
    usage = answer.get("usage")
    tokens = usage.get("output_tokens") if isinstance(usage, dict) else None
    return tokens if isinstance(tokens, int) and not isinstance(tokens, bool) else 0
