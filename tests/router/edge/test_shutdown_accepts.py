"""A connection accepted as the server shuts down is served or closed, never left hanging.

asyncio's selector loop accepts in a reader callback and builds the connection's transport in a
task one loop turn later; a listening server closed in between makes that build fail half way
(CPython 3.11 `Server._attach`), and the accepted socket was then held by no one: the client
waited for an answer until the garbage collector closed it (found by the state machine, a
replica killed while clients connected: tests/system/test_state_machine.py).
router/edge/server.py `stop_accepting` removes the accept callback first and lets the queued
builds finish.

The loop turns are lined up exactly: the client's handshake is done before the loop looks
(a blocking connect on loopback), the accept callback runs in the turn after the test's first
yield, and the build's task would run right after the shutdown began.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import socket
import time

from aiohttp import web

from router.config import Timeouts
from router.edge.server import serving


async def _hello(_: web.Request) -> web.Response:
    return web.Response(text="hello")


def _answer_or_close(sock: socket.socket, within_s: float) -> bytes | None:
    """What the server sends before closing (b"" for a bare close); None: nothing within
    `within_s`, the connection still open (the hang)."""
    sock.settimeout(0.05)
    got = b""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            data = sock.recv(65536)
        except TimeoutError:
            continue
        except ConnectionError:
            return got
        if not data:
            return got
        got += data
    return None


async def test_a_connection_accepted_as_the_server_stops_is_not_left_open() -> None:
    assert isinstance(asyncio.get_running_loop(), asyncio.SelectorEventLoop)
    for attempt in range(5):  # the line-up of turns, a few times (each is exact)
        app = web.Application()
        app.router.add_get("/", _hello)
        stack = contextlib.AsyncExitStack()
        runner = await stack.enter_async_context(
            serving(app, "127.0.0.1", 0, Timeouts(), shutdown_timeout=1.0)
        )
        port = runner.addresses[0][1]
        client = socket.create_connection(("127.0.0.1", port))  # in the backlog, not accepted
        try:
            client.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            await asyncio.sleep(0)  # this turn: the accept callback runs after this task
            await asyncio.sleep(0)  # the build's task is queued behind this task now
            await stack.aclose()  # the shutdown begins before the build runs
            # Served before the close, or closed: either way the client is not left waiting.
            outcome = await asyncio.to_thread(_answer_or_close, client, 3.0)
            assert outcome is not None, f"attempt {attempt}: the connection was left open"
        finally:
            client.close()
    gc.collect()  # a half-built transport would warn here (unclosed transport: an error)
