"""The decode leg as a splice: worker bytes → client transport from the protocol callback.

`settings.relay == "splice"` sends the decode leg through this raw HTTP/1.1 client instead of
aiohttp's. Per worker `(host, port)` a pool of keep-alive `asyncio.Protocol` connections
(`TCP_NODELAY`); `data_received` parses the response framing (Content-Length, chunked, or
until close), and while a stream is relayed it cuts whole SSE events, counts tokens and writes
them, re-framed as chunks, straight to the client's transport: no StreamReader, no future and
no task wake-up per chunk, no timer re-armed per read (docs/benchmarks-overhead.md, proposals
1 and 2). The relaying coroutine only awaits "the answer is over".

Deadlines: one coarse watchdog timer per request in flight ticks every `min(idle_s / 4, 1 s)`;
it ends the leg when no byte has come for `idle_s` (never earlier, at most one tick later), and
notices a client that went away while the worker is silent. The TTFT / total deadlines stay
the caller's `asyncio.timeout_at`; cancelling the relaying coroutine closes the connection.

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
import socket
from collections import deque
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

import aiohttp
from aiohttp import web

from router.relay import (
    ERROR_EVENT,
    MALFORMED_FIRST_EVENT,
    NO_FIRST_EVENT,
    RelayResult,
    count_tokens,
    malformed,
    split_at_error,
)

__all__ = [
    "SpliceError",
    "SpliceConnectError",
    "SpliceIdleTimeout",
    "SpliceDisconnected",
    "SpliceProtocolError",
    "SplicePool",
    "SpliceResponse",
    "relay_splice",
]

_DONE = b"data: [DONE]"
# Above this many bytes queued towards the client, stop reading the worker until it drains.
HIGH_WATER = 64 * 1024
_MAX_TICK_S = 1.0

# Connection states.
_IDLE, _HEAD, _LENGTH, _CHUNKED, _UNTIL_CLOSE, _DONE_STATE, _FAILED = range(7)


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


class _Conn(asyncio.Protocol):
    """One keep-alive connection to a worker; at most one request in flight."""

    def __init__(self, pool: SplicePool, key: tuple[str, int]) -> None:
        self.pool, self.key = pool, key
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.state = _IDLE
        self.status = 0
        self.remaining = 0  # Content-Length bytes still to come
        self.keep_alive = True
        self.head: asyncio.Future[None] | None = None
        self.done: asyncio.Future[None] | None = None
        # What arrived while no sink was attached: at most ~HIGH_WATER, then reading pauses
        # until a relay attaches (or the answer is closed), unless read() wants it whole.
        self.body = bytearray()
        self.whole = False  # read() is collecting the whole body
        self.sink: Callable[[bytes], None] | None = None
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
            f"_Conn({self.key[0]}:{self.key[1]}, state={self.state}, status={self.status}, "
            f"requests={self.requests}, pauses={self.pauses}, open={self.transport is not None})"
        )

    # -- asyncio.Protocol ---------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self.keep_alive = False
        self.pool._forget(self)
        if self.state == _UNTIL_CLOSE:
            self._finish()
        elif self.state in (_HEAD, _LENGTH, _CHUNKED):
            self._fail(SpliceDisconnected(f"decode connection lost: {exc!r}"))

    def pause_writing(self) -> None:  # our request is small; nothing to do
        pass

    def resume_writing(self) -> None:
        pass

    def data_received(self, data: bytes) -> None:
        self.seen = True
        try:
            if self.state == _CHUNKED:
                self._chunked(data)
            elif self.state == _LENGTH:
                self._length(data)
            elif self.state == _HEAD:
                self._head(data)
            elif self.state == _UNTIL_CLOSE:
                self._deliver(data)
            else:  # bytes nobody asked for: the connection is not reusable
                self.keep_alive = False
                if self.transport is not None:
                    self.transport.close()
        except SpliceError as exc:
            self._fail(exc)
        except (ValueError, IndexError) as exc:
            self._fail(SpliceProtocolError(f"bad HTTP from the decode worker: {exc!r}"))
        except BaseException as exc:  # a relay callback failed: the relaying coroutine raises it
            self._fail(exc)

    # -- one request ------------------------------------------------------------------------
    def start(self, request: bytes, idle_s: float) -> None:
        assert self.transport is not None and self.state in (_IDLE, _DONE_STATE)
        self.head, self.done = self.loop.create_future(), self.loop.create_future()
        self.state, self.status, self.sink, self.on_tick = _HEAD, 0, None, None
        self.whole = False
        self.buf.clear()
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
        if self.state not in (_HEAD, _LENGTH, _CHUNKED, _UNTIL_CLOSE):
            return
        if self.on_tick is not None:
            self.on_tick()
            if self.state not in (_HEAD, _LENGTH, _CHUNKED, _UNTIL_CLOSE):
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

    def _head(self, data: bytes) -> None:
        buf = self.buf
        buf += data
        end = buf.find(b"\r\n\r\n")
        if end < 0:
            if len(buf) > 65536:
                raise SpliceProtocolError("response head over 64 KiB")
            return
        lines = bytes(buf[:end]).split(b"\r\n")
        version, status = lines[0].split(b" ", 2)[:2]
        self.status = int(status)
        del buf[: end + 4]
        if 100 <= self.status < 200:  # 100 Continue and friends: the real head follows
            rest = bytes(buf)
            buf.clear()
            if rest:
                self._head(rest)
            return
        chunked, length = False, None
        self.keep_alive = version == b"HTTP/1.1"
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            name = name.strip().lower()
            if name == b"content-length":
                length = int(value)
            elif name == b"transfer-encoding":
                chunked = b"chunked" in value.lower()
            elif name == b"connection":
                value = value.strip().lower()
                self.keep_alive = value == b"keep-alive" or (self.keep_alive and value != b"close")
        assert self.head is not None
        if not self.head.done():
            self.head.set_result(None)
        rest = bytes(buf)
        buf.clear()
        if chunked:
            self.state = _CHUNKED
        elif length is not None:
            self.state, self.remaining = _LENGTH, length
        elif self.status in (204, 304):
            self.state, self.remaining = _LENGTH, 0
        else:
            self.state, self.keep_alive = _UNTIL_CLOSE, False
        if self.state == _LENGTH and self.remaining == 0:
            self._finish()
        if rest:
            self.data_received(rest)

    def _length(self, data: bytes) -> None:
        if len(data) > self.remaining:  # more than the answer: a confused worker
            self.keep_alive = False
            data = data[: self.remaining]
        self.remaining -= len(data)
        if data:
            self._deliver(data)
        if self.remaining == 0 and self.state == _LENGTH:
            self._finish()

    def _chunked(self, data: bytes) -> None:
        buf = self.buf
        if buf:
            buf += data
            view: bytes | bytearray = buf
        else:
            view = data
        pos, parts, finished = 0, [], False
        while True:
            eol = view.find(b"\r\n", pos)
            if eol < 0:
                break
            size = int(bytes(view[pos:eol]).split(b";", 1)[0], 16)
            start = eol + 2
            if size == 0:  # last chunk; no trailers from the workers we speak to
                end = view.find(b"\r\n", start)
                if end < 0:
                    break
                pos, finished = end + 2, True
                break
            if len(view) < start + size + 2:
                break
            parts.append(bytes(view[start : start + size]))
            pos = start + size + 2
        if view is buf:
            del buf[:pos]
        elif pos < len(data):
            buf += data[pos:]
        if parts:
            self._deliver(parts[0] if len(parts) == 1 else b"".join(parts))
        if finished and self.state == _CHUNKED:
            if buf:
                self.keep_alive = False
            self._finish()

    def _deliver(self, payload: bytes) -> None:
        if self.sink is not None:
            self.sink(payload)
            return
        self.body += payload
        if not self.whole and len(self.body) > HIGH_WATER:
            self.pause()  # the worker waits (TCP back-pressure) until a relay takes it

    def _finish(self) -> None:
        self.state = _DONE_STATE
        self._stop()
        if self.done is not None and not self.done.done():
            self.done.set_result(None)

    def _fail(self, exc: BaseException) -> None:
        if self.state in (_DONE_STATE, _FAILED):
            return
        self.state, self.keep_alive = _FAILED, False
        self._stop()
        for fut in (self.head, self.done):
            if fut is not None and not fut.done():
                fut.set_exception(exc)
        if self.done is not None and self.done.done() and not self.done.cancelled():
            self.done.exception()  # retrieved: nobody may be waiting any more
        if self.head is not None and self.head.done() and not self.head.cancelled():
            self.head.exception()
        if self.transport is not None:
            self.transport.close()

    def _stop(self) -> None:
        self.sink = self.on_tick = None
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if self.paused and self.transport is not None:
            self.paused = False
            self.transport.resume_reading()

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
        return self.state in (_HEAD, _LENGTH, _CHUNKED, _UNTIL_CLOSE)

    @property
    def reusable(self) -> bool:
        return (
            self.state in (_IDLE, _DONE_STATE)
            and self.keep_alive
            and self.transport is not None
            and not self.transport.is_closing()
        )


class SpliceResponse:
    """The part of `aiohttp.ClientResponse` the request flow uses: status, read, close."""

    __slots__ = ("_conn", "status", "_closed")

    def __init__(self, conn: _Conn) -> None:
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


class SplicePool:
    """Keep-alive connections per worker `(host, port)`; at most `max_idle` idle per worker."""

    def __init__(self, max_idle: int = 1024) -> None:
        self.max_idle = max_idle
        self._idle: dict[tuple[str, int], deque[_Conn]] = {}
        self._all: set[_Conn] = set()
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
        conn = self._idle_conn(key) or await self._connect(key, connect_s)
        head = b"".join(
            b"%s: %s\r\n" % (k.encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()
        )
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

    def _idle_conn(self, key: tuple[str, int]) -> _Conn | None:
        idle = self._idle.get(key)
        while idle:
            conn = idle.pop()  # the most recently used: the least likely to be timed out
            if conn.reusable:
                return conn
        return None

    async def _connect(self, key: tuple[str, int], connect_s: float | None) -> _Conn:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(connect_s):
                _, conn = await loop.create_connection(lambda: _Conn(self, key), *key)
        except TimeoutError as exc:
            raise SpliceConnectError(f"connect to {key[0]}:{key[1]} timed out") from exc
        except OSError as exc:
            raise SpliceConnectError(f"cannot connect to {key[0]}:{key[1]}: {exc}") from exc
        self._all.add(conn)
        return conn

    def _release(self, conn: _Conn) -> None:
        idle = self._idle.setdefault(conn.key, deque())
        if self._closed or len(idle) >= self.max_idle:
            if conn.transport is not None:
                conn.transport.close()
            return
        conn.state = _IDLE
        idle.append(conn)

    def _forget(self, conn: _Conn) -> None:
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


async def relay_splice(
    resp: SpliceResponse,
    client: web.StreamResponse,
    *,
    chat: bool,
    clock: Any,
    on_first_token: Any = None,
    on_tokens: Any = None,
    first_event_by: float | None = None,
) -> RelayResult:
    """`router.relay.relay_sse`'s contract, done from the upstream protocol's callbacks.

    Whole SSE events only reach the client (a partial one is held), `result.chunks` keeps what
    was forwarded, `on_first_token()` runs once at the first forwarded bytes, `on_tokens(total)`
    after each forward. The client's chunked framing is written here, on the transport aiohttp
    prepared (headers sent), so `client.write_eof()` still ends the body correctly.
    """
    conn = resp._conn
    result = RelayResult()
    writer: Any = client._payload_writer  # noqa: SLF001 - the transport aiohttp prepared
    transport = writer.transport if writer is not None else None
    assert conn.done is not None
    done = conn.done
    if transport is None or transport.is_closing():
        result.client_gone = True
        return result
    transport.set_write_buffer_limits(high=HIGH_WATER)
    loop = asyncio.get_running_loop()
    chunks = result.chunks
    pending = b""
    tail = b""
    drainer: asyncio.Task[None] | None = None

    def gone() -> None:
        result.client_gone = True
        conn._fail(SpliceDisconnected("the client went away"))

    def check_client() -> None:  # the watchdog's tick: a silent worker, a vanished client
        if transport.is_closing():
            gone()

    async def drain() -> None:
        nonlocal drainer
        try:
            while transport.get_write_buffer_size() > HIGH_WATER // 4:
                if transport.is_closing():
                    break
                await writer.drain()
                if transport.get_write_buffer_size() > HIGH_WATER // 4:
                    await asyncio.sleep(0.005)  # above low water but not paused: look again
        except (ConnectionError, RuntimeError):
            pass
        drainer = None
        if transport.is_closing():
            gone()
        else:
            conn.resume()

    def sink(data: bytes) -> None:
        nonlocal pending, tail, drainer
        if pending:
            data = pending + data
            pending = b""
        # Forward whole events only: if the worker dies mid-event, the client must not hold
        # half an event that the next (resumed) stream's bytes would corrupt.
        if not data.endswith(b"\n\n"):
            cut = data.rfind(b"\n\n") + 2  # 1 when there is no event end at all: hold it all
            if cut < 2:
                pending = data
                return
            data, pending = data[:cut], data[cut:]
        data, error = split_at_error(data)
        if error is not None:
            result.upstream_error = f"{ERROR_EVENT}: {error.message}"
            result.error_kind = "error_event"
            conn._fail(SpliceDisconnected("the worker reported an error"))
            if not data:
                return
        if result.first_token_at is None:
            if malformed(data):
                result.upstream_error, result.error_kind = MALFORMED_FIRST_EVENT, "malformed"
                conn._fail(SpliceDisconnected("the worker's first event is malformed"))
                return
            result.first_token_at = clock()
            if on_first_token is not None:
                on_first_token()
        chunks.append(data)
        result.tokens += count_tokens(data, chat)
        if on_tokens is not None:
            on_tokens(result.tokens)
        if transport.is_closing():
            gone()
            return
        transport.write(b"%x\r\n%s\r\n" % (len(data), data))
        # The last bytes seen, to tell a finished stream (`[DONE]`) from a cut one.
        tail = data[-32:] if len(data) >= 32 else (tail + data)[-32:]
        if drainer is None and transport.get_write_buffer_size() > HIGH_WATER:
            conn.pause()
            drainer = loop.create_task(drain())

    def no_first_event() -> None:
        if result.first_token_at is None and result.upstream_error is None:
            result.upstream_error, result.error_kind = NO_FIRST_EVENT, "kv_handoff_timeout"
            conn._fail(SpliceDisconnected("no first event before the KV handoff deadline"))

    deadline = loop.call_at(first_event_by, no_first_event) if first_event_by is not None else None
    try:
        if conn.body:  # arrived between the head and now
            early = bytes(conn.body)
            conn.body.clear()
            sink(early)
        if not done.done():
            conn.sink, conn.on_tick = sink, check_client
            if drainer is None:
                conn.resume()  # paused while nobody read it (see _Conn.body)
        await done
    except SpliceError as exc:
        if not result.client_gone and result.upstream_error is None:
            result.upstream_error = str(exc)
    except BaseException:
        conn._fail(SpliceDisconnected("relay cancelled"))  # vLLM's abort signal
        raise
    finally:
        if deadline is not None:
            deadline.cancel()
        conn.sink = conn.on_tick = None
        if drainer is not None:
            drainer.cancel()
    if result.client_gone:
        return result
    result.completed = _DONE in tail
    if not result.completed and result.upstream_error is None:
        result.upstream_error = "decode stream ended without [DONE]"
    return result
