"""The decode leg as a splice: worker bytes → client transport from the protocol callback.

`settings.relay == "splice"` sends the decode leg through the raw HTTP/1.1 client of
router/relay/upstream_pool.py instead of aiohttp's. While a stream is relayed, each body piece the
upstream connection reads goes, in its `data_received`, through the shared SSE cutter
(router/relay/sse_cut.py) and, re-framed as one chunk, straight onto the client's transport that
aiohttp prepared (router/relay/aiohttp_private.py `prepared_writer`): no task wake-up per read.

Back-pressure: above HIGH_WATER queued towards the client, the worker's connection stops
being read until the client has drained it (TCP holds the rest at the worker).
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable

from aiohttp import web

from router.relay.aiohttp_private import Drains, prepared_writer
from router.relay.contract import NO_FIRST_EVENT, RelayObserver, RelayResult, Rewrite
from router.relay.sse_cut import SseCutter
from router.relay.upstream_pool import (
    HIGH_WATER,
    SpliceDisconnected,
    SpliceError,
    SpliceResponse,
    UpstreamConn,
)

__all__ = ["relay_splice"]


class _Splice:
    """One relayed stream: the upstream connection's sink and watchdog check."""

    __slots__ = (
        "conn",
        "writer",
        "transport",
        "result",
        "cutter",
        "clock",
        "observer",
        "drainer",
        "tokens_due",
        "rewrite",
    )

    def __init__(
        self,
        conn: UpstreamConn,
        writer: Drains,
        transport: asyncio.Transport,
        cutter: SseCutter,
        clock: Callable[[], float],
        observer: RelayObserver | None,
        rewrite: Rewrite | None = None,
    ) -> None:
        self.conn, self.writer, self.transport = conn, writer, transport
        self.rewrite = rewrite
        self.result = RelayResult()
        self.cutter, self.clock, self.observer = cutter, clock, observer
        self.drainer: asyncio.Task[None] | None = None
        # The token total above which the observer wants to hear next (RelayObserver.tokens).
        self.tokens_due = 0 if observer is not None else sys.maxsize

    def sink(self, data: bytes, framed: bytes | None = None) -> None:
        """A body piece from the worker (called from its protocol's `data_received`).

        `framed` is the read it came in when that read was exactly this one chunk: if the
        cutter forwards the piece whole, the worker's chunk is already the client's chunk
        and goes out as it came (no re-framing copy). This runs once per token: every line
        here is paid ~10k times a second at 256 streams (docs/benchmarks-overhead.md)."""
        cutter = self.cutter
        out = cutter.feed(data)
        if out and self.rewrite is not None:
            out = self.rewrite(out)  # the same bytes back when it changed nothing
        if out:
            transport = self.transport
            if transport.is_closing():
                self.gone()
                return
            if out is data and framed is not None:
                transport.write(framed)
            else:
                transport.write(b"%x\r\n%s\r\n" % (len(out), out))
            result = self.result
            result.chunks.append(out)
            # The bookkeeping after the write: the first token's (TTFT, the KV handed over, the
            # deadline moved on) is ~0.1 ms of Python the client need not wait for.
            if result.first_token_at is None:
                result.first_token_at = self.clock()
                if self.observer is not None:
                    self.observer.first_token()
            if cutter.tokens > self.tokens_due and self.observer is not None:
                self.tokens_due = self.observer.tokens(cutter.tokens)
            if self.drainer is None and transport.get_write_buffer_size() > HIGH_WATER:
                self.conn.pause()
                self.drainer = asyncio.get_running_loop().create_task(self.drain())
        if cutter.stop is not None:
            self.result.upstream_error, self.result.error_kind = cutter.stop, cutter.stop_kind
            self.conn.fail(SpliceDisconnected(cutter.stop))

    def gone(self) -> None:
        self.result.client_gone = True
        self.conn.fail(SpliceDisconnected("the client went away"))

    def check_client(self) -> None:  # the watchdog's tick: a vanished client, a silent worker
        if self.transport.is_closing():
            self.gone()

    async def drain(self) -> None:
        transport = self.transport
        try:
            while transport.get_write_buffer_size() > HIGH_WATER // 4:
                if transport.is_closing():
                    break
                await self.writer.drain()
                if transport.get_write_buffer_size() > HIGH_WATER // 4:
                    await asyncio.sleep(0.005)  # above low water but not paused: look again
        except (ConnectionError, RuntimeError):
            pass
        self.drainer = None
        if transport.is_closing():
            self.gone()
        else:
            self.conn.resume()

    def no_first_event(self) -> None:
        result = self.result
        if result.first_token_at is None and result.upstream_error is None:
            result.upstream_error, result.error_kind = NO_FIRST_EVENT, "kv_handoff_timeout"
            self.conn.fail(SpliceDisconnected("no first event before the KV handoff deadline"))


async def relay_splice(
    resp: SpliceResponse,
    client: web.StreamResponse,
    *,
    chat: bool,
    responses: bool = False,
    clock: Callable[[], float],
    observer: RelayObserver | None = None,
    first_event_by: float | None = None,
    rewrite: Rewrite | None = None,
) -> RelayResult:
    """`router.relay.aiohttp_relay.relay_sse`'s contract, done from the upstream protocol's
    callbacks.

    The client's chunked framing is written here, on the transport aiohttp prepared (headers
    sent), so `client.write_eof()` still ends the body correctly.
    """
    conn = resp._conn
    assert conn.done is not None
    done = conn.done
    try:
        writer, transport = prepared_writer(client)
    except ConnectionResetError:
        return RelayResult(client_gone=True)
    transport.set_write_buffer_limits(high=HIGH_WATER)
    splice = _Splice(conn, writer, transport, SseCutter(chat, responses), clock, observer, rewrite)
    result = splice.result
    loop = asyncio.get_running_loop()
    deadline = (
        loop.call_at(first_event_by, splice.no_first_event) if first_event_by is not None else None
    )
    try:
        if conn.body:  # arrived between the head and now
            early = bytes(conn.body)
            conn.body.clear()
            splice.sink(early)
        if not done.done():
            conn.sink, conn.on_tick = splice.sink, splice.check_client
            if splice.drainer is None:
                conn.resume()  # paused while nobody read it (see UpstreamConn.body)
        await done
    except SpliceError as exc:
        if not result.client_gone and result.upstream_error is None:
            result.upstream_error = str(exc)
    except BaseException:
        conn.fail(SpliceDisconnected("relay cancelled"))  # vLLM's abort signal
        raise
    finally:
        result.tokens = splice.cutter.tokens  # counted by the cutter, read once here
        if deadline is not None:
            deadline.cancel()
        conn.sink = conn.on_tick = None
        if splice.drainer is not None:
            splice.drainer.cancel()
    if result.client_gone:
        return result
    result.completed = splice.cutter.finished
    if not result.completed and result.upstream_error is None:
        result.upstream_error = f"decode stream ended without {splice.cutter.end_name}"
    return result
