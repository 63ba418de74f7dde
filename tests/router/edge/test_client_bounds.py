"""The client side of the router bounded (router/edge/server.py, the body read, the decode leg when
the client is gone): slow or silent clients, junk bytes, undecodable bodies, clients that stop
reading or hang up early. Raw sockets on loopback against the real router and simulated
workers; every wait is bounded and generous, no assertion is about time.
"""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import socket
import zlib
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web

from router.config import ConfigError, Timeouts, settings_from_mapping
from router.edge.app import SERVING
from router.edge.server import RouterRunner, _adopt, _Protocol, _Server, serving
from router.relay.upstream_pool import HIGH_WATER, SplicePool
from tests.conftest import MODEL, SimCluster, sim_cluster
from tests.router.relay.test_splice import SSE_HEAD, chunk, read_request, sse_event, upstream

WAIT = 30.0  # generous bound for anything that must happen "soon" on a loaded machine
CHAT = "/v1/chat/completions"


def _addr(c: SimCluster) -> tuple[str, int]:
    host, port = c.router_url.removeprefix("http://").split(":")
    return host, int(port)


async def _connect(
    c: SimCluster, rcvbuf: int | None = None
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    sock = socket.socket()
    if rcvbuf is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, _addr(c))
    # A small limit: a client that stops reading makes its socket stop reading too.
    return await asyncio.open_connection(sock=sock, limit=4096)


async def _read_to_eof(reader: asyncio.StreamReader) -> bytes:
    """Everything until the router closes the connection (a reset counts as closed)."""
    data = b""
    try:
        async with asyncio.timeout(WAIT):
            while chunk_ := await reader.read(65536):
                data += chunk_
    except ConnectionError:
        pass
    return data


def _parse(raw: bytes) -> tuple[int, dict[str, str], bytes]:
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ")[1])
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    return status, headers, body


def _assert_openai_error(raw: bytes, status: int | None = None) -> dict[str, Any]:
    got, headers, body = _parse(raw)
    assert 400 <= got < 500 if status is None else got == status, raw[:300]
    assert headers["content-type"].startswith("application/json"), headers
    err = orjson.loads(body[: int(headers["content-length"])])["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["message"] and err["type"] == "invalid_request_error"
    return dict(err)


def _stream_request(max_tokens: int = 20000, **headers: str) -> bytes:
    body = orjson.dumps(
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": "tell me a long story " * 8}],
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "stream": True,
        }
    )
    extra = "".join(f"{k}: {v}\r\n" for k, v in headers.items()).encode()
    return (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"%sContent-Length: %d\r\n\r\n%s" % (extra, len(body), body)
    )


async def _until(check: Any, what: str) -> None:
    """Poll `check()` (async) until true, within WAIT."""
    loop = asyncio.get_running_loop()
    end = loop.time() + WAIT
    while not await check():
        assert loop.time() < end, f"not within {WAIT} s: {what}"
        await asyncio.sleep(0.05)


async def _quiet(c: SimCluster) -> bool:
    """Nothing left anywhere: no reservation, no decode sequence, no busy splice connection."""
    if any((await c.reserved_blocks()).values()) or c.parts.leases.live:
        return False
    for wid, cfg in c.configs.items():
        if cfg.role != "prefill" and (await c.worker_state(wid))["resident_sequences"]:
            return False
    pool = c.parts.splice
    return pool is None or not any(conn.busy for conn in pool._all)


# -- 1. slow and silent heads, slow bodies -------------------------------------------------------


async def test_silent_slow_head_and_idle_keepalive_connections_are_closed() -> None:
    timeouts = {"header_s": 0.5, "keepalive_s": 1.0}
    async with sim_cluster(redis_prefix=None, timeouts=timeouts) as c:
        # Connects and says nothing: closed, no answer owed.
        reader, writer = await _connect(c)
        assert await _read_to_eof(reader) == b""
        writer.close()

        # Slowloris: a header byte at a time, never the end of the head: 408, closed.
        reader, writer = await _connect(c)
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nX-Slow: ")

        async def dribble() -> None:
            with contextlib.suppress(ConnectionError):
                while True:
                    writer.write(b"a")
                    await writer.drain()
                    await asyncio.sleep(0.1)

        task = asyncio.create_task(dribble())
        try:
            err = _assert_openai_error(await _read_to_eof(reader), 408)
        finally:
            task.cancel()
            writer.close()
        assert err["code"] == "request_timeout"

        # A kept-alive connection that goes idle after an answer: closed.
        reader, writer = await _connect(c)
        writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        raw = await _read_to_eof(reader)
        assert _parse(raw)[0] == 200
        writer.close()


async def test_a_body_that_does_not_arrive_gets_408_and_nothing_is_sent_upstream() -> None:
    async with sim_cluster(redis_prefix=None, timeouts={"body_s": 0.5}) as c:
        reader, writer = await _connect(c)
        writer.write(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b'Content-Length: 400\r\n\r\n{"model": '
        )
        err = _assert_openai_error(await _read_to_eof(reader), 408)
        writer.close()
        assert err["code"] == "request_timeout" and err["param"] is None
        assert await c.worker_requests("p0") == [] and await c.worker_requests("d0") == []


def test_client_timeouts_are_settings() -> None:
    t = settings_from_mapping({"timeouts": {"header_s": 3, "client_stall_s": 0}}).timeouts
    assert (t.header_s, t.body_s, t.keepalive_s, t.client_stall_s) == (3, 30.0, 75.0, 0)
    with pytest.raises(ConfigError):
        settings_from_mapping({"timeouts": {"keepalive_s": 0}})
    with pytest.raises(ConfigError):
        settings_from_mapping({"timeouts": {"body_s": -1}})


async def test_the_server_really_runs_our_protocol_on_this_aiohttp() -> None:
    """The one place that reads aiohttp's private state (router/edge/server.py `_adopt`): if an
    aiohttp upgrade moves it, this fails here, not silently in production."""
    app = web.Application()

    async def ok(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    app.router.add_get("/", ok)
    timeouts = Timeouts(keepalive_s=7.0)
    async with serving(app, "127.0.0.1", 0, timeouts) as runner:
        assert isinstance(runner, RouterRunner) and isinstance(runner.server, _Server)
        port = runner.addresses[0][1]
        async with aiohttp.ClientSession() as s, s.get(f"http://127.0.0.1:{port}/") as r:
            assert r.status == 200
            (conn,) = runner.server.connections
            assert type(conn) is _Protocol
            assert conn.keepalive_timeout == 7.0
            assert runner.server.handler_cancellation

    class Other(web.Server):
        pass

    with pytest.raises(RuntimeError, match="router/edge/server.py must be updated"):
        _adopt(Other(lambda _: None), timeouts)  # type: ignore[arg-type, return-value]


# -- 2. junk bytes get OpenAI errors -------------------------------------------------------------


JUNK = {
    "control character in a header": b"GET /health HTTP/1.1\r\nHost: x\r\nX-Bad: a\x01b\r\n\r\n",
    "bad Content-Length": b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1x\r\n\r\n",
    "two Content-Lengths": (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n"
        b"Content-Length: 3\r\n\r\nab"
    ),
    "a 9 KB URL": b"GET /" + b"a" * 9000 + b" HTTP/1.1\r\nHost: x\r\n\r\n",
    "bad method": b"G@T /health HTTP/1.1\r\nHost: x\r\n\r\n",
    "bad request line": b"hello there\r\n\r\n",
    "TLS on the plain port": b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + b"\x00" * 40,
    "header too long": b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"b" * 9000 + b"\r\n\r\n",
}


async def test_http_parser_errors_are_openai_json() -> None:
    async with sim_cluster(redis_prefix=None) as c:
        for name, raw in JUNK.items():
            reader, writer = await _connect(c)
            writer.write(raw)
            answer = await _read_to_eof(reader)
            writer.close()
            err = _assert_openai_error(answer)
            assert err["param"] is None and err["code"] == "bad_http_request", name
        # The router is still fine.
        async with aiohttp.ClientSession() as s, s.get(c.router_url + "/health") as r:
            assert r.status == 200


@pytest.mark.parametrize("encoding", ["gzip", "deflate", "br"])
async def test_undecodable_body_is_400_and_a_gzip_bomb_413(encoding: str) -> None:
    async with sim_cluster(redis_prefix=None, server={"max_body_bytes": 4096}) as c:
        async with aiohttp.ClientSession() as s:
            headers = {"Content-Encoding": encoding, "Content-Type": "application/json"}
            async with s.post(c.router_url + CHAT, data=b"not compressed", headers=headers) as r:
                assert r.status == 400, await r.text()
                assert r.content_type == "application/json"
                err = (await r.json())["error"]
            assert err["param"] is None and err["code"] == "bad_content_encoding"
            assert err["type"] == "invalid_request_error"
            if encoding != "br":
                pack = gzip.compress if encoding == "gzip" else zlib.compress
                bomb = pack(b" " * 2_000_000)
                async with s.post(c.router_url + CHAT, data=bomb, headers=headers) as r:
                    assert r.status == 413
                    assert (await r.json())["error"]["type"] == "invalid_request_error"
                good = pack(orjson.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 3}))
                url = c.router_url + "/v1/completions"
                async with s.post(url, data=good, headers=headers) as r:
                    assert r.status == 200, await r.text()
        assert await c.reserved_blocks() == {"d0": 0}


# -- 4. a client that stops reading ---------------------------------------------------------------


@pytest.mark.parametrize("relay", ["splice", "aiohttp"])
async def test_a_client_that_stops_reading_loses_its_stream_and_reservation(relay: str) -> None:
    async with sim_cluster(
        redis_prefix=None,
        upstream={"relay": relay},
        kv_blocks=20000,
        timeouts={"client_stall_s": 0.5},
    ) as c:
        reader, writer = await _connect(c, rcvbuf=4096)
        writer.write(_stream_request(100_000))
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), WAIT)
        assert head.startswith(b"HTTP/1.1 200")
        # ...and reads nothing more. The decode leg is aborted, the reservation released,
        # the connection dropped.
        await _until(lambda: _quiet(c), "the stalled stream is ended and released")
        (decode,) = [r for r in await c.worker_requests("d0")]
        assert decode["body"]["max_tokens"] == 100_000
        state = await c.worker_state("d0")
        assert state["counters"].get("aborted") == 1, state["counters"]
        await _read_to_eof(reader)  # the router closed it: this ends
        writer.close()


@pytest.mark.parametrize("relay", ["splice", "aiohttp"])
async def test_the_reservation_is_given_back_when_the_decode_ends_not_when_the_client_drains(
    relay: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The whole answer is in: the decode worker holds nothing more for it. A client slow to
    take the last bytes (here: the stream's end waits until the test lets it go) must not keep
    the room reserved meanwhile."""
    ending = asyncio.Event()
    write_eof = web.StreamResponse.write_eof

    async def slow_eof(self: web.StreamResponse, data: bytes = b"") -> None:
        # The router's stream only: the simulated workers answer in this process too.
        request = self._req  # noqa: SLF001 - a test's probe
        if request is not None and SERVING in request.app:
            await ending.wait()
        await write_eof(self, data)

    monkeypatch.setattr(web.StreamResponse, "write_eof", slow_eof)
    async with sim_cluster(redis_prefix=None, upstream={"relay": relay}) as c:
        reader, writer = await _connect(c)
        writer.write(_stream_request(200, Connection="close"))
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), WAIT)
        assert head.startswith(b"HTTP/1.1 200")
        await _until(_no_reservation(c), "the room given back while the stream's end waits")
        assert not ending.is_set()
        ending.set()
        body = await _read_to_eof(reader)
        assert body.endswith(b"0\r\n\r\n") and b"data: [DONE]" in body  # the whole answer
        writer.close()


def _no_reservation(c: SimCluster) -> Any:
    async def check() -> bool:
        return not c.parts.leases.live and not any((await c.reserved_blocks()).values())

    return check


# -- 5. clients that hang up before their stream starts ----------------------------------------


@pytest.mark.parametrize("relay", ["splice", "aiohttp"])
async def test_decode_leg_is_closed_when_the_client_stream_cannot_start(
    relay: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The client went away while its decode leg was being opened: `prepare` fails. The leg
    must be aborted then, not read to its end into memory. aiohttp's door (its `prepare` is
    what fails); the lean door's start is tests/router/edge/test_lean_door.py's."""
    prepare = web.StreamResponse.prepare

    async def gone(self: web.StreamResponse, request: web.BaseRequest) -> Any:
        if SERVING in request.app and self.content_type == "text/event-stream":
            raise aiohttp.ClientConnectionResetError("Cannot write to closing transport")
        return await prepare(self, request)

    monkeypatch.setattr(web.StreamResponse, "prepare", gone)
    n = 8
    async with sim_cluster(
        redis_prefix=None,
        decode=2,
        kv_blocks=50000,
        upstream={"relay": relay},
        server={"front_door": "aiohttp"},
    ) as c:

        async def one() -> None:
            reader, writer = await _connect(c)
            writer.write(_stream_request(20000))
            await _read_to_eof(reader)
            writer.close()

        await asyncio.gather(*(one() for _ in range(n)))
        await _until(lambda: _quiet(c), "every decode leg closed and released")
        aborted = 0
        for wid in ("d0", "d1"):
            aborted += (await c.worker_state(wid))["counters"].get("aborted", 0)
        assert aborted == n
        if c.parts.splice is not None:
            held = sum(len(conn.body) for conn in c.parts.splice._all)
            assert held <= n * (HIGH_WATER + 256 * 1024)


async def test_a_crowd_that_hangs_up_right_after_sending_leaves_nothing_behind(
    redis_prefix: str,
) -> None:
    async with sim_cluster(
        redis_prefix=redis_prefix, prefill=2, decode=2, kv_blocks=100000, time_scale=100.0
    ) as c:

        async def one(i: int) -> None:
            reader, writer = await _connect(c)
            writer.write(_stream_request(20000))
            await writer.drain()
            await asyncio.sleep(i * 0.004)  # spread over the whole request path
            writer.transport.abort()

        await asyncio.gather(*(one(i) for i in range(60)))
        await _until(lambda: _quiet(c), "every abandoned request closed and released")
        assert await c.stranded() == {"p0": 0, "p1": 0}


async def test_splice_holds_at_most_high_water_before_a_sink_attaches() -> None:
    """An answer nobody relays yet (or ever) is not read into memory without bound."""
    payload = sse_event("x" * 1000) * 2000  # ~2 MB

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(SSE_HEAD)
        with contextlib.suppress(ConnectionError):
            for i in range(0, len(payload), 8192):
                writer.write(chunk(payload[i : i + 8192]))
                await writer.drain()
            writer.write(b"0\r\n\r\n")
            await writer.drain()

    async with upstream(script) as up:
        pool = SplicePool()
        resp = await asyncio.wait_for(pool.post(up.url, b"{}", {}, connect_s=5, idle_s=60), WAIT)
        conn = resp._conn
        for _ in range(int(WAIT / 0.02)):
            if conn.paused:
                break
            await asyncio.sleep(0.02)
        assert conn.paused
        assert len(conn.body) <= HIGH_WATER + 256 * 1024  # one socket read past the mark
        resp.close()
        await asyncio.wait_for(up.closed.wait(), WAIT)  # the worker saw the abort
        await pool.close()

    async with upstream(script) as up:  # a whole-body read still gets all of it
        pool = SplicePool()
        resp = await asyncio.wait_for(pool.post(up.url, b"{}", {}, connect_s=5, idle_s=60), WAIT)
        body = await asyncio.wait_for(resp.read(), WAIT)
        assert body == payload
        resp.close()
        await pool.close()


# -- 6. the output-length hint ---------------------------------------------------------------------


async def test_a_non_ascii_digit_hint_is_ignored() -> None:
    async with sim_cluster(redis_prefix=None) as c:
        for hint in ("²", "①", "٣", "9" * 5000, "-5", "300"):
            reader, writer = await _connect(c)
            body = orjson.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 4})
            writer.write(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                b"X-Expected-Output-Tokens: %s\r\nContent-Length: %d\r\n\r\n%s"
                % (hint.encode(), len(body), body)
            )
            raw = await _read_to_eof(reader)
            writer.close()
            assert _parse(raw)[0] == 200, (hint[:10], raw[:400])


async def test_a_connection_accepted_while_shutting_down_is_closed() -> None:
    """The listening socket's accepts run as tasks a loop turn or two after the kernel's: one
    can land while aiohttp's shutdown waits for the requests in progress, after it took its
    list of connections (and it clears that list when done). Such a connection is closed at
    once, not left to the garbage collector (the state machine's 'unclosed transport')."""
    app = web.Application()
    shutting_down = asyncio.Event()

    async def slow(_: web.Request) -> web.Response:
        await asyncio.sleep(1.0)  # keeps aiohttp's shutdown waiting
        return web.Response(text="done")

    async def on_shutdown(_: web.Application) -> None:
        shutting_down.set()

    app.router.add_get("/", slow)
    app.on_shutdown.append(on_shutdown)
    loop = asyncio.get_running_loop()
    ours, theirs = socket.socketpair()
    theirs.setblocking(False)
    async with aiohttp.ClientSession() as session, contextlib.AsyncExitStack() as stack:
        runner = await stack.enter_async_context(serving(app, "127.0.0.1", 0, Timeouts()))
        server = runner.server
        assert isinstance(server, _Server)
        port = runner.addresses[0][1]
        answer = asyncio.create_task(_get_text(session, f"http://127.0.0.1:{port}/"))
        await asyncio.sleep(0.1)  # the request is in progress
        closing = asyncio.create_task(stack.aclose())
        await asyncio.wait_for(shutting_down.wait(), WAIT)
        await asyncio.sleep(0.05)  # aiohttp's shutdown now waits for `slow`
        transport, _ = await loop.connect_accepted_socket(server, ours)
        await asyncio.wait_for(closing, WAIT)
        assert await answer == "done"
    assert transport.is_closing()
    with contextlib.suppress(ConnectionError):
        assert await asyncio.wait_for(loop.sock_recv(theirs, 1024), WAIT) == b""
    theirs.close()


async def _get_text(session: aiohttp.ClientSession, url: str) -> str:
    async with session.get(url) as r:
        return await r.text()
