"""The router's HTTP server: aiohttp's runner and site, with the client side bounded.

With `server.front_door: lean` (the default) each connection starts on the lean front door
(router/edge/lean_door.py), which serves chat and completions requests of the common shape
itself and hands any other request, and its connection, to the `_Protocol` below; `_Server`
makes both and closes both at shutdown. The bounds below hold on either door.

aiohttp bounds how much a client may send (line, header and body sizes) but not how slowly,
and answers its own parser errors in plain text. Every connection here is a `_Protocol`,
aiohttp's `RequestHandler` with these additions (`Timeouts` fields, 0 turns one off):

- `header_s`: a request head must be whole within this long of the connection opening, or
  of its first byte on a kept-alive connection; else 408 (or a plain close if it sent
  nothing). aiohttp's `keepalive_timeout` (`keepalive_s`) closes idle kept-alive ones.
- `client_stall_s`: once the transport's write buffer is over its high-water mark, a client
  that then takes no byte of it for this long has its connection aborted (one that takes
  some, however slowly, gets another period). aiohttp then cancels the handler
  (`handler_cancellation`), which closes the decode leg (vLLM's abort) and releases the
  reservation through the usual `finally` — for both decode-leg relays and any other
  response, since all of them write through this transport.
- every error aiohttp answers itself (`handle_error`: the HTTP parser's 400s — control
  characters, a bad Content-Length, a 9 KB URL, a bad method — and a 500 that escapes the
  app) gets an OpenAI-style JSON body, built as the app's are (router/errors.py).

`body_s` is the handler's (router/edge/front_door.py `read_body`), as is mapping a body aiohttp
cannot decode to 400.

aiohttp offers no hook for its protocol class, so `_adopt` rebuilds the `Server` that
`AppRunner` made as a `_Server`, reading aiohttp's private state through the one function
that does (router/relay/aiohttp_private.py), checked by tests/router/edge/test_client_bounds.py so
that an
aiohttp upgrade that moves it fails loudly.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from collections.abc import AsyncIterator
from typing import Any

from aiohttp import hdrs, web
from aiohttp.http_exceptions import (
    ContentEncodingError,
    InvalidHeader,
    InvalidURLError,
    LineTooLong,
)

from router.config import Timeouts
from router.edge.lean_door import LeanDoor, LeanRoutes
from router.errors import (
    INTERNAL_ERROR_MESSAGE,
    DeadlineExceeded,
    HTTPRefusal,
    RequestTimeout,
    RouterError,
    error_response,
)
from router.redact import scrub
from router.relay.aiohttp_private import AiohttpChanged, aiohttp_private

__all__ = [
    "RouterRunner",
    "parser_error_text",
    "serving",
]

log = logging.getLogger(__name__)

# The lean front door's routes (router/edge/app.py sets them when `server.front_door` is lean).
LEAN_ROUTES = web.AppKey("lean_routes", LeanRoutes)

_PARSER_ERROR_CODE = "bad_http_request"
_MAX_MESSAGE = 200  # what a parser error says, at most (it never quotes the client's bytes)


# Text in quotes, as aiohttp's parser errors quote the client's bytes (repr of a header line).
_QUOTED = re.compile(r"""b?'[^']*'?|b?"[^"]*"?""")
# What may stay quoted: HTTP's own names (aiohttp's "Duplicate 'Content-Length' header").
_HTTP_NAMES = frozenset(v.lower() for v in vars(hdrs).values() if isinstance(v, str))


def _keep_http_name(m: re.Match[str]) -> str:
    quoted = m.group(0).lstrip("b")[1:-1]
    return m.group(0) if quoted.lower() in _HTTP_NAMES else "(...)"


def parser_error_text(exc: BaseException | None, message: str | None = None) -> str:
    """What an HTTP parser error may say, to the client and in the log: its kind, never the
    client's bytes. aiohttp quotes the offending line (`LineTooLong`: a header value's first
    100 bytes, `InvalidHeader`: the whole value, llhttp: the data around the error), and that
    line may be an `Authorization` or `x-api-key` with a key in it, under any scheme, which no
    pattern can recognise: so only the description is kept (issue 31)."""
    if isinstance(exc, LineTooLong):
        return f"a line of the request head is longer than {exc.args[1]} bytes"
    if isinstance(exc, InvalidHeader):
        return "a header's name or value is not valid"
    if isinstance(exc, InvalidURLError):  # its message is the target itself
        return "the request target is not a valid URL"
    text = message or getattr(exc, "message", None) or "bad request"
    # llhttp: "<what>:\n\n  b'<data>'\n  ^": the first line says what.
    text = text.strip().split("\n", 1)[0].strip().rstrip(":")
    return scrub(_QUOTED.sub(_keep_http_name, text))[:_MAX_MESSAGE] or "bad request"


def _raw_response(status: int, reason: str, body: bytes) -> bytes:
    head = f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\n"
    head += f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    return head.encode() + body


class StallGuard:
    """`client_stall_s` for one connection (both doors: `_Protocol`, router/edge/lean_door.py):
    once the transport's write buffer is over its high-water mark, a client that then takes no
    byte of it for `stall_s` has its connection aborted; one that takes some, however slowly,
    gets another period."""

    __slots__ = ("_stall_s", "_timer", "_queued", "_transport")

    def __init__(self, stall_s: float) -> None:
        self._stall_s = stall_s
        self._timer: asyncio.TimerHandle | None = None
        self._queued = 0  # bytes queued for the client when the timer was armed
        self._transport: asyncio.Transport | None = None

    @property
    def armed(self) -> bool:
        return self._timer is not None

    def paused(self, transport: asyncio.Transport) -> None:
        """The transport paused writing (its buffer is over the high-water mark)."""
        if self._stall_s > 0 and self._timer is None:
            self._transport = transport
            self._arm(transport)

    def _arm(self, transport: asyncio.Transport) -> None:
        self._queued = transport.get_write_buffer_size()
        self._timer = asyncio.get_running_loop().call_later(self._stall_s, self._stalled)

    def resumed(self) -> None:
        self.cancel()

    def cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._transport = None

    def _stalled(self) -> None:
        self._timer = None
        transport = self._transport
        if transport is None or transport.is_closing():
            return
        if transport.get_write_buffer_size() < self._queued:
            self._arm(transport)  # slow, but it took some: a slow reader is not a stalled one
            return
        log.info(
            "client %s took no bytes for %s s: connection aborted",
            transport.get_extra_info("peername"),
            self._stall_s,
        )
        # abort, not close: close would wait for the buffer to drain, i.e. forever.
        transport.abort()


class _Protocol(web.RequestHandler):
    """One client connection: aiohttp's handler plus the head deadline, the write-stall
    deadline and OpenAI-style bodies for the errors aiohttp answers itself."""

    __slots__ = ("_limits", "_between", "_head_bytes", "_head_timer", "_stall")

    def __init__(self, manager: web.Server, limits: Timeouts, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self._limits = limits
        self._between = True  # waiting for a request head
        self._head_bytes = False  # some of it has come
        self._head_timer: asyncio.TimerHandle | None = None
        self._stall = StallGuard(limits.client_stall_s)

    def __repr__(self) -> str:
        return (
            f"_Protocol(open={self.transport is not None}, awaiting_head={self._between}, "
            f"head_timer={self._head_timer is not None}, stalled={self._stall.armed})"
        )

    # -- the request head ---------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self._arm_head()

    def data_received(self, data: bytes) -> None:
        if self._between and data:
            self._head_bytes = True
            if self._head_timer is None:
                self._arm_head()
        super().data_received(data)

    def _arm_head(self) -> None:
        if self._limits.header_s > 0:
            loop = asyncio.get_running_loop()
            self._head_timer = loop.call_later(self._limits.header_s, self._head_overdue)

    def head_arrived(self) -> None:
        """aiohttp made a request from a whole head (or a parser error): the deadline is met."""
        self._between = self._head_bytes = False
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    async def finish_response(
        self, request: web.BaseRequest, resp: web.StreamResponse, start_time: float | None
    ) -> tuple[web.StreamResponse, bool]:
        try:
            return await super().finish_response(request, resp, start_time)
        finally:
            # The next head's clock starts at its first byte; until then the connection is
            # idle, which aiohttp's keepalive_timeout bounds. A body still coming (answered
            # before it was read: 413, 408) is not a head: aiohttp reads it for at most
            # lingering_time and then closes, or keepalive_timeout bounds what follows.
            self._between = request.content.is_eof()

    def _head_overdue(self) -> None:
        self._head_timer = None
        if not self._between or self.transport is None:
            return
        if self._head_bytes:
            err = RequestTimeout(
                f"the request head did not arrive within {self._limits.header_s} s"
            )
            self.transport.write(_raw_response(408, "Request Timeout", err.body()))
        log.debug("closing a connection whose request head is overdue: %r", self)
        self.force_close()

    # -- a client that takes nothing ----------------------------------------------------------
    def pause_writing(self) -> None:
        super().pause_writing()
        if self.transport is not None:
            self._stall.paused(self.transport)

    def resume_writing(self) -> None:
        super().resume_writing()
        self._stall.resumed()

    def connection_lost(self, exc: BaseException | None) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        self._stall.cancel()
        super().connection_lost(exc)

    # -- the errors aiohttp answers itself ----------------------------------------------------
    def handle_error(
        self,
        request: web.BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        err: RouterError
        if status == 504:  # a handler's TimeoutError that nothing caught
            err = DeadlineExceeded("the request timed out in the router")
        elif status >= 500:
            self.log_exception("Error handling request from %s", request.remote, exc_info=exc)
            err = HTTPRefusal(status, INTERNAL_ERROR_MESSAGE, type_="internal_error")
        else:
            text = parser_error_text(exc, message)
            # Junk from the network is routine: no traceback in the log for each one; and
            # neither the log nor the answer quotes the client's bytes (parser_error_text).
            log.debug("bad request from %s: %s: %s", request.remote, type(exc).__name__, text)
            code = _PARSER_ERROR_CODE
            if isinstance(exc, ContentEncodingError):
                code = "bad_content_encoding"
            err = HTTPRefusal(status, f"the request is not valid HTTP: {text}", code=code)
        if request.writer.output_size > 0:  # as aiohttp: too late for another response
            raise ConnectionError("the response has started; cannot send an error")
        resp = error_response(err)
        resp.force_close()
        return resp

    def log_exception(self, *args: Any, **kw: Any) -> None:
        # aiohttp reads on after a response (lingering close); a body it could not decode
        # raises again there. That is the client's fault and already answered: no traceback.
        exc = kw.get("exc_info")
        if isinstance(exc, web.RequestPayloadError):
            log.debug("undecodable request body, connection closed: %r", exc)
            return
        super().log_exception(*args, **kw)


class _Server(web.Server):
    """aiohttp's low-level server, making `_Protocol`s."""

    def __init__(
        self,
        handler: Any,
        *,
        limits: Timeouts,
        loop: asyncio.AbstractEventLoop,
        request_factory: Any,
        handler_cancellation: bool,
        lean: LeanRoutes | None = None,
        **protocol_kwargs: Any,
    ) -> None:
        def made_request(message: Any, payload: Any, protocol: Any, writer: Any, task: Any) -> Any:
            if isinstance(protocol, _Protocol):
                protocol.head_arrived()
            return request_factory(message, payload, protocol, writer, task)

        super().__init__(
            handler,
            request_factory=made_request,
            handler_cancellation=handler_cancellation,
            loop=loop,
            **protocol_kwargs,
        )
        self.limits = limits
        self.protocol_loop = loop
        self.protocol_kwargs = protocol_kwargs
        self.closing = False
        # The lean front door (router/edge/lean_door.py), when on: its connections, until one
        # is handed to aiohttp (then aiohttp's own list has it).
        self.lean = lean
        self.doors: set[LeanDoor] = set()

    def connection_made(self, handler: web.RequestHandler, transport: asyncio.Transport) -> None:
        super().connection_made(handler, transport)
        if self.closing:
            # Accepted after the sites stopped (the listening socket's accepts run as tasks a
            # loop turn or two later): aiohttp's shutdown has taken its list of connections, or
            # clears it when done, so nothing would ever close this one, and in a process that
            # goes on (tests, an embedding) its socket is left to the garbage collector.
            transport.abort()

    def pre_shutdown(self) -> None:
        self.closing = True  # the sites have stopped: from here a new connection is refused
        super().pre_shutdown()
        for door in list(self.doors):
            door.close()

    async def shutdown(self, timeout: float | None = None) -> None:  # noqa: ASYNC109 (aiohttp's)
        doors = [door.shutdown(timeout) for door in list(self.doors)]
        await asyncio.gather(super().shutdown(timeout), *doors)
        self.doors.clear()

    def __call__(self) -> asyncio.Protocol:  # type: ignore[override]  # a lean door, or aiohttp's
        if self.lean is None:
            return self.aiohttp_protocol()
        return LeanDoor(
            self.lean,
            self.limits,
            StallGuard(self.limits.client_stall_s),
            self.aiohttp_protocol,
            self.doors,
            lambda: self.closing,
        )

    def aiohttp_protocol(self) -> _Protocol:
        return _Protocol(self, self.limits, loop=self.protocol_loop, **self.protocol_kwargs)


def _adopt(server: web.Server, limits: Timeouts, lean: LeanRoutes | None = None) -> _Server:
    """`server` (made by `AppRunner`) rebuilt as a `_Server` with the same handler, factory
    and protocol arguments."""
    if type(server) is not web.Server:
        raise AiohttpChanged(
            f"AppRunner made a {type(server).__qualname__}, not a web.Server: "
            "router/edge/server.py must be updated for this aiohttp version"
        )
    kwargs = aiohttp_private(server, "_kwargs", dict)
    loop = aiohttp_private(server, "_loop", asyncio.AbstractEventLoop)
    return _Server(
        server.request_handler,
        limits=limits,
        loop=loop,
        request_factory=server.request_factory,
        handler_cancellation=server.handler_cancellation,
        lean=lean,
        **kwargs,
    )


class RouterRunner(web.AppRunner):
    """`AppRunner` whose connections are bounded by `timeouts` (see the module docstring).

    `handler_cancellation`: a client that disconnects cancels its request at once, so both
    upstream legs are closed and its reservation released without waiting for the workers.
    """

    __slots__ = ("timeouts",)

    def __init__(
        self, app: web.Application, timeouts: Timeouts, *, shutdown_timeout: float = 10.0
    ) -> None:
        super().__init__(
            app,
            handler_cancellation=True,
            access_log=None,
            keepalive_timeout=timeouts.keepalive_s,
            shutdown_timeout=shutdown_timeout,
        )
        self.timeouts = timeouts

    async def _make_server(self) -> web.Server:
        return _adopt(await super()._make_server(), self.timeouts, self.app.get(LEAN_ROUTES))


async def stop_accepting(sites: list[web.BaseSite]) -> None:
    """Stop taking connections on `sites`, and let those already taken become connections,
    before the listening sockets close.

    asyncio's selector loop accepts in a reader callback and builds each connection's transport
    in a task one loop turn later. Closed in between, the server refuses the build
    (`Server._attach` asserts it is open, CPython 3.11): the transport is left half made, holding
    the accepted socket, with no one to read or close it, and its client waits for an answer
    until the garbage collector closes the socket (tests/router/edge/test_shutdown_accepts.py).
    With the accept callback removed first, one turn lets the builds already queued finish;
    those connections are then served or refused like any other. uvloop builds a transport as
    it accepts: removing a reader it never added is a no-op there."""
    loop = asyncio.get_running_loop()
    for site in sites:
        # asyncio's Server or uvloop's (not an AbstractServer): only its sockets are read.
        server = aiohttp_private(site, "_server", object, optional=True)
        for sock in getattr(server, "sockets", None) or ():
            with contextlib.suppress(OSError, RuntimeError, ValueError):  # the shutdown goes on
                loop.remove_reader(sock.fileno())
    for _ in range(2):  # the builds queued by the last accept callback, and their callbacks
        await asyncio.sleep(0)


@contextlib.asynccontextmanager
async def serving(
    app: web.Application,
    host: str,
    port: int,
    timeouts: Timeouts,
    *,
    shutdown_timeout: float = 10.0,
    backlog: int = 4096,
) -> AsyncIterator[RouterRunner]:
    """Serve `app` on `host:port` (0: any free port, see `runner.addresses`) until exit; then
    shut down gracefully: the router's own shutdown first when the app has one
    (router/edge/shutdown.py: refuse new work, let streams finish up to the grace period, end the
    rest with an error frame), then aiohttp's (whatever still runs after `shutdown_timeout`
    is cancelled)."""
    from router.edge.shutdown import SHUTDOWN

    runner = RouterRunner(app, timeouts, shutdown_timeout=shutdown_timeout)
    await runner.setup()
    try:
        # aiohttp's default accept queue is 128: a burst of clients beyond it is dropped by the
        # kernel and each retries its handshake after 1, 2, 4, 8... s.
        await web.TCPSite(runner, host, port, backlog=backlog).start()
        yield runner
    finally:
        await stop_accepting(list(runner.sites))
        shutdown = app.get(SHUTDOWN)
        if shutdown is not None:
            await shutdown.stop(runner.sites)
        await runner.cleanup()  # a connection accepted late is closed at once (`_Server`)
