"""Bad input gets a clear OpenAI-style 4xx — never a 500, never a hang — and leaks nothing."""

from __future__ import annotations

import aiohttp
import pytest

from router.errors import BodyTooLarge, InvalidRequest, ModelNotFound
from router.openai.api import CHAT, COMPLETIONS, parse_request
from tests.conftest import MODEL, sim_cluster

MODELS = (MODEL,)


def parse(path: str, raw: bytes, max_model_len: int | None = 8192):
    return parse_request(path, raw, models=MODELS, max_model_len=max_model_len)


@pytest.mark.parametrize(
    ("path", "raw", "param", "fragment"),
    [
        (CHAT, b"{not json", None, "not valid JSON"),
        (CHAT, b"", None, "empty"),
        (CHAT, b"[1, 2]", None, "JSON object"),
        (CHAT, b'{"messages": []}', "model", "'model' is required"),
        (CHAT, b'{"model": 7, "messages": []}', "model", "'model' is required"),
        (CHAT, b'{"model": "llama-3-8b", "messages": "hi"}', "messages", "non-empty list"),
        (CHAT, b'{"model": "llama-3-8b", "messages": [{"content": "x"}]}', "messages", "role"),
        (
            CHAT,
            b'{"model": "llama-3-8b", "messages": [{"role": "user", "content": 5}]}',
            "messages[0].content",
            "string or a list",
        ),
        (
            CHAT,
            b'{"model": "llama-3-8b", "messages": [{"role": "user", "content": [{"text": "x"}]}]}',
            "messages[0].content",
            "'type'",
        ),
        (
            CHAT,
            b'{"model": "llama-3-8b", "messages": [{"role": "user", "content": "x"}], '
            b'"max_tokens": -1}',
            "max_tokens",
            "at least 1",
        ),
        (
            CHAT,
            b'{"model": "llama-3-8b", "messages": [{"role": "user", "content": "x"}], '
            b'"max_tokens": "10"}',
            "max_tokens",
            "integer",
        ),
        (
            CHAT,
            b'{"model": "llama-3-8b", "messages": [{"role": "user", "content": "x"}], '
            b'"max_tokens": true}',
            "max_tokens",
            "integer",
        ),
        (
            CHAT,
            b'{"model": "llama-3-8b", "messages": [{"role": "user", "content": "x"}], '
            b'"max_completion_tokens": 0}',
            "max_completion_tokens",
            "at least 1",
        ),
        (
            CHAT,
            b'{"model": "llama-3-8b", "messages": [{"role": "user", "content": "x"}], '
            b'"stream": "yes"}',
            "stream",
            "boolean",
        ),
        (
            CHAT,
            b'{"model": "llama-3-8b", "messages": [{"role": "user", "content": "x"}], '
            b'"stream_options": {"include_usage": true}}',
            "stream_options",
            "only allowed",
        ),
        (
            CHAT,
            b'{"model": "llama-3-8b", "messages": [{"role": "user", "content": "x"}], "n": 129}',
            "n",
            "at most 128",
        ),
        (
            CHAT,
            b'{"model": "llama-3-8b", "messages": [{"role": "user", "content": "x"}], '
            b'"temperature": "hot"}',
            "temperature",
            "number",
        ),
        (
            CHAT,
            b'{"model": "llama-3-8b", "messages": [{"role": "user", "content": "x"}], '
            b'"max_tokens": 9000}',
            "max_tokens",
            "too large",
        ),
        (COMPLETIONS, b'{"model": "llama-3-8b"}', "prompt", "non-empty string"),
        (COMPLETIONS, b'{"model": "llama-3-8b", "prompt": ["a", "b"]}', "prompt", "batched"),
        (COMPLETIONS, b'{"model": "llama-3-8b", "prompt": [1, -2]}', "prompt", "non-negative"),
        (COMPLETIONS, b'{"model": "llama-3-8b", "prompt": 12}', "prompt", "non-empty string"),
    ],
)
def test_invalid_requests(path: str, raw: bytes, param: str | None, fragment: str) -> None:
    with pytest.raises(InvalidRequest) as exc:
        parse(path, raw)
    assert exc.value.status == 400
    assert exc.value.param == param
    assert fragment in exc.value.message


def test_unknown_model_is_404() -> None:
    with pytest.raises(ModelNotFound) as exc:
        parse(CHAT, b'{"model": "gpt-9", "messages": [{"role": "user", "content": "x"}]}')
    assert exc.value.status == 404 and exc.value.code == "model_not_found"


def test_prompt_token_counts() -> None:
    p = parse(COMPLETIONS, b'{"model": "llama-3-8b", "prompt": [1, 2, 3], "max_tokens": 5}')
    assert p.prompt_tokens == 3 and p.max_tokens == 5
    p = parse(COMPLETIONS, b'{"model": "llama-3-8b", "prompt": "abcdefgh"}')
    assert p.prompt_tokens == 2 and p.max_tokens == 8192 - 2  # no cap given: the room left
    p = parse(
        CHAT,
        b'{"model": "llama-3-8b", "messages": [{"role": "user", "content": '
        b'[{"type": "text", "text": "abcd"}, {"type": "image_url", "image_url": {}}]}],'
        b' "max_completion_tokens": 7, "max_tokens": 100}',
    )
    assert p.max_tokens == 7  # max_completion_tokens wins, as in the OpenAI API
    assert p.prompt_tokens >= 1


def test_body_too_large_is_an_invalid_request() -> None:
    assert issubclass(BodyTooLarge, InvalidRequest) and BodyTooLarge("x").status == 413


async def test_bad_input_over_http_gets_openai_errors(redis_prefix: str) -> None:
    async with sim_cluster(redis_prefix=redis_prefix, server={"max_body_bytes": 4096}) as c:
        async with aiohttp.ClientSession() as s:
            cases = [
                (b"{oops", 400),
                (
                    b'{"model": "llama-3-8b", "messages": [{"role": "user", "content": "x"}], '
                    b'"max_tokens": -3}',
                    400,
                ),
                (b'{"model": "nope", "messages": [{"role": "user", "content": "x"}]}', 404),
                (
                    b'{"model": "llama-3-8b", "messages": [{"role": "user", "content": "'
                    + b"x" * 8000
                    + b'"}]}',
                    413,
                ),
            ]
            for raw, status in cases:
                async with s.post(
                    c.router_url + CHAT, data=raw, headers={"Content-Type": "application/json"}
                ) as resp:
                    assert resp.status == status, await resp.text()
                    body = await resp.json()
                    assert set(body["error"]) == {"message", "type", "param", "code"}
                    assert body["error"]["message"]

            # Chunked upload (no Content-Length) over the limit is refused the same way.
            async def gen():  # type: ignore[no-untyped-def]
                for _ in range(10):
                    yield b"x" * 1000

            async with s.post(c.router_url + CHAT, data=gen()) as resp:
                assert resp.status == 413
                assert (await resp.json())["error"]["type"] == "invalid_request_error"
        assert await c.worker_requests("p0") == []
        assert await c.reserved_blocks() == {"d0": 0}
