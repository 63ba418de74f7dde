"""The splice relay's upstream side: keep-alive HTTP/1.1 connections to the workers (the decode
legs, and the prefill legs' whole answers: router/request/legs.py `_post_whole`).

Per worker `(host, port)` a pool of `asyncio.Protocol` connections (`TCP_NODELAY`), at most
one request in flight on each. `data_received` hands the bytes to a `ResponseReader`
(router/relay/http_reader.py) and passes the body pieces it yields to the attached sink — the splice
relay's (router/relay/splice.py) — from the protocol callback itself: no StreamReader, no future and
no task wake-up per read (docs/history/benchmarks-overhead.md, proposals 1 and 2). The relaying
coroutine only awaits "the answer is over". Until a sink attaches, body bytes are kept
(`body`), at most ~HIGH_WATER of them before reading pauses, unless `read()` wants them whole.

Deadlines: one coarse watchdog timer per request in flight ticks every `min(idle_s / 4, 1 s)`;
it ends the leg when no byte has come for `idle_s` (never earlier, at most one tick later), and
runs the relay's client check (`on_tick`) so that a client that went away while the worker is
silent is noticed. The TTFT / total deadlines stay the caller's `asyncio.timeout_at`.

Closing an unfinished answer drops its connection (vLLM's abort signal); a fully read answer
gives its connection back to the pool.

Errors (all `aiohttp.ClientConnectionError`, so the callers' `except aiohttp.ClientError`
turns them into retryable leg failures exactly as with aiohttp's client):

    SpliceError
     ├── SpliceConnectError    the connect failed or took longer than connect_s
     ├── SpliceIdleTimeout     no byte from the worker for idle_s
     ├── SpliceDisconnected    the connection closed before the answer was whole
     └── SpliceProtocolError   the worker's bytes are not HTTP/1.1 as we read it
"""

from __future__ import annotations

import asyncio
import re
import socket
from collections import deque
from collections.abc import Callable
from typing import Final, cast
from urllib.parse import urlsplit

import aiohttp

from router.relay.http_reader import (
    END,
    Event,
    Head,
    HttpReadError,
    IncompleteResponse,
    ResponseReader,
)

__all__ = [
    "HIGH_WATER",
    "SpliceError",
    "SpliceConnectError",
    "SpliceIdleTimeout",
    "SpliceDisconnected",
    "SpliceProtocolError",
    "SplicePool",
    "SpliceResponse",
    "UpstreamConn",
]

# Above this many bytes held (no sink yet) or queued towards the client, stop reading the worker.
HIGH_WATER: Final = 64 * 1024
_MAX_TICK_S: Final = 1.0

# Connection states.
_IDLE, _BUSY, _DONE, _FAILED = range(4)


class SpliceError(aiohttp.ClientConnectionError):
    """Base of the splice client's failures (see the tree in the module docstring)."""


class SpliceConnectError(SpliceError):
    pass


class SpliceIdleTimeout(SpliceError):
    pass


class SpliceDisconnected(SpliceError):
    pass


class SpliceProtocolError(SpliceError):
    pass


class UpstreamConn(asyncio.Protocol):
    """One keep-alive connection to a worker; at most one request in flight."""

    def __init__(self, pool: SplicePool, key: tuple[str, int]) -> None:
        self.pool, self.key = pool, key
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.reader = ResponseReader()
        self.state = _IDLE
        self.status = 0
        self.head: asyncio.Future[None] | None = None
        self.done: asyncio.Future[None] | None = None
        self.body = bytearray()  # what arrived while no sink was attached
        self.whole = False  # read() is collecting the whole body
        # The relay's: (body piece, the read itself when it was exactly that one chunk).
        self.sink: Callable[[bytes, bytes | None], None] | None = None
        self.on_tick: Callable[[], None] | None = None  # the relay's client check
        self.idle_s = 0.0
        self.seen = False  # a byte came since the last tick
        self.last = 0.0  # the tick that last saw a byte
        self.timer: asyncio.TimerHandle | None = None
        self.paused = False
        self.pauses = 0  # back-pressure episodes (tests, repr)
        self.requests = 0

    def __repr__(self) -> str:
        return (
            f"UpstreamConn({self.key[0]}:{self.key[1]}, state={self.state}, "
            f"status={self.status}, requests={self.requests}, pauses={self.pauses}, "
            f"open={self.transport is not None})"
        )

    # -- asyncio.Protocol ---------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses, but they are one.
        self.transport = cast(asyncio.Transport, transport)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self.pool._forget(self)
        if self.state == _BUSY:
            try:
                self._handle(self.reader.feed_eof())
            except IncompleteResponse as lost:
                self._fail(SpliceDisconnected(f"decode connection lost: {exc!r} ({lost})"))

    def pause_writing(self) -> None:  # our request is small; nothing to do
        pass

    def resume_writing(self) -> None:
        pass

    def data_received(self, data: bytes) -> None:
        self.seen = True
        sink = self.sink  # set only while a request is in flight (_BUSY)
        if sink is not None:
            # The per-token case first: one read = one whole chunk, handed on with the read
            # itself (the client's chunk, if the relay forwards it whole), no event list.
            piece = self.reader.one_chunk(data)
            if piece is not None:
                try:
                    sink(piece, data)
                except BaseException as exc:  # as below: the relaying coroutine raises it
                    self._fail(exc)
                return
        if self.state != _BUSY:  # bytes nobody asked for: the connection is not reusable
            self.reader.keep_alive = False
            if self.transport is not None:
                self.transport.close()
            return
        try:
            self._handle(self.reader.feed(data))
        except HttpReadError as exc:
            self._fail(SpliceProtocolError(f"bad HTTP from the decode worker: {exc}"))
        except BaseException as exc:  # a relay callback failed: the relaying coroutine raises it
            self._fail(exc)

    def _handle(self, events: list[Event]) -> None:
        for event in events:
            if type(event) is bytes:  # the common case first: a body piece
                if self.sink is not None:
                    self.sink(event, None)
                else:
                    self.body += event
                    if not self.whole and len(self.body) > HIGH_WATER:
                        self.pause()  # the worker waits (TCP back-pressure) for a relay
            elif event is END:
                self._finish()
            elif isinstance(event, Head):
                self.status = event.status
                if self.head is not None and not self.head.done():
                    self.head.set_result(None)
            if self.state != _BUSY:  # a sink ended the answer (error event, client gone)
                return

    # -- one request ------------------------------------------------------------------------
    def start(self, request: bytes, idle_s: float) -> None:
        assert self.transport is not None and self.state in (_IDLE, _DONE)
        self.head, self.done = self.loop.create_future(), self.loop.create_future()
        self.reader = ResponseReader()
        self.state, self.status, self.sink, self.on_tick = _BUSY, 0, None, None
        self.whole = False
        self.body.clear()
        self.requests += 1
        self.idle_s, self.seen, self.last = idle_s, False, self.loop.time()
        self._arm()
        self.transport.write(request)

    def _arm(self) -> None:
        tick = min(self.idle_s / 4, _MAX_TICK_S) if self.idle_s > 0 else _MAX_TICK_S
        self.timer = self.loop.call_later(tick, self._tick)

    def _tick(self) -> None:
        self.timer = None
        if self.state != _BUSY:
            return
        if self.on_tick is not None:
            self.on_tick()
            if self.state != _BUSY:
                return
        now = self.loop.time()
        # A client too slow to read is not an idle worker (the server's client_stall_s bounds
        # that client); an answer paused with no relay attached is idle: nobody will read it.
        if self.seen or (self.paused and self.sink is not None):
            self.seen, self.last = False, now
        elif self.idle_s > 0 and now - self.last >= self.idle_s:
            what = "no relay read the answer" if self.paused else "no byte from the decode worker"
            self._fail(SpliceIdleTimeout(f"{what} for {self.idle_s} s"))
            return
        self._arm()

    def _finish(self) -> None:
        self.state = _DONE
        self._stop()
        if self.done is not None and not self.done.done():
            self.done.set_result(None)

    def fail(self, exc: BaseException) -> None:
        """End the request in flight with `exc` and drop the connection (vLLM's abort)."""
        self._fail(exc)

    def _fail(self, exc: BaseException) -> None:
        if self.state in (_DONE, _FAILED):
            return
        self.state = _FAILED
        self.reader.keep_alive = False
        self._stop()
        for fut in (self.head, self.done):
            if fut is not None and not fut.done():
                fut.set_exception(exc)
                fut.exception()  # retrieved: nobody may be waiting any more
        if self.transport is not None:
            self.transport.close()

    def _stop(self) -> None:
        self.sink = self.on_tick = None
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        self.resume()

    def pause(self) -> None:
        if not self.paused and self.transport is not None:
            self.paused = True
            self.pauses += 1
            self.transport.pause_reading()

    def resume(self) -> None:
        if self.paused and self.transport is not None:
            self.paused = False
            self.transport.resume_reading()

    @property
    def busy(self) -> bool:
        """A request is in flight on it (its answer not yet whole)."""
        return self.state == _BUSY

    @property
    def reusable(self) -> bool:
        return (
            self.state in (_IDLE, _DONE)
            and self.reader.keep_alive
            and self.transport is not None
            and not self.transport.is_closing()
        )


class SpliceResponse:
    """The part of `aiohttp.ClientResponse` the request flow uses: status, read, close."""

    __slots__ = ("_conn", "status", "_closed")

    def __init__(self, conn: UpstreamConn) -> None:
        self._conn = conn
        self.status = conn.status
        self._closed = False

    def __repr__(self) -> str:
        return f"SpliceResponse(status={self.status}, {self._conn!r})"

    async def read(self) -> bytes:
        """The whole body (Content-Length, chunked or until close)."""
        conn = self._conn
        assert conn.done is not None
        conn.whole = True
        conn.resume()
        await conn.done
        return bytes(conn.body)

    def close(self) -> None:
        """Give a fully read connection back to the pool; drop an unfinished one (abort)."""
        if self._closed:
            return
        self._closed = True
        conn = self._conn
        if conn.reusable:
            conn.pool._release(conn)
        else:
            conn._fail(SpliceDisconnected("closed by the router"))
            if conn.transport is not None:
                conn.transport.close()

    release = close


# Control characters aiohttp's client refuses in a header (RFC 9110 §5.5, RFC 9112 §4: a header
# injection), as aiohttp.http_writer's _FORBIDDEN_HEADER_CHARS_RE.
_FORBIDDEN_IN_HEADER: Final = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")


def header_lines(headers: dict[str, str]) -> bytes:
    """`headers` as the request's header lines, written as aiohttp's client writes them (the
    legs on aiohttp and on this pool send a worker the same bytes): UTF-8, which is how
    aiohttp's server decoded a client's header (a forwarded one goes on as it came), a lone
    surrogate dropped (aiohttp's C writer does); a control character raises ValueError."""
    lines = []
    for name, value in headers.items():
        line = f"{name}: {value}"
        if _FORBIDDEN_IN_HEADER.search(line) is not None:
            raise ValueError(
                "Forbidden control character detected in headers. "
                "Potential header injection attack."
            )
        lines.append(line)
    return "".join(f"{line}\r\n" for line in lines).encode("utf-8", "ignore")


class SplicePool:
    """Keep-alive connections per worker `(host, port)`; at most `max_idle` idle per worker."""

    def __init__(self, max_idle: int = 1024) -> None:
        self.max_idle = max_idle
        self._idle: dict[tuple[str, int], deque[UpstreamConn]] = {}
        self._all: set[UpstreamConn] = set()
        self._closed = False

    def __repr__(self) -> str:
        idle = sum(len(q) for q in self._idle.values())
        return f"SplicePool(open={len(self._all)}, idle={idle}, max_idle={self.max_idle})"

    @staticmethod
    def supports(url: str) -> bool:
        return url.startswith("http://")

    async def post(
        self,
        url: str,
        body: bytes,
        headers: dict[str, str],
        *,
        connect_s: float | None,
        idle_s: float,
    ) -> SpliceResponse:
        """POST `body` to `url`; returns once the response head is in."""
        if self._closed:
            raise SpliceConnectError("the splice pool is closed")
        parts = urlsplit(url)
        key = (parts.hostname or "127.0.0.1", parts.port or 80)
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        head = header_lines(headers)  # before a connection is taken: it may raise
        conn = self._idle_conn(key) or await self._connect(key, connect_s)
        conn.start(
            b"POST %s HTTP/1.1\r\nHost: %s:%d\r\n%sContent-Length: %d\r\n\r\n%s"
            % (target.encode("latin-1"), key[0].encode(), key[1], head, len(body), body),
            idle_s,
        )
        try:
            assert conn.head is not None
            await conn.head
        except BaseException:
            conn._fail(SpliceDisconnected("request abandoned before the answer's head"))
            raise
        return SpliceResponse(conn)

    def _idle_conn(self, key: tuple[str, int]) -> UpstreamConn | None:
        idle = self._idle.get(key)
        while idle:
            conn = idle.pop()  # the most recently used: the least likely to be timed out
            if conn.reusable:
                return conn
        return None

    async def _connect(self, key: tuple[str, int], connect_s: float | None) -> UpstreamConn:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(connect_s):
                _, conn = await loop.create_connection(lambda: UpstreamConn(self, key), *key)
        except TimeoutError as exc:
            raise SpliceConnectError(f"connect to {key[0]}:{key[1]} timed out") from exc
        except OSError as exc:
            raise SpliceConnectError(f"cannot connect to {key[0]}:{key[1]}: {exc}") from exc
        self._all.add(conn)
        return conn

    def _release(self, conn: UpstreamConn) -> None:
        idle = self._idle.setdefault(conn.key, deque())
        if self._closed or len(idle) >= self.max_idle:
            if conn.transport is not None:
                conn.transport.close()
            return
        conn.state = _IDLE
        idle.append(conn)

    def _forget(self, conn: UpstreamConn) -> None:
        self._all.discard(conn)
        idle = self._idle.get(conn.key)
        if idle and conn in idle:
            idle.remove(conn)

    async def close(self) -> None:
        """Close every connection, idle or not (app cleanup: the streams are over by now)."""
        self._closed = True
        conns = list(self._all)
        for conn in conns:
            conn._fail(SpliceDisconnected("the router is shutting down"))
            if conn.transport is not None:
                conn.transport.close()
        self._idle.clear()
        if conns:
            await asyncio.sleep(0)  # let connection_lost run
