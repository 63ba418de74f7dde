"""A broken worker's answers: 200s that are not answers, and streams that go silent.

The worker's `/health` stays fine throughout: these are the failures only a real request shows
(a wedged engine behind a live API server, a proxy's error page, a corrupted buffer). Each
shape of `disagg_tools.sim.faults.GARBAGE_SHAPES` has a whole rendering (the prefill leg, or an
answer
asked whole) and a streamed one. The shapes that break mid-body first send the answer's own
first tokens (from `disagg_tools.sim.textgen`, without running the engine), so a router that
resumes the
stream elsewhere must still give the client the exact text.
"""

from __future__ import annotations

import asyncio
import itertools

import orjson
from aiohttp import web

from . import textgen
from .openai_format import DONE, AnswerFormat

__all__ = ["garbage_response", "silent_after_tokens"]

_HTML = b"<html><head><title>502 Bad Gateway</title></head><body>nginx</body></html>\n"
_WRONG_SHAPE = b'{"status": "ok"}'
_PLAIN = b"upstream connect error or disconnect/reset before headers\n\n"
_JUNK_EVENTS = b'data: {"choices": [{"delta": \n\ndata: \xff\xfe\x00\n\n'
_BREAK_AFTER_S = 0.02
_SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}


async def garbage_response(
    request: web.Request, shape: str, fmt: AnswerFormat, spec: textgen.AnswerSpec, after: int
) -> web.StreamResponse:
    """The 200 of `shape` for this request: streamed when the request asked for a stream."""
    if fmt.stream:
        return await _streamed(request, shape, fmt, spec, after)
    return await _whole(request, shape, fmt, spec)


async def silent_after_tokens(
    request: web.Request, fmt: AnswerFormat, spec: textgen.AnswerSpec, after: int
) -> web.StreamResponse:
    """The first `after` tokens (none for an answer asked whole), then nothing: the connection
    stays open until the client goes away (a wedged engine, an API server still alive)."""
    if fmt.stream:
        resp = web.StreamResponse(headers=_SSE_HEADERS)
        await resp.prepare(request)
        await resp.write(_first_events(fmt, spec, after))
    await asyncio.Event().wait()  # cancelled when the client disconnects
    raise AssertionError("unreachable")  # pragma: no cover


def _first_events(fmt: AnswerFormat, spec: textgen.AnswerSpec, after: int) -> bytes:
    """The stream's opening and its first `after` tokens (fewer if the answer ends sooner: the
    last token, with its finish, is never sent, so the stream is never complete)."""
    out = fmt.role_event()
    sent = 0
    for tok, finish in itertools.islice(spec.tokens(), after):
        if finish is not None:
            break
        sent += 1
        out += fmt.events(tok, None, sent)
    return out


async def _whole(
    request: web.Request, shape: str, fmt: AnswerFormat, spec: textgen.AnswerSpec
) -> web.StreamResponse:
    if shape == "not_json":
        return web.Response(status=200, body=_HTML, content_type="text/html")
    if shape == "wrong_shape":
        return web.Response(status=200, body=_WRONG_SHAPE, content_type="application/json")
    if shape == "no_framing":
        return web.Response(status=200, body=_PLAIN, content_type="text/plain")
    tok, finish = next(spec.tokens())
    answer = fmt.full(tok, finish or "length", 1)  # kv_transfer_params: null
    body = orjson.dumps(answer)
    if shape == "no_kv_params":
        return web.Response(status=200, body=body, content_type="application/json")
    if shape == "junk_after_tokens":
        return web.Response(status=200, body=body + _JUNK_EVENTS, content_type="application/json")
    # truncated: half the body in one chunk, then the connection drops (no terminating chunk)
    resp = web.StreamResponse(headers={"Content-Type": "application/json"})
    await resp.prepare(request)
    await resp.write(body[: len(body) // 2])
    return _abort(request, resp)


async def _streamed(
    request: web.Request, shape: str, fmt: AnswerFormat, spec: textgen.AnswerSpec, after: int
) -> web.StreamResponse:
    if shape == "no_kv_params":  # pragma: no cover - FaultState.garbage_for: prefill only
        raise ValueError("no_kv_params is a prefill answer's shape")
    resp = web.StreamResponse(headers=_SSE_HEADERS)
    await resp.prepare(request)
    if shape == "not_json":
        await resp.write(b"data: " + _HTML + b"\n" + DONE)
    elif shape == "wrong_shape":
        await resp.write(b"data: " + _WRONG_SHAPE + b"\n\n" + DONE)
    elif shape == "no_framing":
        await resp.write(_PLAIN)
    elif shape == "junk_after_tokens":
        await _first_then(resp, _first_events(fmt, spec, after), _JUNK_EVENTS + DONE)
    else:  # truncated: the first tokens, half of the next event, then the connection drops
        start = _first_events(fmt, spec, after)
        await _first_then(resp, start, b'data: {"id": "' + fmt.id.encode() + b'", "choi')
        return _abort(request, resp)
    await resp.write_eof()
    return resp


async def _first_then(resp: web.StreamResponse, first: bytes, then: bytes) -> None:
    """`first`, then `then` a moment later: the reader sees the break after the good tokens
    reached it (not both in one read, where nothing would have reached the client yet)."""
    await resp.write(first)
    await asyncio.sleep(_BREAK_AFTER_S)
    await resp.write(then)


def _abort(request: web.Request, resp: web.StreamResponse) -> web.StreamResponse:
    """Drop the connection mid-body, as a dying process would (aiohttp's attempt to finish the
    response then meets the closed transport and is dropped)."""
    if request.transport is not None:
        request.transport.abort()
    return resp
