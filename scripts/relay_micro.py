"""Relay CPU per token, in process: `python scripts/relay_micro.py [--tokens N] [--rounds R]`.

It needs router code, so it lives here, not among the client tools (disagg_tools/replay/,
overhead/, loadgen/, experiments/ never import router). Run it against another checkout with
`PYTHONPATH=/path/to/checkout python scripts/relay_micro.py` to compare before and after a
change (it speaks both relay interfaces: `observer=` and the older
`on_first_token=`/`on_tokens=`).

- splice: a real SplicePool connection to a loopback stand-in that sends only the response
  head; each token's chunk-framed SSE event is then handed to the connection's
  `data_received`, as the socket would, so what is timed is the splice path per read: HTTP
  framing, SSE cutting, token count, observer, the chunk written to a real client transport
  (an aiohttp server read by a raw socket). One read = one token, the worst case (no
  coalescing).
- glue: the splice path's Python alone — the same reads handed to an `UpstreamConn`'s
  `data_received`, its relay writing to a transport that drops the bytes (no syscall, no
  event loop): what the router's own code costs per token, apart from the kernel.
- aiohttp: `relay_sse` over an upstream whose `content.readany()` returns one event per call
  (aiohttp's own HTTP parsing is not part of it), writing to the same kind of client.

Reports the median over rounds of µs of CPU per token (process time of the timed part only;
the client's reads run between batches, untimed).
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import statistics
import time
from typing import Any, cast

import orjson
from aiohttp import web

from router.relay import aiohttp_relay as relay_mod
from router.relay import splice as splice_mod

BATCH = 64


def token_event(i: int) -> bytes:
    obj = {
        "id": "chatcmpl-0123456789abcdef",
        "object": "chat.completion.chunk",
        "created": 1700000000,
        "model": "meta-llama/Llama-3.1-8B-Instruct",
        "choices": [{"index": 0, "delta": {"content": f" tok{i}"}, "finish_reason": None}],
    }
    return b"data: " + orjson.dumps(obj) + b"\n\n"


class Count:
    """A RelayObserver (and the old callbacks' targets)."""

    def __init__(self, until: int) -> None:
        self.first, self.total, self.until = 0, 0, until
        self.reached = asyncio.Event()

    def first_token(self) -> None:
        self.first += 1

    def tokens(self, total: int) -> int:
        # As the router's Progress does: nothing to do until the count passes a threshold
        # (there, the reservation's growth point; here, the stream's end). The older relays
        # ignore the return value and call after every read.
        self.total = total
        if total >= self.until:
            self.reached.set()
        return self.until - 1


def observer_kwargs(fn: Any, obs: Count) -> dict[str, Any]:
    if "observer" in inspect.signature(fn).parameters:
        return {"observer": obs}
    return {"on_first_token": obs.first_token, "on_tokens": obs.tokens}


async def drain_client(reader: asyncio.StreamReader) -> None:
    while await reader.read(1 << 20):
        pass


async def client_server(handler: Any) -> tuple[web.AppRunner, asyncio.Task[None], Any]:
    app = web.Application()
    app.router.add_post("/", handler)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    port = runner.addresses[0][1]
    reader, writer = await asyncio.open_connection("127.0.0.1", port, limit=1 << 22)
    writer.write(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n")
    return runner, asyncio.create_task(drain_client(reader)), writer


async def splice_round(tokens: int) -> float:
    async def head_only(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await r.readuntil(b"\r\n\r\n")
        w.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        await w.drain()
        await r.read()

    upstream = await asyncio.start_server(head_only, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{upstream.sockets[0].getsockname()[1]}/"
    pool = splice_mod.SplicePool()
    events = [b"%x\r\n%s\r\n" % (len(e), e) for e in map(token_event, range(tokens))]
    events.append(b"e\r\ndata: [DONE]\n\n\r\n0\r\n\r\n")
    spent = 0.0
    obs = Count(tokens)

    async def handle(request: web.Request) -> web.StreamResponse:
        nonlocal spent
        resp = await pool.post(url, b"{}", {}, connect_s=5, idle_s=60)
        client = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await client.prepare(request)
        kwargs = observer_kwargs(splice_mod.relay_splice, obs)
        task = asyncio.create_task(
            splice_mod.relay_splice(resp, client, chat=True, clock=time.monotonic, **kwargs)
        )
        await asyncio.sleep(0)  # the relay attaches its sink
        conn = resp._conn
        for start in range(0, len(events), BATCH):
            t0 = time.process_time()
            for data in events[start : start + BATCH]:
                conn.data_received(data)
            spent += time.process_time() - t0
            for _ in range(3):
                await asyncio.sleep(0)
        result = await task
        assert result.completed and result.tokens == tokens, result
        resp.close()
        await client.write_eof()
        return client

    runner, drainer, writer = await client_server(handle)
    await obs.reached.wait()
    await asyncio.sleep(0.05)
    writer.close()
    await drainer
    await runner.cleanup()
    await pool.close()
    upstream.close()
    await asyncio.sleep(0.05)  # the stand-in sees the close and returns
    return spent / tokens


class _DropTransport:
    """The client transport of the glue round: takes every write, sends nothing."""

    def is_closing(self) -> bool:
        return False

    def write(self, data: bytes) -> None:
        pass

    def get_write_buffer_size(self) -> int:
        return 0


async def glue_round(tokens: int) -> float:
    conn = splice_mod.UpstreamConn(splice_mod.SplicePool(), ("127.0.0.1", 1))
    conn.transport = cast(Any, _DropTransport())
    conn.state = 1  # a request in flight (upstream_pool._BUSY)
    conn.reader.feed(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
    events = [b"%x\r\n%s\r\n" % (len(e), e) for e in map(token_event, range(tokens))]
    obs = Count(tokens + 1)
    splice = splice_mod._Splice(  # what relay_splice builds, without a client connection
        conn,
        cast(Any, None),
        cast(Any, _DropTransport()),
        splice_mod.SseCutter(True),
        time.monotonic,
        cast(Any, obs),
    )
    conn.sink = splice.sink
    t0 = time.process_time()
    for data in events:
        conn.data_received(data)
    spent = time.process_time() - t0
    assert splice.cutter.tokens == tokens, splice.cutter.tokens
    return spent / tokens


class _Content:
    def __init__(self, reads: list[bytes], timer: list[float]) -> None:
        self.reads, self.i, self.timer = reads, 0, timer

    async def readany(self) -> bytes:
        # Time spent in the relay = everything between two readany calls.
        now = time.process_time()
        if self.i:
            self.timer[0] += now - self.timer[1]
        if self.i % BATCH == 0:
            for _ in range(3):
                await asyncio.sleep(0)  # let the client read, untimed
        self.i += 1
        data = self.reads[self.i - 1] if self.i <= len(self.reads) else b""
        self.timer[1] = time.process_time()
        return data


async def aiohttp_round(tokens: int) -> float:
    reads = [token_event(i) for i in range(tokens)] + [b"data: [DONE]\n\n"]
    timer = [0.0, 0.0]
    obs = Count(tokens)

    class Upstream:
        content = _Content(reads, timer)

    async def handle(request: web.Request) -> web.StreamResponse:
        client = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await client.prepare(request)
        kwargs = observer_kwargs(relay_mod.relay_sse, obs)
        result = await relay_mod.relay_sse(
            cast(Any, Upstream()),  # the part of a ClientResponse relay_sse reads
            client,
            chat=True,
            clock=time.monotonic,
            **kwargs,
        )
        assert result.completed and result.tokens == tokens, result
        await client.write_eof()
        return client

    runner, drainer, writer = await client_server(handle)
    await obs.reached.wait()
    await asyncio.sleep(0.05)
    writer.close()
    await drainer
    await runner.cleanup()
    return timer[0] / tokens


async def main(tokens: int, rounds: int) -> None:
    for name, fn in (("splice", splice_round), ("glue", glue_round), ("aiohttp", aiohttp_round)):
        per = [await fn(tokens) for _ in range(rounds)]
        med = statistics.median(per) * 1e6
        print(
            f"{name:8s} {med:6.2f} µs CPU/token  (median of {rounds} rounds x {tokens} "
            f"tokens; min {min(per) * 1e6:.2f}, max {max(per) * 1e6:.2f})"
        )


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=20000)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--uvloop", action="store_true", help="run on uvloop (as the router does)")
    args = ap.parse_args()
    if args.uvloop:
        import uvloop

        uvloop.run(main(args.tokens, args.rounds))
    else:
        asyncio.run(main(args.tokens, args.rounds))
