"""The lean front door (router/edge/lean_door.py, `server.front_door: lean`): what it serves
itself, what it hands to aiohttp, and the client bounds it keeps — tried as a client that
sends what it likes would.

The generation flow behind it is the one every other test runs (DR_TEST_FRONT_DOOR=lean runs
the suite through it); here, the door's own promises: the same answers as aiohttp's door, any
request not of the common shape answered by aiohttp exactly as without the lean door, a slow
head a 408, an idle connection closed, a client that leaves mid-stream releasing its room, a
pipelined client answered in order, and a shutdown that lets a stream finish."""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import re
import time
from collections.abc import AsyncIterator
from email.utils import parsedate_to_datetime

import orjson
import pytest
from openai import AsyncOpenAI

from tests.conftest import MODEL, SimCluster, sim_cluster

LEAN = {"server": {"front_door": "lean"}}
CHAT = b"/v1/chat/completions"


def _body(max_tokens: int = 8, stream: bool = False) -> bytes:
    return orjson.dumps(
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": "hello"}],
            "max_tokens": max_tokens,
            "stream": stream,
        }
    )


def _post(body: bytes, path: bytes = CHAT, extra: bytes = b"") -> bytes:
    head = b"POST %s HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n" % path
    return head + b"Content-Length: %d\r\n%s\r\n" % (len(body), extra) + body


async def _read_answer(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    """One HTTP/1.1 answer: status, headers (lower-case names), body (de-chunked)."""
    status_line = await reader.readline()
    status = int(status_line.split()[1])
    headers: dict[str, str] = {}
    while (line := await reader.readline()) not in (b"\r\n", b""):
        name, _, value = line.decode().partition(":")
        headers[name.strip().lower()] = value.strip()
    if "content-length" in headers:
        return status, headers, await reader.readexactly(int(headers["content-length"]))
    body = b""
    if headers.get("transfer-encoding") == "chunked":
        while (size := int((await reader.readline()).strip(), 16)) > 0:
            body += await reader.readexactly(size)
            await reader.readline()
        await reader.readline()
    return status, headers, body


def _server(c: SimCluster):  # type: ignore[no-untyped-def]
    from router.edge.server import LEAN_ROUTES

    assert LEAN_ROUTES in c.app
    servers = [s for s in _SERVERS if s.lean is c.app[LEAN_ROUTES]]
    assert len(servers) == 1
    return servers[0]


_SERVERS: list = []  # type: ignore[type-arg]


@pytest.fixture(autouse=True)
def _record_servers(monkeypatch: pytest.MonkeyPatch) -> None:
    """Note every `_Server` made, to count its connections by door."""
    from router.edge import server as server_module

    real = server_module._Server.__init__

    def init(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        real(self, *args, **kwargs)
        _SERVERS.append(self)

    monkeypatch.setattr(server_module._Server, "__init__", init)
    _SERVERS.clear()


@pytest.fixture
async def lean() -> AsyncIterator[SimCluster]:
    async with sim_cluster(redis_prefix=None, **LEAN) as c:
        yield c


def _addr(c: SimCluster) -> tuple[str, int]:
    host, port = c.router_url.removeprefix("http://").split(":")
    return host, int(port)


@contextlib.asynccontextmanager
async def _connected(
    c: SimCluster,
) -> AsyncIterator[tuple[asyncio.StreamReader, asyncio.StreamWriter]]:
    """A raw connection to the router, closed on the way out."""
    reader, writer = await asyncio.open_connection(*_addr(c))
    try:
        yield reader, writer
    finally:
        writer.close()


async def test_the_same_answers_as_aiohttps_door_and_served_by_the_lean_one(
    lean: SimCluster,
) -> None:
    async with _connected(lean) as (reader, writer):
        writer.write(_post(_body(2)))
        _, headers, _ = await asyncio.wait_for(_read_answer(reader), 10)
    sent = parsedate_to_datetime(headers["date"])  # RFC 9110's Date, as aiohttp sends it
    assert abs(sent.timestamp() - time.time()) < 5
    async with AsyncOpenAI(base_url=lean.router_url + "/v1", api_key="k", max_retries=0) as cl:
        whole = await cl.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=8
        )
        stream = await cl.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=8, stream=True
        )
        streamed = "".join([ch.choices[0].delta.content or "" async for ch in stream if ch.choices])
        text = await cl.completions.create(model=MODEL, prompt="hi", max_tokens=4)
        server = _server(lean)
        assert len(server.doors) == 1  # the openai client's one connection, still the lean door's
        assert not server.connections  # aiohttp has none
    assert whole.choices[0].message.content == streamed  # the toy model: same prompt, same text
    assert whole.usage is not None and whole.usage.completion_tokens == 8
    assert len(text.choices[0].text.split()) == 4
    async with sim_cluster(redis_prefix=None) as plain:
        async with AsyncOpenAI(base_url=plain.router_url + "/v1", api_key="k") as cl:
            again = await cl.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=8
            )
    assert again.choices[0].message.content == whole.choices[0].message.content


async def _exchange(c: SimCluster, request_bytes: bytes) -> tuple[int, bytes, bool]:
    """Send `request_bytes` on a new connection: the answer's status and body, and whether
    the router closed the connection after it."""
    async with _connected(c) as (reader, writer):
        writer.write(request_bytes)
        status, _, body = await asyncio.wait_for(_read_answer(reader), 10)
        try:
            closed = await asyncio.wait_for(reader.read(1), 0.3) == b""
        except TimeoutError:
            closed = False
        return status, re.sub(rb'"created":\d+', b'"created":0', body), closed


@pytest.mark.parametrize(
    "request_bytes",
    [
        b"GET /v1/models HTTP/1.1\r\nHost: t\r\n\r\n",
        _post(_body(), extra=b"Content-Length: 5\r\n"),  # two lengths
        _post(_body()).replace(b"Content-Length:", b"Content-Length :"),
        _post(_body()).replace(b"Host: t", b"Host: t\r\n folded"),  # an obs-fold
        _post(b"{}", path=b"/v1/chat/completions?x=1"),  # a query: aiohttp's route
        _post(b"x" * 10, extra=b"Content-Encoding: gzip\r\n"),  # not gzip
        b"POST /v1/chat/completions HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
        b"BREW " + CHAT + b" HTTP/1.1\r\n\r\n",
        b"PUT " + CHAT + b" HTTP/1.1\r\nContent-Length: 0\r\n\r\n",
        b"POST " + CHAT + b" HTTP/1.0\r\nContent-Length: 2\r\n\r\n{}",
        b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + b"\x00" * 40,  # TLS
    ],
    ids=lambda b: b[:24].decode("latin-1"),
)
async def test_what_is_not_the_common_shape_aiohttp_answers_as_without_the_lean_door(
    lean: SimCluster, request_bytes: bytes
) -> None:
    status, body, closed = await _exchange(lean, request_bytes)
    server = _server(lean)
    assert not server.doors  # handed over, for good
    assert len(server.connections) == (0 if closed else 1)
    async with sim_cluster(redis_prefix=None) as plain:
        assert await _exchange(plain, request_bytes) == (status, body, closed)
    if status >= 400:
        assert orjson.loads(body)["error"]["message"]  # an OpenAI body


async def test_a_gzip_body_is_served_through_aiohttp(lean: SimCluster) -> None:
    async with _connected(lean) as (reader, writer):
        writer.write(_post(gzip.compress(_body()), extra=b"Content-Encoding: gzip\r\n"))
        status, _, body = await asyncio.wait_for(_read_answer(reader), 10)
        assert status == 200 and orjson.loads(body)["usage"]["completion_tokens"] == 8


async def test_keep_alive_then_another_route_then_pipelined_answers_in_order(
    lean: SimCluster,
) -> None:
    async with _connected(lean) as (reader, writer):
        # Two generation requests in one write: answered in order on the lean door.
        writer.write(_post(_body(3)) + _post(_body(5)))
        first = await asyncio.wait_for(_read_answer(reader), 10)
        second = await asyncio.wait_for(_read_answer(reader), 10)
        assert [a[0] for a in (first, second)] == [200, 200]
        tokens = [orjson.loads(a[2])["usage"]["completion_tokens"] for a in (first, second)]
        assert tokens == [3, 5]
        assert len(_server(lean).doors) == 1
        # Then /v1/models on the same connection: aiohttp takes it over and answers.
        writer.write(b"GET /v1/models HTTP/1.1\r\nHost: t\r\n\r\n")
        status, _, body = await asyncio.wait_for(_read_answer(reader), 10)
        assert status == 200 and orjson.loads(body)["data"][0]["id"] == MODEL
        # And a generation request after it is still served (by aiohttp now).
        writer.write(_post(_body(2)))
        status, _, body = await asyncio.wait_for(_read_answer(reader), 10)
        assert status == 200 and orjson.loads(body)["usage"]["completion_tokens"] == 2


async def test_errors_of_the_flow_are_openai_bodies_and_close_when_they_say_so(
    lean: SimCluster,
) -> None:
    async with _connected(lean) as (reader, writer):
        writer.write(_post(b'{"model": "nope", "messages": []}'))
        status, headers, body = await asyncio.wait_for(_read_answer(reader), 10)
        assert status in (400, 404) and orjson.loads(body)["error"]["message"]
        assert headers.get("connection") != "close"
        writer.write(_post(b"not json"))  # a bad body: 400, and the connection stays
        status, _, body = await asyncio.wait_for(_read_answer(reader), 10)
        assert status == 400 and orjson.loads(body)["error"]["type"]
        writer.write(_post(_body(2), extra=b"Connection: close\r\n"))
        status, headers, _ = await asyncio.wait_for(_read_answer(reader), 10)
        assert status == 200 and headers["connection"] == "close"
        assert await asyncio.wait_for(reader.read(), 5) == b""  # closed after it


async def test_a_slow_head_is_a_408_and_an_idle_connection_closes() -> None:
    bounds = {"timeouts": {"header_s": 0.3, "keepalive_s": 0.3}}
    async with sim_cluster(redis_prefix=None, **LEAN, **bounds) as c:
        async with _connected(c) as (reader, writer):
            writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost:")  # and nothing more
            status, headers, body = await asyncio.wait_for(_read_answer(reader), 5)
            assert status == 408 and headers["connection"] == "close"
            assert orjson.loads(body)["error"]["code"] == "request_timeout"
        # Kept alive after an answer, then idle: closed after keepalive_s.
        async with _connected(c) as (reader, writer):
            writer.write(_post(_body(2)))
            assert (await asyncio.wait_for(_read_answer(reader), 10))[0] == 200
            assert await asyncio.wait_for(reader.read(), 5) == b""
        # A connection that sends nothing is closed without a word.
        async with _connected(c) as (reader, writer):
            assert await asyncio.wait_for(reader.read(), 5) == b""


async def test_a_slow_body_is_a_408() -> None:
    async with sim_cluster(redis_prefix=None, **LEAN, timeouts={"body_s": 0.3}) as c:
        async with _connected(c) as (reader, writer):
            whole = _post(_body())
            writer.write(whole[:-5])  # the body's last bytes never come
            status, headers, body = await asyncio.wait_for(_read_answer(reader), 5)
            assert status == 408 and headers["connection"] == "close"


async def test_a_client_that_leaves_mid_stream_gives_its_room_back() -> None:
    async with sim_cluster(redis_prefix=None, **LEAN, time_scale=20.0) as c:
        reader, writer = await asyncio.open_connection(*_addr(c))
        writer.write(_post(_body(400, stream=True)))
        assert (await reader.readline()).startswith(b"HTTP/1.1 200")
        await reader.readuntil(b"data:")  # the stream has started
        assert sum((await c.reserved_blocks()).values()) > 0
        writer.close()  # gone mid-stream
        for _ in range(200):
            if sum((await c.reserved_blocks()).values()) == 0:
                break
            await asyncio.sleep(0.02)
        assert sum((await c.reserved_blocks()).values()) == 0
        metrics = c.parts.metrics
        assert metrics.client_disconnects._value.get() >= 1


async def test_a_stream_in_flight_at_shutdown_finishes_and_an_idle_connection_closes() -> None:
    async with sim_cluster(redis_prefix=None, **LEAN, time_scale=50.0) as c:
        async with _connected(c) as (idle_reader, idle_writer), _connected(c) as (reader, writer):
            idle_writer.write(_post(_body(2)))
            assert (await asyncio.wait_for(_read_answer(idle_reader), 10))[0] == 200
            writer.write(_post(_body(60, stream=True)))
            assert (await reader.readline()).startswith(b"HTTP/1.1 200")
            server = _server(c)
            assert len(server.doors) == 2
            server.pre_shutdown()  # what aiohttp's runner does as it stops
            assert await asyncio.wait_for(idle_reader.read(), 5) == b""  # the idle one: closed
            rest = await asyncio.wait_for(reader.read(), 30)  # the stream: finished, then closed
            assert rest.rstrip().endswith(b"0") and b"data: [DONE]" in rest


async def test_a_client_far_ahead_of_its_answers_is_read_no_faster_than_answered(
    lean: SimCluster,
) -> None:
    """600 requests pipelined in one write (~120 KB): the door stops reading past 64 KB ahead
    of its answers and goes on as it answers; every answer comes, in order."""
    async with _connected(lean) as (reader, writer):
        requests = [_post(_body(1 + i % 3)) for i in range(600)]
        assert sum(map(len, requests)) > 100_000
        writer.write(b"".join(requests))
        for i in range(600):
            status, _, body = await asyncio.wait_for(_read_answer(reader), 20)
            assert status == 200 and orjson.loads(body)["usage"]["completion_tokens"] == 1 + i % 3
        assert len(_server(lean).doors) == 1
