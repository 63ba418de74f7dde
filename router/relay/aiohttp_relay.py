"""The aiohttp decode-leg relay (`settings.relay: aiohttp`, and https:// workers): `relay_sse`
(the contract both relays keep: router/relay/contract.py).

No per-chunk JSON parsing: each read of aiohttp's body stream goes through the shared SSE
cutter (router/relay/sse_cut.py) and what it gives back is forwarded as read (so a burst the
client is too slow for is coalesced by the socket, not by us); the forwarded pieces are kept so
that a failure can later be told exactly what the client already has (router/request/resume.py
`sent_text`). The splice relay (router/relay/splice.py) keeps the same contract from the upstream
protocol's callbacks.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable

import aiohttp
from aiohttp import web

from router.relay.contract import NO_FIRST_EVENT, RelayObserver, RelayResult, Rewrite
from router.relay.sse_cut import (
    ERROR_EVENT,
    MALFORMED_FIRST_EVENT,
    SseCutter,
    count_tokens,
    malformed,
    split_at_error,
)

__all__ = [
    "RelayObserver",
    "RelayResult",
    "relay_sse",
    "count_tokens",
    "split_at_error",
    "NO_FIRST_EVENT",
    "ERROR_EVENT",
    "MALFORMED_FIRST_EVENT",
    "malformed",
]


async def relay_sse(
    upstream: aiohttp.ClientResponse,
    client: web.StreamResponse,
    *,
    chat: bool,
    responses: bool = False,
    clock: Callable[[], float],
    observer: RelayObserver | None = None,
    first_event_by: float | None = None,
    rewrite: Rewrite | None = None,
) -> RelayResult:
    """Forward `upstream`'s SSE body to `client` until it ends, either side fails, or is cancelled.

    What is forwarded is what `router.relay.sse_cut.SseCutter` gives back; `observer` hears the
    first
    token and the running token count. Deadlines are the caller's: aiohttp's sock_read timeout
    is the idle one, an enclosing asyncio.timeout the TTFT/total one, and `first_event_by`
    (event-loop time) the KV handoff's: a decode worker that has not produced its first event by
    then ends the relay as an upstream error.
    """
    result = RelayResult()
    cutter = SseCutter(chat, responses)
    content = upstream.content
    tokens_due = 0 if observer is not None else sys.maxsize
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
            out = cutter.feed(data)
            if out and rewrite is not None:
                out = rewrite(out)
            if out:
                result.chunks.append(out)
                result.tokens = cutter.tokens
                # Before the write, which may wait for a slow client: the worker's KV grows
                # whatever the client reads, so the reservation follows it now.
                if cutter.tokens > tokens_due and observer is not None:
                    tokens_due = observer.tokens(cutter.tokens)
                try:
                    await client.write(out)
                except (ConnectionError, RuntimeError):
                    # The client went away (aiohttp raises ConnectionResetError, or RuntimeError
                    # once the transport is closed): stop reading so the caller closes upstream.
                    result.client_gone = True
                    return result
                # After the write, as the splice relay does: the client need not wait for it.
                if result.first_token_at is None:
                    result.first_token_at = clock()
                    if observer is not None:
                        observer.first_token()
            if cutter.stop is not None:
                result.upstream_error, result.error_kind = cutter.stop, cutter.stop_kind
                return result
    except aiohttp.ClientPayloadError as exc:
        result.upstream_error = f"decode stream broken: {exc}"
    except aiohttp.ClientConnectionError as exc:
        # Includes the idle deadline (aiohttp's sock_read timeout).
        result.upstream_error = f"decode connection lost: {exc!r}"
    result.completed = cutter.finished
    if not result.completed and result.upstream_error is None:
        result.upstream_error = f"decode stream ended without {cutter.end_name}"
    return result
