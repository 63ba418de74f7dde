"""The hostile scenarios' clients: loopers that read every token, hogs that read the response
head and then nothing, and the operator who moves `both` workers between roles.

    Looper    one client sending requests back to back until told to stop, each answer checked
              token for token (loadclient.send); a 429 waits its Retry-After (at most 2 s)
    hog       a raw socket with a small receive buffer: sends one request, reads up to the end
              of the response head, then never reads again and closes after `hold_s` — the
              router's writes back up, the worker's answer keeps growing (its KV with it)
    operator  every `every_s` flips one `both` worker's role through the admin API

Every answer's length is chosen by the client through the simulated workers' oracle header
(`X-Sim-Output-Tokens`, forwarded by the router): the router cannot know it in advance, which
is what makes its output-length estimate wrong on purpose.
"""

from __future__ import annotations

import asyncio
import random
import socket
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from urllib.parse import urlsplit

import aiohttp

from disagg_tools.loadgen.hostile_cluster import MODEL, HostileCluster
from disagg_tools.loadgen.loadclient import LoadRequest, Result, make_request, send

__all__ = ["HogResult", "Looper", "cancel_all", "hog", "operator", "request_pool"]

HINT_HEADER = "X-Expected-Output-Tokens"
PROMPT_TOKENS = 100  # every request in one prompt bucket (policies/estimators.py: p=256)


def request_pool(
    kind: str, output_tokens: int, max_tokens: int, count: int, hint: int | None = None
) -> list[LoadRequest]:
    """`count` distinct streaming bodies whose answers run `output_tokens` (the expected text
    is computed once per body: a body is sent again and again)."""
    base = {"short": 1_000_000, "long": 2_000_000, "normal": 3_000_000, "flood": 4_000_000}
    pool = []
    for i in range(count):
        req = make_request(
            base.get(kind, 5_000_000) + i,
            model=MODEL,
            prompt_tokens=PROMPT_TOKENS,
            output_tokens=output_tokens,
            max_tokens=max_tokens,
            stream=True,
        )
        if hint is not None:
            req = replace(req, headers={**req.headers, HINT_HEADER: str(hint)})
        pool.append(req)
    return pool


@dataclass
class Looper:
    """Clients that loop on requests drawn from `pools` (weights `weights`) until `stop`."""

    name: str
    session: aiohttp.ClientSession
    urls: Sequence[str]
    pools: Sequence[Sequence[LoadRequest]]
    weights: Sequence[float]
    deadline_s: float
    seed: int = 0
    results: list[Result] = field(default_factory=list)
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    _count: int = 0

    @property
    def in_flight(self) -> int:
        """Requests sent and not yet ended (cut short when the phase ends)."""
        return self._count - len(self.results)

    async def client(self, i: int, start_after_s: float) -> None:
        rng = random.Random(self.seed * 100_003 + i)
        url = self.urls[i % len(self.urls)]  # spread over the replicas
        await self._pause(start_after_s)
        while not self.stop.is_set():
            pool = rng.choices(self.pools, self.weights)[0]
            req = pool[rng.randrange(len(pool))]
            self._count += 1
            res = await send(self.session, url, req, deadline_s=self.deadline_s)
            res.index = self._count
            self.results.append(res)
            if res.outcome == "shed":
                await self._pause(min(2.0, float(res.retry_after or 1)))
            elif res.failed:
                await self._pause(0.2)  # a failing router must not be spun on

    async def _pause(self, seconds: float) -> None:
        try:
            await asyncio.wait_for(self.stop.wait(), seconds)
        except TimeoutError:
            pass

    async def run(self, n: int, duration_s: float, ramp_s: float = 0.0) -> None:
        """n clients for duration_s, client i starting at i x ramp_s / n; the requests in
        flight at the end are cancelled (their clients go)."""
        tasks = [asyncio.create_task(self.client(i, i * ramp_s / n)) for i in range(n)]
        try:
            await asyncio.wait_for(self.stop.wait(), duration_s)
        except TimeoutError:
            pass
        self.stop.set()
        await cancel_all(tasks)


async def cancel_all(tasks: Sequence[asyncio.Task[None]], timeout_s: float = 10.0) -> None:
    """Cancel `tasks` and wait for them, but not forever: a library that turns a cancellation
    into an error of its own could keep a client looping (the run must end by itself)."""
    for task in tasks:
        task.cancel()
    if tasks:
        await asyncio.wait(tasks, timeout=timeout_s)


@dataclass(slots=True)
class HogResult:
    status: int | None = None  # None: no response head arrived
    head_s: float | None = None  # seconds from sending to the end of the response head
    detail: str = ""


async def hog(
    res: HogResult, base_url: str, req: LoadRequest, hold_s: float, head_timeout_s: float
) -> None:
    """Send `req`, read the response head, then read nothing for `hold_s` and close. What
    happened is written into `res` as it happens, so a hog cancelled while it holds (the
    phase is over) still reports its head."""
    loop = asyncio.get_running_loop()
    parts = urlsplit(base_url)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    # Small before connect, so the advertised window stays small: the router's writes stall
    # within a few kilobytes instead of filling megabytes of loopback buffer.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    head = (
        f"POST {req.path} HTTP/1.1\r\nHost: {parts.hostname}:{parts.port}\r\n"
        + "".join(f"{k}: {v}\r\n" for k, v in req.headers.items())
        + f"Content-Length: {len(req.body)}\r\n\r\n"
    ).encode()
    t0 = time.perf_counter()
    try:
        async with asyncio.timeout(head_timeout_s):
            await loop.sock_connect(sock, (parts.hostname, parts.port))
            await loop.sock_sendall(sock, head + req.body)
            got = b""
            while b"\r\n\r\n" not in got:
                chunk = await loop.sock_recv(sock, 1)  # byte by byte: not one byte past the head
                if not chunk:
                    res.detail = "closed before the response head"
                    return
                got += chunk
        res.head_s = time.perf_counter() - t0
        status_line = got.split(b"\r\n", 1)[0].decode("latin-1")
        res.status = int(status_line.split()[1])
        if res.status != 200:
            res.detail = status_line
            return
        await asyncio.sleep(hold_s)
    except TimeoutError:
        res.detail = f"no response head within {head_timeout_s:.0f} s"
    except (OSError, ValueError, IndexError) as exc:
        res.detail = f"{type(exc).__name__}: {exc}"
    except asyncio.CancelledError:
        if res.status is None:
            res.detail = "no response head by the end of the phase"
        raise
    finally:
        sock.close()


async def operator(
    cluster: HostileCluster,
    session: aiohttp.ClientSession,
    every_s: float,
    stop: asyncio.Event,
) -> Counter[str]:
    """Move the `both` workers in turn: b0 to prefill, b1 to prefill, b0 back, b1 back, ...
    Returns the admin API's answers counted by status."""
    both = cluster.shape.both_ids
    answers: Counter[str] = Counter()
    role = {wid: "decode" for wid in both}
    k = 0
    while not stop.is_set():
        try:
            await asyncio.wait_for(stop.wait(), every_s)
            break
        except TimeoutError:
            pass
        wid = both[k % len(both)]
        k += 1
        role[wid] = "prefill" if role[wid] == "decode" else "decode"
        try:
            status = await cluster.set_role(session, wid, role[wid])
        except (aiohttp.ClientError, TimeoutError) as exc:
            answers[type(exc).__name__] += 1
            continue
        answers[str(status)] += 1
    return answers
