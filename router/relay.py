"""The lean SSE byte relay: decode worker → client, as bytes arrive.

No per-chunk JSON parsing: chunks are forwarded as read (so a burst the client is too slow for
is coalesced by the socket, not by us), tokens are counted with byte searches, and the raw
chunks are kept so that a failure can later be told exactly what the client already has.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from router.adapters.errors import WorkerError, sse_data, stream_error

__all__ = [
    "RelayResult",
    "relay_sse",
    "count_tokens",
    "parse_sent_text",
    "split_at_error",
    "NO_FIRST_EVENT",
    "ERROR_EVENT",
    "MALFORMED_FIRST_EVENT",
    "malformed",
]

_DONE = b"data: [DONE]"


@dataclass(slots=True)
class RelayResult:
    tokens: int = 0
    completed: bool = False  # saw `data: [DONE]`
    client_gone: bool = False
    upstream_error: str | None = None  # the worker cut the stream, read failed or sent an error
    # Which failure, for the metrics: "kv_handoff_timeout", "error_event"; None = a cut stream.
    error_kind: str | None = None
    first_token_at: float | None = None
    chunks: list[bytes] = field(default_factory=list)

    def __repr__(self) -> str:
        return (
            f"RelayResult(tokens={self.tokens}, completed={self.completed}, "
            f"client_gone={self.client_gone}, upstream_error={self.upstream_error!r})"
        )


NO_FIRST_EVENT = "no first token before the KV handoff deadline (the KV is presumed lost)"
ERROR_EVENT = "decode worker reported an error mid-stream"
MALFORMED_FIRST_EVENT = "decode worker's first event is not a JSON object"


def malformed(data: bytes) -> bool:
    """True if a data line of these whole events is not a JSON object (`[DONE]` and comments
    aside). Run on the first forwarded piece only: a worker that answers 200 with garbage does
    so from the start (a broken engine, a proxy's error page), and nothing has reached the
    client then, so the request is retried; parsing every event would cost CPU per token."""
    for line in data.split(b"\n"):
        payload = sse_data(line)
        if payload is None or payload == b"[DONE]":
            continue
        try:
            if not isinstance(orjson.loads(payload), dict):
                return True
        except orjson.JSONDecodeError:
            return True
    return False


def split_at_error(data: bytes) -> tuple[bytes, WorkerError | None]:
    """Whole events `data` → (the part before a retryable error event, that error).

    vLLM answers 200 and then reports a failed generation — a KV pull that failed, an engine
    error — as `data: {"error": {..., "code": 500}}` followed by `[DONE]`. Forwarded as is, the
    client would get a broken answer that a retry could have saved; so a server-side error
    (5xx, or no code at all) ends the relay here and the caller retries or resumes. A 4xx in the
    stream is the worker's verdict on the request itself and is passed through.
    """
    if b'"error"' not in data:  # the cheap check: this runs once per forwarded chunk
        return data, None
    start = 0
    while start < len(data):
        end = data.find(b"\n\n", start)
        end = len(data) if end < 0 else end + 2
        for line in data[start:end].split(b"\n"):
            payload = sse_data(line)
            err = stream_error(payload) if payload is not None else None
            if err is not None and not (err.status is not None and 400 <= err.status < 500):
                return data[:start], err
        start = end
    return data, None


def count_tokens(data: bytes, chat: bool) -> int:
    """Token chunks in `data`: one non-empty `content` (chat) or `text` (completions) per token."""
    if chat:
        return data.count(b'"content":"') - data.count(b'"content":""')
    return data.count(b'"text":"') - data.count(b'"text":""')


async def relay_sse(
    upstream: aiohttp.ClientResponse,
    client: web.StreamResponse,
    *,
    chat: bool,
    clock: Any,
    on_first_token: Any = None,
    on_tokens: Any = None,
    first_event_by: float | None = None,
) -> RelayResult:
    """Forward `upstream`'s SSE body to `client` until it ends, either side fails, or is cancelled.

    `on_first_token()` runs once, synchronously, when the first chunk arrives (the decode worker
    has accepted the KV); `on_tokens(total)` after each forwarded piece. Deadlines are the
    caller's: aiohttp's sock_read timeout is the idle one, an enclosing asyncio.timeout the
    TTFT/total one, and `first_event_by` (event-loop time) the KV handoff's: a decode worker
    that has not produced its first event by then ends the relay as an upstream error.
    """
    result = RelayResult()
    tail = b""
    pending = b""  # the start of an event whose end has not arrived yet
    content = upstream.content
    try:
        while True:
            if result.first_token_at is None and first_event_by is not None:
                window = asyncio.timeout_at(first_event_by)
                try:
                    async with window:
                        data = await content.readany()
                except TimeoutError:
                    if not window.expired():
                        raise  # aiohttp's own (idle) timeout: handled below
                    result.upstream_error, result.error_kind = NO_FIRST_EVENT, "kv_handoff_timeout"
                    return result
            else:
                data = await content.readany()
            if not data:
                break
            if pending:
                data = pending + data
                pending = b""
            # Forward whole events only: if the worker dies mid-event, the client must not hold
            # half an event that the next (resumed) stream's bytes would corrupt.
            if not data.endswith(b"\n\n"):
                end = data.rfind(b"\n\n")
                if end < 0:  # not one whole event yet: hold it all
                    pending = data
                    continue
                data, pending = data[: end + 2], data[end + 2 :]
            data, error = split_at_error(data)
            if data and result.first_token_at is None and malformed(data):
                result.upstream_error, result.error_kind = MALFORMED_FIRST_EVENT, "malformed"
                return result
            if data:
                if result.first_token_at is None:
                    result.first_token_at = clock()
                    if on_first_token is not None:
                        on_first_token()
                result.chunks.append(data)
                result.tokens += count_tokens(data, chat)
                if on_tokens is not None:
                    on_tokens(result.tokens)
                try:
                    await client.write(data)
                except (ConnectionError, RuntimeError):
                    # The client went away (aiohttp raises ConnectionResetError, or RuntimeError
                    # once the transport is closed): stop reading so the caller closes upstream.
                    result.client_gone = True
                    return result
                # The last bytes seen, to tell a finished stream (`[DONE]`) from a cut one.
                tail = data[-32:] if len(data) >= 32 else (tail + data)[-32:]
            if error is not None:
                result.upstream_error = f"{ERROR_EVENT}: {error.message}"
                result.error_kind = "error_event"
                return result
    except aiohttp.ClientPayloadError as exc:
        result.upstream_error = f"decode stream broken: {exc}"
    except aiohttp.ClientConnectionError as exc:
        # Includes the idle deadline (aiohttp's sock_read timeout).
        result.upstream_error = f"decode connection lost: {exc!r}"
    result.completed = _DONE in tail
    if not result.completed and result.upstream_error is None:
        result.upstream_error = "decode stream ended without [DONE]"
    return result


def parse_sent_text(chunks: list[bytes], chat: bool) -> tuple[str, int]:
    """The answer text and token count the client has received, from the relayed raw chunks.

    Only whole events count: a trailing partial event never reached the client as a token (the
    client's SSE parser drops it), so it is not part of what was sent.
    """
    raw = b"".join(chunks)
    events = raw.split(b"\n\n")
    if not raw.endswith(b"\n\n"):
        events = events[:-1]
    parts: list[str] = []
    tokens = 0
    for event in events:
        for line in event.split(b"\n"):
            if not line.startswith(b"data: ") or line == _DONE:
                continue
            try:
                obj = orjson.loads(line[6:])
            except orjson.JSONDecodeError:
                continue
            for choice in obj.get("choices") or ():
                piece = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
                if piece:
                    parts.append(piece)
                    tokens += 1
    return "".join(parts), tokens
