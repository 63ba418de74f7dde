"""The lean SSE byte relay: decode worker → client, as bytes arrive.

No per-chunk JSON parsing: chunks are forwarded as read (so a burst the client is too slow for
is coalesced by the socket, not by us), tokens are counted with byte searches, and the raw
chunks are kept so that a failure can later be told exactly what the client already has.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson
from aiohttp import web

__all__ = ["RelayResult", "relay_sse", "count_tokens", "parse_sent_text"]

_DONE = b"data: [DONE]"


@dataclass(slots=True)
class RelayResult:
    tokens: int = 0
    completed: bool = False  # saw `data: [DONE]`
    client_gone: bool = False
    upstream_error: str | None = None  # the worker cut the stream or read failed
    first_token_at: float | None = None
    chunks: list[bytes] = field(default_factory=list)

    def __repr__(self) -> str:
        return (
            f"RelayResult(tokens={self.tokens}, completed={self.completed}, "
            f"client_gone={self.client_gone}, upstream_error={self.upstream_error!r})"
        )


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
) -> RelayResult:
    """Forward `upstream`'s SSE body to `client` until it ends, either side fails, or is cancelled.

    `on_first_token()` runs once, synchronously, when the first chunk arrives (the decode worker
    has accepted the KV); `on_tokens(total)` after each forwarded piece. Deadlines are the
    caller's: aiohttp's sock_read timeout is the idle one, an enclosing asyncio.timeout the
    TTFT/total one.
    """
    result = RelayResult()
    tail = b""
    pending = b""  # the start of an event whose end has not arrived yet
    try:
        async for data in upstream.content.iter_any():
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
