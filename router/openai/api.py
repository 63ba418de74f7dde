"""OpenAI request parsing and validation: raw bytes in, a validated `ParsedRequest` out.

Validation is strict about what the router itself relies on (the model, the prompt, the token
caps, streaming flags) and lenient about everything else, which passes through to the workers
untouched: vLLM and SGLang accept many extensions and a gateway must not second-guess them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import orjson

from router.errors import InvalidRequest, ModelNotFound

if TYPE_CHECKING:  # the tokenizer's module imports nothing of this one: no circle
    from router.tokens.tokenizer import PromptTokenizer

__all__ = [
    "CHAT",
    "COMPLETIONS",
    "RESPONSES",
    "DEFAULT_MAX_N",
    "NO_LIMIT_CAP",
    "output_cap",
    "ParsedRequest",
    "PromptTokensSource",
    "TokenizerLookup",
    "parse_request",
]

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
RESPONSES = "/v1/responses"

# Tokens a chat template adds around each message (role markers, separators): a rough allowance
# so that many short messages are not under-counted.
_PER_MESSAGE_TOKENS = 4


# How a request's prompt_tokens were counted: by the model's tokenizer (router/tokens/), as the
# token ids the client sent, or estimated from characters (settings chars_per_token).
PromptTokensSource = Literal["tokenizer", "token_ids", "estimate"]
# The served model's tokenizer by model name (router/openai/prompt_tokens.py), None without one.
TokenizerLookup = Callable[[str], "PromptTokenizer | None"]


@dataclass(frozen=True, slots=True)
class ParsedRequest:
    path: str
    body: dict[str, Any]
    model: str
    stream: bool
    include_usage: bool
    prompt_tokens: int
    max_tokens: int  # the effective cap on output tokens, per choice
    n: int = 1  # choices in the answer (the request's `n`)
    # The prompt's exact token ids (the engine's own), None when only estimated: what placement
    # names the prompt's blocks by (policies/token_blocks.py).
    prompt_token_ids: tuple[int, ...] | None = None
    prompt_tokens_source: PromptTokensSource = "estimate"

    def __repr__(self) -> str:
        return (
            f"ParsedRequest({self.path}, model={self.model!r}, stream={self.stream}, "
            f"prompt_tokens={self.prompt_tokens}, max_tokens={self.max_tokens}, n={self.n})"
        )


# Validated integers must fit a signed 64-bit integer, as they do in the workers.
_INT_MAX = 2**63 - 1

# The default cap on `n` (settings `api.max_n`): OpenAI's own limit. Each choice holds its own
# output KV on the decode worker, so the reservation grows with n.
DEFAULT_MAX_N = 128


def _as_int(v: Any) -> int | None:
    """`v` as an integer if it is one, else None. JSON has one number type: `16.0` is the
    integer 16 to JSON Schema (and so to router/openapi.json) and to the workers' pydantic
    models, so it is one here too. Booleans are not integers."""
    if isinstance(v, bool):
        return None
    if isinstance(v, int):
        return v
    if isinstance(v, float) and v.is_integer():
        return int(v)
    return None


def _is_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _text_tokens(text: str, chars_per_token: float) -> int:
    return max(1, int((len(text) + chars_per_token - 1) // chars_per_token))


def _token_ids(prompt: list[Any]) -> tuple[int, ...] | None:
    """A prompt of token ids as integers (7.0 -> 7, also for the workers), None if it is not
    one."""
    ids = [t for t in map(_as_int, prompt) if t is not None]
    if len(ids) != len(prompt):
        return None
    if any(not 0 <= t <= _INT_MAX for t in ids):
        raise InvalidRequest(
            f"prompt token ids must be non-negative and at most {_INT_MAX}", param="prompt"
        )
    prompt[:] = ids
    return tuple(ids)


def _prompt_tokens_completions(prompt: Any, cpt: float) -> tuple[int, tuple[int, ...] | None]:
    """(tokens, the exact ids when the prompt is token ids) of a completion's prompt."""
    if isinstance(prompt, str):
        return _text_tokens(prompt, cpt), None
    if isinstance(prompt, list) and prompt:
        ids = _token_ids(prompt)
        if ids is not None:
            return len(ids), ids
        if len(prompt) == 1 and isinstance(prompt[0], list) and prompt[0]:
            ids = _token_ids(prompt[0])  # `[[ids]]`: one prompt of token ids, as vLLM reads it
            if ids is not None:
                return len(ids), ids
        if len(prompt) == 1 and isinstance(prompt[0], str):
            return _text_tokens(prompt[0], cpt), None
        if all(isinstance(p, str) for p in prompt) or all(isinstance(p, list) for p in prompt):
            raise InvalidRequest(
                "batched prompts are not supported: send one prompt per request", param="prompt"
            )
    raise InvalidRequest(
        "'prompt' must be a non-empty string or a non-empty list of token ids", param="prompt"
    )


def _message_text(i: int, content: Any) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                raise InvalidRequest(
                    f"messages[{i}].content[{j}] must be an object with a 'type'",
                    param=f"messages[{i}].content",
                )
            if part["type"] == "text":
                if not isinstance(part.get("text"), str):
                    raise InvalidRequest(
                        f"messages[{i}].content[{j}].text must be a string",
                        param=f"messages[{i}].content",
                    )
                parts.append(part["text"])
        return "".join(parts)
    raise InvalidRequest(
        f"messages[{i}].content must be a string or a list of content parts",
        param=f"messages[{i}].content",
    )


def _prompt_tokens_chat(messages: Any, cpt: float) -> int:
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("'messages' must be a non-empty list", param="messages")
    total = 0.0
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            raise InvalidRequest(f"messages[{i}] must be an object", param="messages")
        if not isinstance(msg.get("role"), str) or not msg["role"]:
            raise InvalidRequest(f"messages[{i}].role must be a non-empty string", param="messages")
        text = _message_text(i, msg.get("content"))
        total += _PER_MESSAGE_TOKENS + (len(text) / cpt)
    return max(1, int(total + 0.999))


def _optional_int(body: dict[str, Any], key: str, minimum: int) -> int | None:
    v = body.get(key)
    if v is None:
        return None
    n = _as_int(v)
    if n is None:
        raise InvalidRequest(f"'{key}' must be an integer, not {type(v).__name__}", param=key)
    if n < minimum:
        raise InvalidRequest(f"'{key}' must be at least {minimum}, got {v!r}", param=key)
    if n > _INT_MAX:
        raise InvalidRequest(f"'{key}' must be at most {_INT_MAX}, got {v!r}", param=key)
    body[key] = n  # 16.0 -> 16 for the workers
    return n


def parse_json_object(raw: bytes) -> dict[str, Any]:
    """The request body as a JSON object, or the 400 that says what is wrong with it (every
    route that takes a body: generation here, the passthrough routes)."""
    if not raw:
        raise InvalidRequest("the request body is empty; expected a JSON object")
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise InvalidRequest(f"the request body is not valid JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    return body


def parse_request(
    path: str,
    raw: bytes,
    *,
    models: tuple[str, ...],
    max_model_len: int | None,
    chars_per_token: float = 4.0,
    max_n: int = DEFAULT_MAX_N,
    tokenizer_for: TokenizerLookup | None = None,
) -> ParsedRequest:
    body = parse_json_object(raw)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise InvalidRequest("'model' is required and must be a string", param="model")
    if model not in models:
        raise ModelNotFound(f"The model `{model}` does not exist.", param="model")

    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise InvalidRequest("'stream' must be a boolean", param="stream")
    stream_options = body.get("stream_options")
    if stream_options is not None:
        if not isinstance(stream_options, dict):
            raise InvalidRequest("'stream_options' must be an object", param="stream_options")
        if not stream:
            raise InvalidRequest(
                "'stream_options' is only allowed when 'stream' is true", param="stream_options"
            )
    include_usage = bool(stream_options and stream_options.get("include_usage"))

    n = _optional_int(body, "n", 1)
    if n is not None and n > max_n:
        raise InvalidRequest(f"'n' must be at most {max_n}, got {n}", param="n")
    for key in ("temperature", "top_p", "presence_penalty", "frequency_penalty"):
        if key in body and body[key] is not None and not _is_number(body[key]):
            raise InvalidRequest(f"'{key}' must be a number", param=key)

    ids: tuple[int, ...] | None = None
    source: PromptTokensSource = "estimate"
    if path == CHAT:
        prompt_tokens = _prompt_tokens_chat(body.get("messages"), chars_per_token)
    else:
        prompt_tokens, ids = _prompt_tokens_completions(body.get("prompt"), chars_per_token)
        source = "token_ids" if ids is not None else source
    tokenizer = tokenizer_for(model) if tokenizer_for is not None and ids is None else None
    if tokenizer is not None:
        ids = tokenizer.chat_ids(body) if path == CHAT else tokenizer.completion_ids(body)
        if ids is not None:
            prompt_tokens, source = max(1, len(ids)), "tokenizer"
    keep = body.get("truncate_prompt_tokens")
    if ids is not None and isinstance(keep, int) and not isinstance(keep, bool) and keep > 0:
        ids = ids[-keep:]  # vLLM keeps the prompt's last `keep` tokens
        prompt_tokens = max(1, len(ids))

    max_tokens = _optional_int(body, "max_tokens", 1)
    max_completion = _optional_int(body, "max_completion_tokens", 1)
    _optional_int(body, "min_tokens", 0)
    cap = max_completion if max_completion is not None else max_tokens
    cap = output_cap(
        max_model_len,
        prompt_tokens,
        cap,
        prompt_param="messages" if path == CHAT else "prompt",
        cap_param="max_completion_tokens" if max_completion is not None else "max_tokens",
    )
    return ParsedRequest(
        path=path,
        body=body,
        model=model,
        stream=stream,
        include_usage=include_usage,
        prompt_tokens=prompt_tokens,
        max_tokens=cap,
        n=n or 1,
        prompt_token_ids=ids,
        prompt_tokens_source=source,
    )


# The reservation's output cap when nothing bounds it (no model length known): conservative.
NO_LIMIT_CAP = 4096


def output_cap(
    max_model_len: int | None,
    prompt_tokens: int,
    cap: int | None,
    *,
    prompt_param: str,
    cap_param: str,
) -> int:
    """The output tokens a request may produce: its own cap, checked against the model's context
    length, or the room the prompt leaves (`NO_LIMIT_CAP` when no length is known)."""
    if max_model_len is None:
        return NO_LIMIT_CAP if cap is None else cap
    room = max_model_len - prompt_tokens
    if room < 1:
        raise InvalidRequest(
            f"This model's maximum context length is {max_model_len} tokens; the "
            f"{'input' if prompt_param == 'input' else 'prompt'} has about {prompt_tokens}.",
            param=prompt_param,
        )
    if cap is not None and cap > room:
        raise InvalidRequest(
            f"'{cap_param}' is too large: {cap}. This model's maximum context length is "
            f"{max_model_len} tokens and the "
            f"{'input' if prompt_param == 'input' else 'prompt'} has about {prompt_tokens}.",
            param=cap_param,
        )
    return room if cap is None else cap
