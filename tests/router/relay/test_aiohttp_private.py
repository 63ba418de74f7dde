"""The one function that reads aiohttp's private state (router/relay/aiohttp_private.py),
checked against the installed aiohttp: if an upgrade moves what the splice relay writes
through, this fails here with a clear message, not as garbled streams in production."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from aiohttp import web

from router.relay.aiohttp_private import AiohttpChanged, aiohttp_private, prepared_writer

PIECES = [b"data: %d\n\n" % i for i in range(50)]


async def test_a_prepared_response_exposes_a_writable_transport_on_this_aiohttp() -> None:
    """Chunks written straight onto the transport `prepared_writer` returns, ended by aiohttp's
    own `write_eof`, are a valid chunked body to a real client."""
    seen: list[str] = []

    async def handle(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        with pytest.raises(ConnectionResetError):
            prepared_writer(resp)  # not prepared yet: nothing to write to
        await resp.prepare(request)
        assert hasattr(resp, "_payload_writer"), (
            f"aiohttp {aiohttp.__version__} renamed StreamResponse._payload_writer: "
            "router/relay/aiohttp_private.py prepared_writer must be updated"
        )
        writer, transport = prepared_writer(resp)
        seen.append(type(writer).__qualname__)
        for piece in PIECES:
            transport.write(b"%x\r\n%s\r\n" % (len(piece), piece))
            if transport.get_write_buffer_size() > 65536:
                await writer.drain()
        await resp.write_eof()
        with pytest.raises(ConnectionResetError):
            prepared_writer(resp)  # ended: nothing more may be written
        return resp

    app = web.Application()
    app.router.add_get("/", handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        url = f"http://127.0.0.1:{runner.addresses[0][1]}/"
        async with aiohttp.ClientSession() as s:
            for _ in range(2):  # and the kept-alive connection still works after it
                async with s.get(url) as r:
                    assert r.status == 200
                    assert r.headers["Transfer-Encoding"] == "chunked"
                    assert await asyncio.wait_for(r.read(), 30) == b"".join(PIECES)
    finally:
        await runner.cleanup()
    assert len(seen) == 2


def test_a_moved_attribute_fails_loudly() -> None:
    class Moved:
        _payload_writer_v2 = object()

    with pytest.raises(
        AiohttpChanged,
        match=r"Moved\._payload_writer .*router/relay/aiohttp_private.py and its caller must",
    ):
        aiohttp_private(Moved(), "_payload_writer", object, optional=False)
    with pytest.raises(AiohttpChanged, match="not"):
        aiohttp_private(Moved(), "_payload_writer_v2", dict)
    assert aiohttp_private(Moved(), "_payload_writer_v2", object) is Moved._payload_writer_v2
