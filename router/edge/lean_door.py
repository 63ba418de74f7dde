"""The lean front door (issue 36, `server.front_door: lean`, the default): chat and completions
requests of the common shape served on a bare asyncio protocol; any other request, and its
connection from then on, handed to aiohttp's (router/edge/server.py `_Protocol`).

aiohttp's server costs about a third of the router's CPU on a short answer (its request and
response objects, the middleware chain, the router, its writer; docs/benchmarks-overhead.md).
Most of that is for what a generation request never uses. Here a request head is parsed with
`bytes` methods (router/edge/lean_http.py) and served by the same flow (router/edge/app.py
`generate`) with its answers written straight onto the transport.

The common shape, and nothing else: `POST /v1/chat/completions` or `POST /v1/completions`,
HTTP/1.1, one `Content-Length` (at most `server.max_body_bytes`), no `Transfer-Encoding`,
`Content-Encoding` (but identity), `Expect` or `Upgrade`, header lines of `name: value` with a
token name, the head within 16 KB. A head that is anything else — a parser error included —
goes to aiohttp with every byte received, so its hardened parser answers it (a 400 with an
OpenAI body, a 413, a gzip body, a 100-continue) and the connection stays aiohttp's. This door
never answers a malformed request itself: what it reads, it reads strictly.

The client bounds are the same as aiohttp's connections' (router/edge/server.py, module doc):
`header_s` from the connection's opening or the next head's first byte (408, or a plain close if
nothing came), `body_s` (router/edge/front_door.py `read_body`), `keepalive_s` for an idle
kept-alive connection, `client_stall_s` for a client that takes nothing of a full write buffer
(the same `StallGuard`). A client that goes away cancels its request, as aiohttp's
`handler_cancellation` does. At shutdown an idle connection closes at once and a busy one after
its answer (or when `shutdown_timeout` runs out: router/edge/server.py `_Server.shutdown`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from router.config import Timeouts
from router.edge.lean_http import (
    Body,
    LeanRequest,
    head_bytes,
    json_answer,
    parse_head,
    request_route,
)
from router.errors import RequestTimeout

__all__ = ["LeanDoor", "LeanRoutes", "LeanStream"]

_MAX_HEAD = 16 * 1024  # aiohttp's limits: 8190 bytes a line, and a few lines
_PAUSE_PIPELINED = 64 * 1024  # bytes sent ahead of an answer before reading stops


class Guard(Protocol):
    """The write-stall bound (router/edge/server.py `StallGuard`)."""

    def paused(self, transport: asyncio.Transport) -> None: ...

    def resumed(self) -> None: ...

    def cancel(self) -> None: ...


@dataclass(frozen=True, slots=True)
class LeanRoutes:
    """What the door serves and with what: `paths` (request target -> the route's name),
    `serve(request, route, client)` (the generation flow), `error_for(exc)` (the answer for
    what the flow raised; None: the client is gone), and the bounds."""

    paths: Mapping[bytes, str]
    serve: Callable[[LeanRequest, str, LeanClient], Awaitable[object]]
    error_for: Callable[[BaseException, LeanRequest], Any]
    app: Any  # aiohttp's Application: the flow reads its services from it
    max_body_bytes: int


class LeanStream:
    """A streamed answer, chunked, headers sent (router/request/respond.py `ClientStream`).
    `transport` and `drain` are the splice relay's (router/relay/aiohttp_private.py)."""

    __slots__ = ("door", "transport", "ended")

    def __init__(self, door: LeanDoor, transport: asyncio.Transport) -> None:
        self.door, self.transport, self.ended = door, transport, False

    async def write(self, data: bytes) -> None:
        if self.transport.is_closing():
            raise ConnectionResetError("Cannot write to closing transport")
        if data:
            self.transport.write(b"%x\r\n%s\r\n" % (len(data), data))
            await self.drain()

    async def write_eof(self) -> None:
        if not self.ended:
            self.ended = True
            if not self.transport.is_closing():
                self.transport.write(b"0\r\n\r\n")

    async def drain(self) -> None:
        await self.door.drain()

    def splice_target(self) -> tuple[LeanStream, asyncio.Transport]:
        """The splice relay writes its chunks straight onto the transport (router/relay/
        aiohttp_private.py `prepared_writer`), and drains through this stream."""
        return self, self.transport


class LeanClient:
    """The door's side of a `ClientSide` (router/edge/app.py `_AiohttpClient`'s twin)."""

    __slots__ = ("door", "stream", "answered", "pending")

    def __init__(self, door: LeanDoor) -> None:
        self.door = door
        self.stream: LeanStream | None = None
        self.answered = False
        self.pending: tuple[int, dict[str, str], bytes] | None = None

    async def start_stream(self, headers: dict[str, str]) -> LeanStream:
        transport = self.door.transport
        if transport is None or transport.is_closing():
            raise ConnectionResetError("the client's connection is closed")
        framing = "Transfer-Encoding: chunked\r\n"
        transport.write(head_bytes(200, headers, framing, self.door.closes_after))
        self.stream = LeanStream(self.door, transport)
        return self.stream

    def answer(self, body: bytes | None, headers: dict[str, str]) -> None:
        """The flow's whole answer: written once the handler has returned (`LeanDoor._serve`),
        as aiohttp writes a returned response, so the request is counted and settled first."""
        if body is not None:
            self.pending = (200, headers, body)

    def whole(self, status: int, headers: Mapping[str, str], body: bytes) -> None:
        """A whole JSON answer (the flow's, or an error's)."""
        transport = self.door.transport
        if "close" in headers.get("Connection", "").lower():
            self.door.closes_after = True
        if transport is not None and not transport.is_closing():
            transport.write(json_answer(status, headers, body, self.door.closes_after))
        self.answered = True


class LeanDoor(asyncio.Protocol):
    """One client connection, served here while its requests have the common shape."""

    def __init__(
        self,
        routes: LeanRoutes,
        limits: Timeouts,
        stall: Guard,
        hand_over: Callable[[], asyncio.Protocol],
        doors: set[LeanDoor],
        closing: Callable[[], bool],
    ) -> None:
        self.routes, self.limits, self.stall = routes, limits, stall
        self._hand_over_to = hand_over  # aiohttp's protocol for this server
        self._doors, self._server_closing = doors, closing
        self.transport: asyncio.Transport | None = None
        self._buffer = bytearray()
        self._body: Body | None = None
        self._task: asyncio.Task[None] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._head_timed = False  # the timer is the head's (else keep-alive's)
        self._paused = False
        self._drained: asyncio.Future[None] | None = None
        self._reading = True
        self.closes_after = False  # the connection closes once this answer is out
        self._closing = False

    def __repr__(self) -> str:
        return f"LeanDoor(open={self.transport is not None}, busy={self._task is not None})"

    # -- the connection -----------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport) or hasattr(transport, "write")
        self.transport = transport  # type: ignore[assignment]
        if self._server_closing():
            transport.abort()  # type: ignore[attr-defined]
            return
        self._doors.add(self)
        self._arm_head()

    def connection_lost(self, exc: BaseException | None) -> None:
        self._doors.discard(self)
        self._cancel_timer()
        self.stall.cancel()
        self.transport = None
        if self._drained is not None and not self._drained.done():
            self._drained.set_exception(ConnectionResetError("the client went away"))
            self._drained.exception()  # retrieved: the writer that waited sees it
        if self._task is not None:
            self._task.cancel()  # the client left: its request ends (aiohttp's cancellation)

    def data_received(self, data: bytes) -> None:
        if self._body is not None:
            data = self._body.feed(data)
            if self._body.is_eof():
                self._body = None
            if not data:
                return
        self._buffer += data
        if self._task is None:
            self._next_head()
        elif len(self._buffer) > _PAUSE_PIPELINED and self._reading and self.transport:
            self._reading = False
            self.transport.pause_reading()  # a client far ahead of its answers waits

    def _next_head(self) -> None:
        buffer = self._buffer
        end = buffer.find(b"\r\n\r\n")
        if end < 0:
            if len(buffer) > _MAX_HEAD or not self._may_be_ours(buffer):
                self._hand_over()  # aiohttp's parser judges it as it comes (TLS, junk, GET)
            elif buffer and not self._head_timed:
                self._arm_head()  # its first byte: the head's clock starts
            return
        head = parse_head(bytes(buffer[:end]), self.routes.paths, self.routes.max_body_bytes)
        if head is None:
            self._hand_over()
            return
        self._cancel_timer()
        start = end + 4
        body = Body(
            head.length, bytes(buffer[start : start + head.length]), asyncio.get_running_loop()
        )
        del buffer[: start + head.length]
        if not body.is_eof():
            self._body = body
        self.closes_after = head.close or self._closing
        request = LeanRequest(self.routes.app, head, body, head.route)
        self._task = asyncio.get_running_loop().create_task(self._serve(request))

    def _may_be_ours(self, partial: bytearray) -> bool:
        """Whether a head begun so far may still be of the common shape: a request line that
        is not (or cannot become) one of ours goes to aiohttp at once."""
        line_end = partial.find(b"\r\n")
        if line_end < 0:
            return b"POST /"[: len(partial)] == partial[:6]
        return request_route(bytes(partial[:line_end]), self.routes.paths) is not None

    def _hand_over(self) -> None:
        """aiohttp's protocol takes the connection, with what has arrived of this request."""
        transport = self.transport
        self._doors.discard(self)
        self._cancel_timer()
        self.stall.cancel()
        self.transport = None
        if transport is None or transport.is_closing():
            return
        protocol = self._hand_over_to()
        transport.set_protocol(protocol)
        protocol.connection_made(transport)
        if not self._reading:
            transport.resume_reading()
        if self._buffer:
            data, self._buffer = bytes(self._buffer), bytearray()
            protocol.data_received(data)

    # -- one request --------------------------------------------------------------------------
    async def _serve(self, request: LeanRequest) -> None:
        client = LeanClient(self)
        try:
            await self.routes.serve(request, request.path, client)
            if client.pending is not None:
                client.whole(*client.pending)
        except asyncio.CancelledError:
            if self.transport is not None:  # not the client's leaving: the replica stops
                self.transport.abort()
            raise
        except BaseException as exc:
            err = self.routes.error_for(exc, request)
            if err is None or client.stream is not None or client.answered:
                # The client is gone, or the answer has started: nothing else can be said.
                if self.transport is not None:
                    self.transport.abort()
            else:
                client.whole(err.status, err.headers(), err.body())
        finally:
            self._task = None
        if client.stream is not None:
            await client.stream.write_eof()
        self._answered()

    def _answered(self) -> None:
        transport = self.transport
        if transport is None:
            return
        if self.closes_after or self._closing or self._body is not None:
            transport.close()  # a body still arriving was not read: the connection ends
            return
        if not self._reading:
            self._reading = True
            transport.resume_reading()
        if self._buffer:
            self._next_head()
        else:
            self._arm(self.limits.keepalive_s, self._idle_over, head=False)

    # -- the bounds ---------------------------------------------------------------------------
    def _arm(self, delay: float, callback: Callable[[], None], *, head: bool) -> None:
        self._cancel_timer()
        if delay > 0:
            self._timer = asyncio.get_running_loop().call_later(delay, callback)
            self._head_timed = head

    def _arm_head(self) -> None:
        self._arm(self.limits.header_s, self._head_overdue, head=True)

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._head_timed = False

    def _head_overdue(self) -> None:
        self._timer = None
        transport = self.transport
        if transport is None or self._task is not None:
            return
        if self._buffer:
            err = RequestTimeout(f"the request head did not arrive within {self.limits.header_s} s")
            transport.write(json_answer(err.status, err.headers(), err.body(), True))
        transport.close()

    def _idle_over(self) -> None:
        self._timer = None
        if self.transport is not None and self._task is None and not self._buffer:
            self.transport.close()

    def pause_writing(self) -> None:
        self._paused = True
        if self.transport is not None:
            self.stall.paused(self.transport)

    def resume_writing(self) -> None:
        self._paused = False
        self.stall.resumed()
        if self._drained is not None and not self._drained.done():
            self._drained.set_result(None)
        self._drained = None

    async def drain(self) -> None:
        if self.transport is None:
            raise ConnectionResetError("the client went away")
        if self._paused:
            if self._drained is None:
                self._drained = asyncio.get_running_loop().create_future()
            await asyncio.shield(self._drained)

    # -- the server's shutdown ----------------------------------------------------------------
    def close(self) -> None:
        """No further request: an idle connection closes now, a busy one after its answer."""
        self._closing = True
        if self._task is None and self.transport is not None:
            self.transport.close()

    async def shutdown(self, timeout: float | None) -> None:  # noqa: ASYNC109 (aiohttp's shape)
        self.close()
        task = self._task
        if task is not None:
            await asyncio.wait({task}, timeout=timeout)
            if not task.done():
                task.cancel()
                await asyncio.wait({task})
        if self.transport is not None:
            self.transport.close()
