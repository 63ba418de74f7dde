"""The splice decode transport (router/relay/splice.py): its HTTP/1.1 client against scripted raw
workers, `relay_splice` behind a real aiohttp server read by a raw socket, aiohttp and the
openai client, and the whole router with `relay: splice` in front of the simulated workers.

No timed assertions: waits are bounded only by generous timeouts.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web
from openai import AsyncOpenAI

from router.config import ConfigError, settings_from_mapping
from router.relay.aiohttp_relay import RelayResult, count_tokens
from router.relay.splice import relay_splice
from router.relay.upstream_pool import (
    SpliceConnectError,
    SpliceIdleTimeout,
    SplicePool,
    SpliceResponse,
)
from router.request.resume import sent_text
from tests.conftest import MODEL, sim_cluster

Script = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
WAIT = 30.0  # generous bound for anything that must happen "soon" on a loaded machine


def sse_event(text: str, chat: bool = True) -> bytes:
    if chat:
        obj = {"choices": [{"index": 0, "delta": {"content": text}}]}
    else:
        obj = {"choices": [{"index": 0, "text": text}]}
    return b"data: " + orjson.dumps(obj) + b"\n\n"


DONE = b"data: [DONE]\n\n"
SSE_HEAD = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
)


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


async def read_request(reader: asyncio.StreamReader) -> bytes | None:
    """One request's body, or None when the router closed the connection."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except (asyncio.IncompleteReadError, ConnectionError):
        return None
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":", 1)[1])
    return await reader.readexactly(length)


class Upstream:
    """A scripted raw worker: each connection runs `script`; it records what it saw."""

    def __init__(self, script: Script) -> None:
        self.script = script
        self.connections = 0
        self.closed = asyncio.Event()  # a connection saw the router close it
        self.server: asyncio.Server | None = None
        self.writers: list[asyncio.StreamWriter] = []
        self.tasks: set[asyncio.Task[Any]] = set()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self.writers.append(writer)
        task = asyncio.current_task()
        assert task is not None
        self.tasks.add(task)
        try:
            await self.script(reader, writer)
            await reader.read()  # until the router closes
            self.closed.set()
        except (ConnectionError, asyncio.IncompleteReadError):
            self.closed.set()
        finally:
            writer.close()

    async def stop(self) -> None:
        assert self.server is not None
        self.server.close()
        for writer in self.writers:
            writer.transport.abort()  # the scripts' reads end; no task is cancelled
        if self.tasks:
            await asyncio.wait(self.tasks, timeout=WAIT)

    @property
    def url(self) -> str:
        assert self.server is not None
        port = self.server.sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}/v1/chat/completions"


@contextlib.asynccontextmanager
async def upstream(script: Script) -> AsyncIterator[Upstream]:
    up = Upstream(script)
    up.server = await asyncio.start_server(up._serve, "127.0.0.1", 0)
    try:
        yield up
    finally:
        await up.stop()


class Front:
    """An aiohttp server whose one route relays an upstream stream with relay_splice."""

    def __init__(self, pool: SplicePool, url: str, idle_s: float = 60.0) -> None:
        self.pool, self.upstream_url, self.idle_s = pool, url, idle_s
        self.results: list[RelayResult] = []
        self.responses: list[SpliceResponse] = []
        self.first_tokens = 0
        self.token_totals: list[int] = []
        self.tokens_due = 0  # what tokens() returns: 0 = hear every forwarded read
        self.finished = asyncio.Event()
        self.started = asyncio.Event()  # the upstream answer's head is in
        self.cancelled = False
        self.on_first_token: Callable[[], None] | None = None
        self.client_transport: asyncio.BaseTransport | None = None  # the last client's

    async def handle(self, request: web.Request) -> web.StreamResponse:
        resp = await self.pool.post(
            self.upstream_url,
            await request.read(),
            {"Content-Type": "application/json"},
            connect_s=5.0,
            idle_s=self.idle_s,
        )
        self.responses.append(resp)
        self.started.set()
        client = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await client.prepare(request)
        self.client_transport = request.transport
        try:
            result = await relay_splice(
                resp,
                client,
                chat=True,
                clock=asyncio.get_running_loop().time,
                observer=self,
            )
            self.results.append(result)
            if result.completed:
                await client.write_eof()
            return client
        except asyncio.CancelledError:
            self.cancelled = True
            raise
        finally:
            resp.close()
            self.finished.set()

    def first_token(self) -> None:  # RelayObserver
        self.first_tokens += 1
        if self.on_first_token is not None:
            self.on_first_token()

    def tokens(self, total: int) -> int:  # RelayObserver
        self.token_totals.append(total)
        return self.tokens_due


@contextlib.asynccontextmanager
async def front(
    url: str, idle_s: float = 60.0, handler_cancellation: bool = True
) -> AsyncIterator[tuple[Front, str, SplicePool]]:
    pool = SplicePool(max_idle=4)
    f = Front(pool, url, idle_s)
    app = web.Application()
    app.router.add_post("/v1/chat/completions", f.handle)
    runner = web.AppRunner(app, handler_cancellation=handler_cancellation, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        yield f, f"http://127.0.0.1:{port}", pool
    finally:
        await runner.cleanup()
        await pool.close()


async def raw_post(base: str, rcvbuf: int | None = None) -> tuple[asyncio.StreamReader, Any]:
    host, port = base.removeprefix("http://").split(":")
    sock = socket.socket()
    if rcvbuf is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, (host, int(port)))
    reader, writer = await asyncio.open_connection(sock=sock, limit=2**24)
    body = b'{"stream": true}'
    writer.write(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
    )
    return reader, writer


async def read_chunked(reader: asyncio.StreamReader) -> tuple[bytes, list[bytes]]:
    """The raw response's head and its chunks, up to and including the terminating chunk."""
    head = await reader.readuntil(b"\r\n\r\n")
    assert b"transfer-encoding: chunked" in head.lower()
    chunks: list[bytes] = []
    while True:
        size = int((await reader.readuntil(b"\r\n"))[:-2], 16)
        data = await reader.readexactly(size + 2)
        assert data.endswith(b"\r\n")
        if size == 0:
            return head, chunks
        chunks.append(data[:-2])


TEXT = [f"tok{i} " for i in range(40)] + ["é✓ ", "last"]
SSE_BODY = b"".join(sse_event(t) for t in TEXT) + DONE


def stream_script(pieces: list[bytes], *, done: bool = True, gap: float = 0.0) -> Script:
    """Answer each request with `pieces` as chunked SSE, each piece its own write."""

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while await read_request(reader) is not None:
            writer.write(SSE_HEAD)
            for piece in pieces:
                writer.write(chunk(piece))
                await writer.drain()
                await asyncio.sleep(gap)
            if done:
                writer.write(b"0\r\n\r\n")
                await writer.drain()
            else:
                writer.close()
                return

    return script


def awkward_split(body: bytes) -> list[bytes]:
    """Cut an SSE body at every awkward place: mid-event, mid-marker, mid-UTF-8."""
    cuts, pos, step = [], 0, 1
    while pos < len(body):
        cuts.append(body[pos : pos + step])
        pos += step
        step = step * 3 % 97 + 1
    return cuts


# -- relay_splice end to end ------------------------------------------------------------------
async def test_raw_client_gets_whole_events_and_a_correct_chunked_end() -> None:
    async with (
        upstream(stream_script(awkward_split(SSE_BODY))) as up,
        front(up.url) as (
            f,
            base,
            _,
        ),
    ):
        reader, writer = await raw_post(base)
        head, chunks = await asyncio.wait_for(read_chunked(reader), WAIT)
        writer.close()
        assert head.startswith(b"HTTP/1.1 200")
        assert b"".join(chunks) == SSE_BODY
        assert all(c.endswith(b"\n\n") for c in chunks)  # only whole events went out
        await asyncio.wait_for(f.finished.wait(), WAIT)
        (result,) = f.results
        assert result.completed and not result.client_gone and result.upstream_error is None
        assert result.tokens == len(TEXT) == count_tokens(SSE_BODY, True)
        assert b"".join(result.chunks) == SSE_BODY
        assert sent_text(result.chunks, True) == ("".join(TEXT), len(TEXT))
        assert f.first_tokens == 1
        assert f.token_totals == sorted(f.token_totals) and f.token_totals[-1] == len(TEXT)


async def test_one_chunk_reads_go_out_as_they_came_and_the_observer_hears_past_its_due() -> None:
    """One event per chunk, one chunk per read (a streaming worker): the client gets the same
    events (the worker's chunk forwarded as it is), and an observer that asked to hear again
    only past 25 tokens is not called for the reads in between."""
    events = [sse_event(t) for t in TEXT] + [DONE]
    async with (
        upstream(stream_script(events, gap=0.002)) as up,
        front(up.url) as (f, base, _),
    ):
        f.tokens_due = 25
        reader, writer = await raw_post(base)
        head, chunks = await asyncio.wait_for(read_chunked(reader), WAIT)
        writer.close()
        await asyncio.wait_for(f.finished.wait(), WAIT)
    assert b"".join(chunks) == SSE_BODY and all(c.endswith(b"\n\n") for c in chunks)
    (result,) = f.results
    assert result.completed and result.tokens == len(TEXT)
    totals = f.token_totals
    assert [t for t in totals if t <= 25] == totals[:1]  # the first read's call, then silence
    # past it: one call a read, the [DONE] read too
    assert totals[-1] == len(TEXT) and len(totals) <= 1 + (len(TEXT) - 25) + 1


async def test_the_first_token_is_on_the_wire_before_its_bookkeeping() -> None:
    """The first token goes to the client before the observer's first-token work (TTFT
    recorded, the KV handed over, the deadline moved: ~0.1 ms the client need not wait for).
    Over loopback a write lands in the reader's socket within the send, and the client's
    reader cannot run while the relay's callback does: a peek at the socket from inside the
    observer sees exactly what was written before it."""
    events = [sse_event(t) for t in TEXT] + [DONE]
    async with (
        upstream(stream_script(events, gap=0.002)) as up,
        front(up.url) as (f, base, _),
    ):
        reader, writer = await raw_post(base)
        sock = writer.get_extra_info("socket")
        peek = socket.socket(fileno=socket.dup(sock.fileno()))
        seen: list[bytes] = []
        f.on_first_token = lambda: seen.append(peek.recv(1 << 16, socket.MSG_PEEK))
        try:
            _, chunks = await asyncio.wait_for(read_chunked(reader), WAIT)
        finally:
            writer.close()
            peek.close()
        await asyncio.wait_for(f.finished.wait(), WAIT)
    assert b"".join(chunks) == SSE_BODY
    (peeked,) = seen
    assert events[0] in peeked, peeked


async def test_aiohttp_and_openai_clients_read_the_spliced_stream() -> None:
    async with (
        upstream(stream_script([SSE_BODY[:100], SSE_BODY[100:]])) as up,
        front(up.url) as (f, base, pool),
    ):
        async with aiohttp.ClientSession() as s:
            for _ in range(2):  # twice: the second rides the pooled upstream connection
                async with s.post(base + "/v1/chat/completions", json={"stream": True}) as r:
                    assert r.status == 200
                    assert await r.read() == SSE_BODY
        oai = AsyncOpenAI(base_url=base + "/v1", api_key="none", max_retries=0)
        try:
            stream = await oai.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}], stream=True
            )
            text = "".join([c.choices[0].delta.content or "" async for c in stream])
        finally:
            await oai.close()
        assert text == "".join(TEXT)
        assert len(f.results) == 3 and all(r.completed for r in f.results)
        assert up.connections == 1, "keep-alive: one upstream connection for three streams"
        assert "open=1" in repr(pool)


async def test_upstream_cut_mid_event_holds_the_partial_event() -> None:
    whole = sse_event("a") + sse_event("b")
    async with (
        upstream(stream_script([whole + sse_event("c")[:9]], done=False)) as up,
        front(up.url) as (f, base, pool),
    ):
        reader, writer = await raw_post(base)
        await asyncio.wait_for(f.finished.wait(), WAIT)
        writer.close()
        (result,) = f.results
        assert not result.completed and result.upstream_error
        assert b"".join(result.chunks) == whole and result.tokens == 2
        assert "open=0" in repr(pool)


async def test_idle_deadline_ends_a_silent_stream_and_closes_upstream() -> None:
    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(SSE_HEAD + chunk(sse_event("a")))
        await writer.drain()  # ...and then nothing

    async with upstream(script) as up, front(up.url, idle_s=0.3) as (f, base, _):
        reader, writer = await raw_post(base)
        await asyncio.wait_for(f.finished.wait(), WAIT)
        writer.close()
        (result,) = f.results
        assert result.upstream_error and "no byte" in result.upstream_error
        assert result.tokens == 1 and not result.completed
        await asyncio.wait_for(up.closed.wait(), WAIT)


async def test_idle_deadline_while_waiting_for_the_head() -> None:
    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)

    async with upstream(script) as up:
        pool = SplicePool()
        with pytest.raises(SpliceIdleTimeout) as info:
            await asyncio.wait_for(pool.post(up.url, b"{}", {}, connect_s=5.0, idle_s=0.2), WAIT)
        assert isinstance(info.value, aiohttp.ClientConnectionError)
        await asyncio.wait_for(up.closed.wait(), WAIT)
        await pool.close()


async def test_a_slow_but_live_stream_is_not_idle() -> None:
    pieces = [sse_event(str(i)) for i in range(6)] + [DONE]
    async with (
        upstream(stream_script(pieces, gap=0.1)) as up,
        front(up.url, idle_s=0.35) as (
            f,
            base,
            _,
        ),
    ):
        reader, _w = await raw_post(base)
        _, chunks = await asyncio.wait_for(read_chunked(reader), WAIT)
        _w.close()
        assert b"".join(chunks) == b"".join(pieces)
        await asyncio.wait_for(f.finished.wait(), WAIT)
        assert f.results[0].completed


@pytest.mark.parametrize("handler_cancellation", [True, False])
async def test_client_gone_closes_upstream_without_waiting_for_a_chunk(
    handler_cancellation: bool,
) -> None:
    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(SSE_HEAD + chunk(sse_event("a")))
        await writer.drain()  # then silence: only the watchdog can notice the client left

    async with (
        upstream(script) as up,
        front(up.url, idle_s=120.0, handler_cancellation=handler_cancellation) as (f, base, pool),
    ):
        reader, writer = await raw_post(base)
        await asyncio.wait_for(reader.readuntil(b"\n\n"), WAIT)
        writer.close()
        await asyncio.wait_for(up.closed.wait(), WAIT)
        await asyncio.wait_for(f.finished.wait(), WAIT)
        if handler_cancellation:
            assert f.cancelled
        else:
            (result,) = f.results
            assert result.client_gone and result.upstream_error is None
        assert "open=0" in repr(pool)


async def test_a_token_for_a_client_gone_since_the_head_is_not_its_first_token() -> None:
    """The client takes the head and hangs up; the worker's first token comes after: the relay
    ends as the client's leaving, and the observer never hears of a first token (no TTFT, no
    KV hand-over recorded for an answer nobody got: the release clears its stranded entry)."""
    client_left = asyncio.Event()

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(SSE_HEAD)
        await writer.drain()
        await client_left.wait()
        writer.write(chunk(sse_event("a")))
        await writer.drain()  # then silence, until the router drops the connection

    async with (
        upstream(script) as up,
        front(up.url, handler_cancellation=False) as (f, base, pool),
    ):
        reader, writer = await raw_post(base)
        await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), WAIT)  # the head
        writer.close()
        for _ in range(int(WAIT / 0.01)):  # until the router's side has seen it go
            if f.client_transport is not None and f.client_transport.is_closing():
                break
            await asyncio.sleep(0.01)
        assert f.client_transport is not None and f.client_transport.is_closing()
        client_left.set()
        await asyncio.wait_for(f.finished.wait(), WAIT)
        await asyncio.wait_for(up.closed.wait(), WAIT)
    (result,) = f.results
    assert result.client_gone and result.upstream_error is None
    assert f.first_tokens == 0 and result.first_token_at is None and not result.chunks
    assert "open=0" in repr(pool)


async def test_back_pressure_pauses_upstream_until_the_client_drains() -> None:
    big = [sse_event("x" * 60_000) for _ in range(60)]  # ~3.6 MB, far over every buffer
    async with upstream(stream_script(big + [DONE])) as up, front(up.url) as (f, base, _):
        reader, writer = await raw_post(base, rcvbuf=4096)
        # The client reads nothing until the relay had to pause the worker.
        await asyncio.wait_for(f.started.wait(), WAIT)
        conn = f.responses[0]._conn
        for _ in range(int(WAIT / 0.01)):
            if conn.pauses:
                break
            await asyncio.sleep(0.01)
        assert conn.pauses >= 1
        _, chunks = await asyncio.wait_for(read_chunked(reader), WAIT)
        writer.close()
        assert b"".join(chunks) == b"".join(big) + DONE
        await asyncio.wait_for(f.finished.wait(), WAIT)
        assert f.results[0].completed and f.results[0].tokens == len(big)


async def test_cancelling_the_relay_closes_upstream() -> None:
    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(SSE_HEAD + chunk(sse_event("a")))
        await writer.drain()

    async with upstream(script) as up, front(up.url, handler_cancellation=False) as (f, base, _):
        reader, writer = await raw_post(base)
        await asyncio.wait_for(reader.readuntil(b"\n\n"), WAIT)
        handler = next(
            t
            for t in asyncio.all_tasks()
            if "handle" in repr(t.get_coro()) and t is not asyncio.current_task()
        )
        handler.cancel()
        await asyncio.wait_for(up.closed.wait(), WAIT)
        writer.close()


# -- the client: bodies, keep-alive, abort ----------------------------------------------------
def body_script(kind: str, payload: bytes) -> Script:
    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while await read_request(reader) is not None:
            if kind == "length":
                writer.write(
                    b"HTTP/1.1 400 Bad Request\r\nContent-Length: %d\r\n\r\n" % len(payload)
                )
                for i in range(0, len(payload), 7):  # the body in small pieces
                    writer.write(payload[i : i + 7])
                    await writer.drain()
            else:
                writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
                for i in range(0, len(payload), 5):
                    writer.write(chunk(payload[i : i + 5]))
                    await writer.drain()
                writer.write(b"0\r\n\r\n")
            await writer.drain()

    return script


@pytest.mark.parametrize("kind", ["length", "chunked"])
async def test_read_whole_bodies_and_reuse_the_connection(kind: str) -> None:
    payload = orjson.dumps({"error": {"message": "bad", "param": "x"}, "pad": "é" * 300})
    payload += b"\n\n" * 3  # no SSE cutting on a read body
    async with upstream(body_script(kind, payload)) as up:
        pool = SplicePool()
        for _ in range(3):
            resp = await asyncio.wait_for(
                pool.post(up.url, b'{"a": 1}', {"X-Request-Id": "r"}, connect_s=5, idle_s=10),
                WAIT,
            )
            assert resp.status == (400 if kind == "length" else 200)
            assert await asyncio.wait_for(resp.read(), WAIT) == payload
            resp.close()
        assert up.connections == 1
        await pool.close()


async def test_closing_an_unfinished_answer_drops_the_connection() -> None:
    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(SSE_HEAD + chunk(sse_event("a")))
        await writer.drain()

    async with upstream(script) as up:
        pool = SplicePool()
        resp = await asyncio.wait_for(pool.post(up.url, b"{}", {}, connect_s=5, idle_s=10), WAIT)
        resp.close()  # vLLM's abort signal
        await asyncio.wait_for(up.closed.wait(), WAIT)
        resp2 = None
        with contextlib.suppress(Exception):  # a new request needs a new connection
            resp2 = await asyncio.wait_for(
                pool.post(up.url, b"{}", {}, connect_s=5, idle_s=10), WAIT
            )
        assert up.connections == 2
        if resp2 is not None:
            resp2.close()
        await pool.close()


async def test_connect_errors_are_aiohttp_connection_errors() -> None:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()  # nothing listens there now
    pool = SplicePool()
    with pytest.raises(SpliceConnectError) as info:
        await pool.post(f"http://127.0.0.1:{port}/x", b"{}", {}, connect_s=5, idle_s=10)
    assert isinstance(info.value, aiohttp.ClientConnectionError)
    await pool.close()


def test_relay_setting_is_validated() -> None:
    assert settings_from_mapping({}).upstream.relay == "splice"  # the default
    aiohttp = settings_from_mapping({"upstream": {"relay": "aiohttp"}})
    assert aiohttp.upstream.relay == "aiohttp"
    with pytest.raises(ConfigError, match="relay"):
        settings_from_mapping({"upstream": {"relay": "sendfile"}})


async def test_router_with_aiohttp_relay_streams_and_answers_whole(redis_prefix: str) -> None:
    """The other transport, still a supported setting (and the one https:// workers use)."""
    async with sim_cluster(redis_prefix=redis_prefix, upstream={"relay": "aiohttp"}) as c:
        assert c.parts.splice is None
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": "hello"}],
            "max_tokens": 12,
        }
        async with aiohttp.ClientSession() as s:
            url = c.router_url + "/v1/chat/completions"
            async with s.post(url, json={**body, "stream": True}) as r:
                assert r.status == 200
                raw = await r.read()
            assert raw.endswith(DONE) and count_tokens(raw, True) == 12
            async with s.post(url, json=body) as r:
                assert r.status == 200
                assert (await r.json())["usage"]["completion_tokens"] == 12
        assert await c.reserved_blocks() == {"d0": 0}


# -- the whole router on the splice relay ----------------------------------------------------
async def test_router_with_splice_relay_streams_and_answers_whole(redis_prefix: str) -> None:
    async with sim_cluster(redis_prefix=redis_prefix, upstream={"relay": "splice"}) as c:
        assert c.parts.splice is not None
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": "hello"}],
            "max_tokens": 12,
        }
        async with aiohttp.ClientSession() as s:
            url = c.router_url + "/v1/chat/completions"
            for _ in range(3):
                async with s.post(url, json={**body, "stream": True}) as r:
                    assert r.status == 200
                    raw = await r.read()
                assert raw.endswith(DONE)
                assert count_tokens(raw, True) == 12
                async with s.post(url, json=body) as r:
                    assert r.status == 200
                    answer = await r.json()
                assert answer["usage"]["completion_tokens"] == 12
        # keep-alive: six decode legs, one after another, over very few connections
        assert len(c.parts.splice._all) <= 2
        assert await c.reserved_blocks() == {"d0": 0}


async def test_router_with_splice_relay_aborts_the_decode_when_the_client_leaves(
    redis_prefix: str,
) -> None:
    async with sim_cluster(redis_prefix=redis_prefix, upstream={"relay": "splice"}) as c:
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": "walk away"}],
            "max_tokens": 5000,
            "ignore_eos": True,
            "stream": True,
        }
        async with (
            aiohttp.ClientSession() as s,
            s.post(c.router_url + "/v1/chat/completions", json=body) as r,
        ):
            assert r.status == 200
            await r.content.readuntil(b"\n\n")
        # Closing the upstream connection is vLLM's abort signal; the sim worker honours it.
        for _ in range(int(WAIT / 0.05)):
            state = await c.worker_state("d0")
            if state["resident_sequences"] == 0 and await c.reserved_blocks() == {"d0": 0}:
                break
            await asyncio.sleep(0.05)
        assert (await c.worker_state("d0"))["resident_sequences"] == 0
        assert await c.reserved_blocks() == {"d0": 0}
        assert c.parts.leases.live == {}


async def test_aiohttp_relay_forwards_whole_events_whatever_the_reads() -> None:
    """The default relay, fed an SSE stream in awkward pieces (including reads with no event
    boundary at all), forwards only whole events and in order."""
    from aiohttp import web as _web

    from router.relay.aiohttp_relay import relay_sse

    events = [b'data: {"choices":[{"delta":{"content":" w%d"}}]}\n\n' % i for i in range(6)]
    stream = b"".join(events) + b"data: [DONE]\n\n"
    pieces = [stream[i : i + 7] for i in range(0, len(stream), 7)]  # never aligned to events

    async def upstream(request: _web.Request) -> _web.StreamResponse:
        resp = _web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for p in pieces:
            await resp.write(p)
            await asyncio.sleep(0)
        await resp.write_eof()
        return resp

    written: list[bytes] = []
    heard: list[int] = []  # the token total the observer had heard of at each write

    class Client:
        async def write(self, data: bytes) -> None:
            written.append(bytes(data))
            heard.append(totals[-1] if totals else 0)

    class Observer:  # RelayObserver: what the client had when the first token was heard of
        def first_token(self) -> None:
            seen.append(b"".join(written))

        def tokens(self, total: int) -> int:
            totals.append(total)
            return 0  # hear every read

    seen: list[bytes] = []
    totals: list[int] = []
    app = _web.Application()
    app.router.add_get("/", upstream)
    runner = _web.AppRunner(app)
    await runner.setup()
    await _web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        async with (
            aiohttp.ClientSession() as s,
            s.get(f"http://127.0.0.1:{runner.addresses[0][1]}/") as r,
        ):
            result = await relay_sse(
                r,
                Client(),  # type: ignore[arg-type]
                chat=True,
                clock=lambda: 0.0,
                observer=Observer(),
            )
    finally:
        await runner.cleanup()
    assert result.completed and result.tokens == 6
    assert b"".join(written) == stream
    assert all(w.endswith(b"\n\n") for w in written)  # every write ends on an event boundary
    # The first token was the client's before its bookkeeping (as the splice relay's)
    (had,) = seen
    assert had.startswith(events[0]), had
    # ...but a write's tokens were counted towards the reservation before the write, which may
    # wait for a slow client while the worker's KV grows anyway
    assert heard == [count_tokens(b"".join(written[: i + 1]), True) for i in range(len(written))]
