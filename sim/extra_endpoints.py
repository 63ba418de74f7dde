"""The simulated worker's endpoints beyond generation: what the router passes through as is.

    POST /v1/embeddings   a unit vector per input, a seeded function of the input (deterministic)
    POST /tokenize        vLLM's tokenizer endpoint (vllm-router calls it): 4 characters a token,
                          the rule of the rest of the sim; ids are a stable hash of each piece
    POST /detokenize      token ids -> text (ids name vocabulary words; not the inverse of
                          /tokenize, whose ids are hashes)
    POST /v1/responses    OpenAI's Responses API, stateless: the sim's greedy answer to the input
                          as one `response` object, or the Responses SSE events when streaming

vLLM serves these on every worker; the sim's prefill role refuses /v1/responses the way it
refuses a generation request without `do_remote_decode` (it only runs the first phase). Bodies
are validated as vLLM's request models would (a wrong type is a 400, never a 500). Every
request is recorded in `GET /sim/requests` like a generation request, so tests can check what
arrived.
"""

from __future__ import annotations

import base64
import math
import random
import struct
import time
import uuid
import zlib
from typing import Any

import orjson
from aiohttp import web

from . import textgen
from .faults import error_response
from .generation import json_response
from .worker_state import WORKER, Worker

__all__ = ["add_extra_routes", "embedding_of"]

DEFAULT_DIMENSIONS = 16
MAX_OUTPUT_TOKENS = 4096


def add_extra_routes(app: web.Application) -> None:
    app.router.add_post("/v1/embeddings", _handle_embeddings)
    app.router.add_post("/tokenize", _handle_tokenize)
    app.router.add_post("/detokenize", _handle_detokenize)
    app.router.add_post("/v1/responses", _handle_responses)


def embedding_of(item: str | list[int], dimensions: int = DEFAULT_DIMENSIONS) -> list[float]:
    """A unit vector seeded by the input: the same input always gets the same embedding."""
    seed = zlib.crc32(item.encode() if isinstance(item, str) else orjson.dumps(item))
    rng = random.Random(seed)
    vec = [rng.gauss(0.0, 1.0) for _ in range(dimensions)]
    norm = math.sqrt(sum(v * v for v in vec)) or 1.0
    return [v / norm for v in vec]


async def _recorded_body(request: web.Request) -> tuple[Worker, Any]:
    worker = request.app[WORKER]
    try:
        body = orjson.loads(await request.read())
    except orjson.JSONDecodeError:
        body = None
    headers = {str(k): v for k, v in request.headers.items()}
    worker.recent.append({"path": request.path, "headers": headers, "body": body})
    return worker, body


def _model_error(worker: Worker, body: dict[str, Any]) -> web.Response | None:
    """An injected error fault (`POST /sim/faults`, as for generation), or the 404 of a model
    this worker does not serve."""
    injected = worker.faults.roll_error()
    if injected is not None:
        worker.metrics.inc("faults", label=f"error_{injected}")
        if injected == "malformed":
            return web.Response(status=200, body=b'{"object": "list", "data": [')
        assert isinstance(injected, int)
        return error_response(injected, f"injected fault: error {injected}")
    model = body.get("model")
    if model is not None and model != worker.config.model_name:
        return error_response(404, f"The model `{model}` does not exist.", "model")
    return None


def _is_id(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _bad_messages(messages: Any) -> str | None:
    """Why `messages` is not a list of chat messages (role, content: null, text or parts)."""
    if not isinstance(messages, list) or not messages:
        return "'messages' must be a non-empty list"
    for msg in messages:
        if not isinstance(msg, dict) or not isinstance(msg.get("role"), str) or not msg["role"]:
            return "each message needs a non-empty string 'role'"
        content = msg.get("content")
        if content is None or isinstance(content, str):
            continue
        if not isinstance(content, list):
            return "message content must be null, a string or a list of parts"
        for part in content:
            if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                return "each content part needs a string 'type'"
            if part["type"] == "text" and not isinstance(part.get("text"), str):
                return "a text content part needs a string 'text'"
    return None


async def _handle_tokenize(request: web.Request) -> web.Response:
    worker, body = await _recorded_body(request)
    if not isinstance(body, dict):
        return error_response(400, "the request body must be a JSON object")
    if (refusal := _model_error(worker, body)) is not None:
        return refusal
    # Every field present is checked, whichever is used: a bad one is a 400 either way.
    if "prompt" in body and not isinstance(body["prompt"], str):
        return error_response(400, "'prompt' must be a string", "prompt")
    if "messages" in body and (why := _bad_messages(body["messages"])) is not None:
        return error_response(400, why, "messages")
    if "prompt" in body:
        text = body["prompt"]
    elif "messages" in body:
        text = str(body["messages"])
    else:
        return error_response(400, "tokenize needs 'prompt' or 'messages'")
    special = body.get("add_special_tokens", True)
    if not isinstance(special, bool):
        return error_response(400, "'add_special_tokens' must be a boolean", "add_special_tokens")
    ids = [zlib.crc32(text[i : i + 4].encode()) % 32_000 for i in range(0, len(text), 4)] or [0]
    return json_response({"count": len(ids), "max_model_len": worker.max_model_len, "tokens": ids})


def _inputs(value: Any) -> list[str | list[int]] | None:
    """OpenAI's `input`: a string, a list of strings, a list of ids or a list of id lists."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value:
        if all(isinstance(v, str) for v in value):
            return list(value)
        if all(_is_id(v) for v in value):
            return [list(value)]
        if all(isinstance(v, list) and all(_is_id(t) for t in v) for v in value):
            return [list(v) for v in value]
    return None


async def _handle_embeddings(request: web.Request) -> web.Response:
    worker, body = await _recorded_body(request)
    if not isinstance(body, dict):
        return error_response(400, "the request body must be a JSON object")
    if (refusal := _model_error(worker, body)) is not None:
        return refusal
    items = _inputs(body.get("input"))
    if items is None:
        return error_response(400, "'input' must be a string or a list", "input")
    dims = body.get("dimensions", DEFAULT_DIMENSIONS)
    if not isinstance(dims, int) or isinstance(dims, bool) or not 1 <= dims <= 4096:
        return error_response(400, "'dimensions' must be an integer in 1..4096", "dimensions")
    encoding = body.get("encoding_format", "float")
    if encoding not in ("float", "base64"):
        return error_response(400, "'encoding_format' must be float or base64", "encoding_format")
    as_base64 = encoding == "base64"  # the openai client's default
    data = []
    tokens = 0
    for i, item in enumerate(items):
        vec = embedding_of(item, dims)
        tokens += (
            len(item)
            if isinstance(item, list)
            else textgen.count_prompt_tokens(textgen.COMPLETIONS_PATH, {"prompt": item})
        )
        encoded: Any = (
            base64.b64encode(struct.pack(f"<{dims}f", *vec)).decode() if as_base64 else vec
        )
        data.append({"object": "embedding", "index": i, "embedding": encoded})
    return json_response(
        {
            "id": f"embd-{uuid.uuid4().hex}",
            "object": "list",
            "created": int(time.time()),
            "model": worker.config.model_name,
            "data": data,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0},
        }
    )


async def _handle_detokenize(request: web.Request) -> web.Response:
    worker, body = await _recorded_body(request)
    if not isinstance(body, dict):
        return error_response(400, "the request body must be a JSON object")
    if (refusal := _model_error(worker, body)) is not None:
        return refusal
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(_is_id(t) for t in tokens):
        return error_response(400, "'tokens' must be a list of token ids", "tokens")
    vocab = textgen.VOCAB
    return json_response({"prompt": "".join(" " + vocab[t % len(vocab)] for t in tokens)})


# --- /v1/responses ------------------------------------------------------------------------


def _responses_context(body: dict[str, Any]) -> str | None:
    """The input as chat messages (instructions first), as vLLM renders it for the model;
    None if it is not a string or a list of messages."""
    raw = body.get("input")
    messages: list[Any] = []
    if isinstance(body.get("instructions"), str):
        messages.append({"role": "system", "content": body["instructions"]})
    if isinstance(raw, str):
        messages.append({"role": "user", "content": raw})
    elif isinstance(raw, list) and _bad_messages(raw) is None:
        messages.extend(raw)
    else:
        return None
    return textgen.prompt_context(textgen.CHAT_PATH, {"messages": messages})


def _response_object(
    body: dict[str, Any], rid: str, model: str, status: str, text: str | None, usage: Any
) -> dict[str, Any]:
    output = []
    if text is not None:
        output.append(
            {
                "id": f"msg_{rid}",
                "type": "message",
                "role": "assistant",
                "status": "completed",
                "content": [
                    {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
                ],
            }
        )
    return {
        "id": f"resp_{rid}",
        "object": "response",
        "created_at": int(time.time()),
        "model": model,
        "status": status,
        "output": output,
        "instructions": body.get("instructions"),
        "max_output_tokens": body.get("max_output_tokens"),
        "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "previous_response_id": None,
        "temperature": body.get("temperature", 1.0),
        "top_p": body.get("top_p", 1.0),
        "tool_choice": body.get("tool_choice", "auto"),
        "tools": body.get("tools", []),
        "text": body.get("text"),
        "store": body.get("store", True),
        "background": False,
        "truncation": "disabled",
        "usage": usage,
        "incomplete_details": None,
        "metadata": body.get("metadata"),
        "error": None,
    }


def _sse_event(event: dict[str, Any]) -> bytes:
    return b"event: " + event["type"].encode() + b"\ndata: " + orjson.dumps(event) + b"\n\n"


async def _handle_responses(request: web.Request) -> web.StreamResponse:
    worker, body = await _recorded_body(request)
    if not isinstance(body, dict):
        return error_response(400, "the request body must be a JSON object")
    if (refusal := _model_error(worker, body)) is not None:
        return refusal
    if worker.config.role == "prefill":
        return error_response(400, "this is a prefill worker: it runs only the prefill phase")
    if body.get("instructions") is not None and not isinstance(body["instructions"], str):
        return error_response(400, "'instructions' must be a string", "instructions")
    context = _responses_context(body)
    if context is None:
        return error_response(400, "'input' must be a string or a list of messages", "input")
    cap = body.get("max_output_tokens")
    cap = 16 if cap is None else cap
    if not isinstance(cap, int) or isinstance(cap, bool) or not 1 <= cap <= MAX_OUTPUT_TOKENS:
        return error_response(
            400, f"'max_output_tokens' must be an integer in 1..{MAX_OUTPUT_TOKENS}"
        )
    tokens, finish = textgen.generate(context, cap, worker.config.mean_output_tokens)
    prompt_tokens = max(1, len(context) // textgen.CHARS_PER_TOKEN)
    usage = {
        "input_tokens": prompt_tokens,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": len(tokens),
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt_tokens + len(tokens),
    }
    rid = request.headers.get("X-Request-Id") or uuid.uuid4().hex
    model = worker.config.model_name
    status = "completed" if finish == "stop" else "incomplete"
    text = "".join(tokens)
    if body.get("stream") is not True:
        return json_response(_response_object(body, rid, model, status, text, usage))
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    seq = 0

    async def emit(event: dict[str, Any]) -> None:
        nonlocal seq
        event["sequence_number"] = seq
        seq += 1
        await resp.write(_sse_event(event))

    start = _response_object(body, rid, model, "in_progress", None, None)
    await emit({"type": "response.created", "response": start})
    die_after = worker.faults.die_after_tokens()  # a dying GPU process, as for generation
    for i, tok in enumerate(tokens):
        if die_after is not None and i >= die_after:
            worker.metrics.inc("faults", label="decode_die_after_tokens")
            if request.transport is not None:
                request.transport.abort()
            return resp
        await emit(
            {
                "type": "response.output_text.delta",
                "item_id": f"msg_{rid}",
                "output_index": 0,
                "content_index": 0,
                "delta": tok,
                "logprobs": [],
            }
        )
    done = _response_object(body, rid, model, status, text, usage)
    await emit({"type": "response.completed", "response": done})
    await resp.write_eof()
    return resp
