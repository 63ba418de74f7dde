"""A non-streaming answer assembled from a decode worker's stream (router/request/assemble.py): the
OpenAI shapes of both endpoints, from chunks as vLLM sends them."""

from __future__ import annotations

from typing import Any

import orjson

from router.adapters.errors import WorkerError
from router.request.assemble import assemble, stream_upstream, streamable


def sse(*events: dict[str, Any]) -> list[bytes]:
    """The chunks of a stream, split mid-way as a socket might deliver them."""
    raw = b"".join(b"data: " + orjson.dumps(e) + b"\n\n" for e in events) + b"data: [DONE]\n\n"
    return [raw[:37], raw[37:]]


def chunk(choices: list[dict[str, Any]], obj: str = "text_completion", **top: Any) -> dict:
    return {
        "id": "cmpl-1",
        "object": obj,
        "created": 1700000000,
        "model": "m",
        "choices": choices,
        **top,
    }


USAGE = {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}


def test_completions_text_finish_reason_and_usage() -> None:
    events = [
        chunk(
            [
                {
                    "index": 0,
                    "text": "Hel",
                    "logprobs": None,
                    "finish_reason": None,
                    "stop_reason": None,
                }
            ]
        ),
        chunk(
            [
                {
                    "index": 0,
                    "text": "lo",
                    "logprobs": None,
                    "finish_reason": None,
                    "stop_reason": None,
                }
            ]
        ),
        chunk(
            [
                {
                    "index": 0,
                    "text": "!",
                    "logprobs": None,
                    "finish_reason": "length",
                    "stop_reason": None,
                }
            ]
        ),
        chunk([], usage=USAGE),
    ]
    answer = assemble(sse(*events), chat=False)
    assert answer == {
        "id": "cmpl-1",
        "created": 1700000000,
        "model": "m",
        "object": "text_completion",
        "choices": [
            {
                "index": 0,
                "text": "Hello!",
                "logprobs": None,
                "finish_reason": "length",
                "stop_reason": None,
            }
        ],
        "usage": USAGE,
    }


def test_completions_logprobs_are_concatenated() -> None:
    def lp(tok: str, p: float) -> dict[str, Any]:
        return {
            "tokens": [tok],
            "token_logprobs": [p],
            "top_logprobs": [{tok: p}],
            "text_offset": [0],
        }

    events = [
        chunk([{"index": 0, "text": "a", "logprobs": lp("a", -0.1)}]),
        chunk([{"index": 0, "text": "b", "logprobs": lp("b", -0.2), "finish_reason": "stop"}]),
    ]
    answer = assemble(sse(*events), chat=False)
    assert isinstance(answer, dict)
    logprobs = answer["choices"][0]["logprobs"]
    assert logprobs["tokens"] == ["a", "b"]
    assert logprobs["token_logprobs"] == [-0.1, -0.2]
    assert logprobs["top_logprobs"] == [{"a": -0.1}, {"b": -0.2}]
    assert answer["usage"] is None  # the worker sent none: not invented


def test_chat_message_reasoning_and_usage() -> None:
    c = "chat.completion.chunk"
    events = [
        chunk(
            [
                {
                    "index": 0,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                }
            ],
            c,
            system_fingerprint="fp",
        ),
        chunk([{"index": 0, "delta": {"reasoning_content": "think "}}], c),
        chunk([{"index": 0, "delta": {"reasoning_content": "hard"}}], c),
        chunk([{"index": 0, "delta": {"content": "The "}}], c),
        chunk([{"index": 0, "delta": {"content": "answer"}, "finish_reason": "stop"}], c),
        chunk([], c, usage=USAGE),
    ]
    answer = assemble(sse(*events), chat=True)
    assert isinstance(answer, dict)
    assert answer["object"] == "chat.completion"
    assert answer["system_fingerprint"] == "fp"
    assert answer["choices"] == [
        {
            "index": 0,
            "message": {
                "role": "assistant",
                "content": "The answer",
                "reasoning_content": "think hard",
            },
            "logprobs": None,
            "finish_reason": "stop",
        }
    ]
    assert answer["usage"] == USAGE


def test_chat_tool_call_fragments_are_joined() -> None:
    c = "chat.completion.chunk"
    events = [
        chunk([{"index": 0, "delta": {"role": "assistant"}}], c),
        chunk(
            [
                {
                    "index": 0,
                    "delta": {
                        "tool_calls": [
                            {
                                "index": 0,
                                "id": "call_1",
                                "type": "function",
                                "function": {"name": "get_weather", "arguments": ""},
                            }
                        ]
                    },
                }
            ],
            c,
        ),
        chunk(
            [
                {
                    "index": 0,
                    "delta": {"tool_calls": [{"index": 0, "function": {"arguments": '{"city": '}}]},
                }
            ],
            c,
        ),
        chunk(
            [
                {
                    "index": 0,
                    "delta": {
                        "tool_calls": [
                            {
                                "index": 1,
                                "id": "call_2",
                                "type": "function",
                                "function": {"name": "get_time", "arguments": "{}"},
                            }
                        ]
                    },
                }
            ],
            c,
        ),
        chunk(
            [
                {
                    "index": 0,
                    "delta": {"tool_calls": [{"index": 0, "function": {"arguments": '"Paris"}'}}]},
                    "finish_reason": "tool_calls",
                }
            ],
            c,
        ),
    ]
    answer = assemble(sse(*events), chat=True)
    assert isinstance(answer, dict)
    message = answer["choices"][0]["message"]
    assert message["content"] is None  # OpenAI's shape for a tool-call-only answer
    assert message["tool_calls"] == [
        {
            "id": "call_1",
            "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
        },
        {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": "{}"}},
    ]
    assert answer["choices"][0]["finish_reason"] == "tool_calls"


def test_chat_logprobs_content_lists_are_concatenated() -> None:
    c = "chat.completion.chunk"
    events = [
        chunk(
            [
                {
                    "index": 0,
                    "delta": {"content": "x"},
                    "logprobs": {"content": [{"token": "x", "logprob": -1.0}]},
                }
            ],
            c,
        ),
        chunk(
            [
                {
                    "index": 0,
                    "delta": {"content": "y"},
                    "logprobs": {"content": [{"token": "y", "logprob": -2.0}]},
                }
            ],
            c,
        ),
    ]
    answer = assemble(sse(*events), chat=True)
    assert isinstance(answer, dict)
    assert [t["token"] for t in answer["choices"][0]["logprobs"]["content"]] == ["x", "y"]


def test_a_4xx_error_event_is_returned_as_the_error() -> None:
    raw = (
        b'data: {"error": {"message": "bad logit_bias", "type": "BadRequestError", '
        b'"param": "logit_bias", "code": 400}}\n\ndata: [DONE]\n\n'
    )
    err = assemble([raw], chat=True)
    assert isinstance(err, WorkerError)
    assert (err.status, err.param) == (400, "logit_bias")
    assert "bad logit_bias" in err.message


def test_comment_lines_and_empty_streams() -> None:
    answer = assemble([b": keep-alive\n\ndata: [DONE]\n\n"], chat=False)
    assert answer == {"object": "text_completion", "choices": [], "usage": None}


def test_upstream_body_streams_with_usage_and_keeps_the_rest() -> None:
    body = {"model": "m", "prompt": "p", "max_tokens": 5, "stream": False}
    up = stream_upstream(body)
    assert up == {
        "model": "m",
        "prompt": "p",
        "max_tokens": 5,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    assert body["stream"] is False  # the client's body is not touched


def test_what_vllm_cannot_stream_is_not_streamed() -> None:
    assert streamable({"prompt": "p"})
    assert streamable({"prompt": "p", "best_of": 1})
    assert streamable({"prompt": "p", "best_of": 2, "n": 2})
    assert not streamable({"prompt": "p", "best_of": 3})
    assert not streamable({"prompt": "p", "use_beam_search": True})
