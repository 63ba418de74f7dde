"""Issue 24, "the per-request server": what aiohttp's server costs per request against a bare
httptools protocol (the parser uvicorn uses), measured before deciding whether the router's
front door should move off aiohttp's `RequestHandler`.

    python scripts/http_server_cost.py [--requests 4000] [--rounds 2]

Each server runs in its own process pinned to core 0 (uvloop), the load (an aiohttp client with
keep-alive, one small POST and a ~90-byte JSON answer) on core 1; the figure is the server
process's scheduler run time (/proc/PID/schedstat) over the measured requests. The aiohttp
server has one middleware, as the router's app does (router/edge/app.py `error_middleware`); the
httptools one parses the request line, headers and body and writes the answer: nothing else,
so its figure is a floor that a real front door (routes, client bounds, error bodies) would add
to. Loopback only; both servers are stopped at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import sys

import aiohttp
import uvloop

BODY = b'{"id":"x","object":"text_completion","choices":[{"text":"hi","index":0}]}'
REQUEST = b'{"model":"m","prompt":"hello","max_tokens":16}'


def serve_aiohttp(port: int) -> None:
    from aiohttp import web

    @web.middleware
    async def passthrough(request: web.Request, handler):  # type: ignore[no-untyped-def]
        return await handler(request)

    async def completions(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(body=BODY, content_type="application/json")

    app = web.Application(middlewares=[passthrough])
    app.router.add_post("/v1/completions", completions)
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)


def serve_httptools(port: int) -> None:
    import httptools

    answer = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"

    class Protocol(asyncio.Protocol):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            self.transport = transport
            self.parser = httptools.HttpRequestParser(self)
            self.headers: list[tuple[bytes, bytes]] = []
            self.body: list[bytes] = []

        def on_header(self, name: bytes, value: bytes) -> None:
            self.headers.append((name, value))

        def on_body(self, body: bytes) -> None:
            self.body.append(body)

        def on_message_complete(self) -> None:
            b"".join(self.body)
            self.body.clear()
            self.headers.clear()
            self.transport.write(answer % (len(BODY), BODY))  # type: ignore[attr-defined]

        def data_received(self, data: bytes) -> None:
            self.parser.feed_data(data)

    async def main() -> None:
        await asyncio.get_running_loop().create_server(Protocol, "127.0.0.1", port)
        await asyncio.Event().wait()

    uvloop.run(main())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_time_s(pid: int) -> float:
    with open(f"/proc/{pid}/schedstat") as f:
        return int(f.read().split()[0]) / 1e9


async def load(port: int, requests: int, concurrency: int) -> None:
    limit = asyncio.Semaphore(concurrency)
    connector = aiohttp.TCPConnector(limit=concurrency)
    url = f"http://127.0.0.1:{port}/v1/completions"
    async with aiohttp.ClientSession(connector=connector) as session:

        async def one() -> None:
            async with limit, session.post(url, data=REQUEST) as answer:
                await answer.read()

        await asyncio.gather(*(one() for _ in range(requests)))


async def measure(ns: argparse.Namespace) -> None:
    print("| server | concurrency | round | server CPU µs / request |\n|---|---:|---:|---:|")
    for rnd in range(ns.rounds):
        for kind in ("aiohttp", "httptools"):
            port = free_port()
            cmd = ["taskset", "-c", "0", sys.executable, __file__, "--serve", kind, str(port)]
            server = await asyncio.create_subprocess_exec(*cmd)
            try:
                for _ in range(100):
                    try:
                        socket.create_connection(("127.0.0.1", port), timeout=0.1).close()
                        break
                    except OSError:
                        await asyncio.sleep(0.05)
                await load(port, 500, 8)  # warm-up
                for concurrency in (1, 32):
                    before = run_time_s(server.pid)
                    await load(port, ns.requests, concurrency)
                    per_request = 1e6 * (run_time_s(server.pid) - before) / ns.requests
                    print(f"| {kind} | {concurrency} | {rnd + 1} | {per_request:.1f} |", flush=True)
            finally:
                server.terminate()
                await server.wait()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=4000)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--serve", nargs=2, metavar=("KIND", "PORT"), help=argparse.SUPPRESS)
    ns = p.parse_args()
    if ns.serve:
        kind, port = ns.serve
        {"aiohttp": serve_aiohttp, "httptools": serve_httptools}[kind](int(port))
        return
    uvloop.run(measure(ns))


if __name__ == "__main__":
    main()
