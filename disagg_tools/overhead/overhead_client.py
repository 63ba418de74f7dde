"""The load generator of `disagg_tools.overhead`: keep-alive HTTP/1.1 streams on raw asyncio
protocols.

Lean on purpose, so that it is not the bottleneck it measures: no HTTP library, no per-event
JSON. A response is parsed as bytes (status line, `content-length` or chunked framing), SSE
events are cut at the last blank line of what has arrived, and tokens are counted with byte
searches, one completions `"text":"…"` (or chat `"content":"…"`) per token. Every read that
carries tokens is time-stamped once with `time.perf_counter()`: tokens that arrive in one read
share a time stamp, and their gaps are 0, as an SSE client that counts chunks would see them.

Two ways to ask for one answer:
    via a router:   POST {router}/v1/completions (the client's body) → SSE
    baseline (PD):  POST {prefill} with max_tokens 1 + the NIXL kv_transfer_params skeleton,
                    then POST {decode} with the client's body + the prefill's kv_transfer_params
TTFT runs from the first request byte written to the first token read, for both.
"""

from __future__ import annotations

import asyncio
import socket
import time
import uuid
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import orjson

__all__ = ["StreamRecord", "LoadSpec", "run_load", "run_arrivals", "prefill_body", "client_body"]

_clock = time.perf_counter

_HEAD, _LENGTH, _CHUNKED = 0, 1, 2
_PROMPT = (
    "You are benchmarking a router. Summarise the following paragraph in one line: "
    "prefill builds the KV cache of the prompt, decode streams the tokens, and the "
    "router in between must add as little latency and CPU as it can."
)


def client_body(model: str, max_tokens: int) -> dict[str, Any]:
    return {
        "model": model,
        "prompt": _PROMPT,
        "max_tokens": max_tokens,
        "stream": True,
        "ignore_eos": True,
        "temperature": 0.0,
    }


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """What a PD-aware client sends to the prefill worker (vLLM NIXL pull mode,
    docs/design.md §3)."""
    out = {
        k: v
        for k, v in body.items()
        if k not in ("min_tokens", "min_completion_tokens", "stream_options")
    }
    out.update(
        stream=False,
        max_tokens=1,
        kv_transfer_params={
            "do_remote_decode": True,
            "do_remote_prefill": False,
            "remote_engine_id": None,
            "remote_block_ids": None,
            "remote_host": None,
            "remote_port": None,
        },
    )
    return out


@dataclass(slots=True)
class StreamRecord:
    """One streamed answer as the client saw it (times in perf_counter seconds)."""

    slot: int
    seq: int
    warmup: bool
    start: float = 0.0
    first: float | None = None
    end: float | None = None
    status: int = 0
    tokens: int = 0
    done: bool = False
    error: str | None = None
    due: float | None = None  # open loop (`run_arrivals`): when it was due to be sent
    reads: array[float] = field(default_factory=lambda: array("d"))  # a stamp per read of tokens
    counts: array[int] = field(default_factory=lambda: array("i"))  # tokens in that read

    def __repr__(self) -> str:
        return (
            f"StreamRecord(slot={self.slot} seq={self.seq} status={self.status} "
            f"tokens={self.tokens} done={self.done} error={self.error!r})"
        )

    @property
    def ttft(self) -> float | None:
        return None if self.first is None else self.first - self.start

    @property
    def lag(self) -> float | None:
        """Open loop: how late the client sent it (its own delay, not the target's)."""
        return None if self.due is None else self.start - self.due

    def gaps(self) -> list[float]:
        """Inter-token gaps: between reads, and 0 between tokens that shared a read."""
        out: list[float] = []
        prev = None
        for t, n in zip(self.reads, self.counts, strict=True):
            if prev is not None:
                out.append(t - prev)
            out.extend([0.0] * (n - 1))
            prev = t
        return out


class _Conn(asyncio.Protocol):
    """One keep-alive connection, one request at a time."""

    def __init__(self, chat: bool) -> None:
        self.transport: asyncio.Transport | None = None
        self.lost = asyncio.get_running_loop().create_future()
        self.fut: asyncio.Future[bytes] | None = None
        self.rec: StreamRecord | None = None
        self.state = _HEAD
        self.buf = bytearray()
        self.ebuf = b""
        self.length = 0
        self.status = 0
        self.closing = False
        self.marker = b'"content":"' if chat else b'"text":"'
        self.empty = b'"content":""' if chat else b'"text":""'

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A TCP connection (uvloop's or asyncio's), so a full Transport: written, paused, closed.
        self.transport = cast(asyncio.Transport, transport)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        if self.fut is not None and not self.fut.done():
            self.fut.set_exception(ConnectionError(f"connection lost: {exc}"))
        if not self.lost.done():
            self.lost.set_result(None)

    @property
    def usable(self) -> bool:
        return self.transport is not None and not self.transport.is_closing() and not self.closing

    def request(self, data: bytes, rec: StreamRecord | None) -> asyncio.Future[bytes]:
        """Send one request; the future gets the body (b"" for a stream, which goes to `rec`)."""
        assert self.transport is not None
        fut = asyncio.get_running_loop().create_future()
        self.fut, self.rec = fut, rec
        self.state, self.ebuf, self.status = _HEAD, b"", 0
        self.buf.clear()
        self.transport.write(data)
        return fut

    def data_received(self, data: bytes) -> None:
        if self.state == _CHUNKED:
            self._chunked(data)
            return
        buf = self.buf
        buf += data
        if self.state == _HEAD:
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                return
            lines = bytes(buf[:end]).split(b"\r\n")
            self.status = int(lines[0].split(b" ", 2)[1])
            chunked, self.length = False, 0
            for line in lines[1:]:
                name, _, value = line.partition(b":")
                name = name.strip().lower()
                if name == b"content-length":
                    self.length = int(value)
                elif name == b"transfer-encoding" and b"chunked" in value.lower():
                    chunked = True
                elif name == b"connection" and value.strip().lower() == b"close":
                    self.closing = True
            if self.rec is not None:
                self.rec.status = self.status
            del buf[: end + 4]
            if chunked:
                self.state = _CHUNKED
                rest = bytes(buf)
                buf.clear()
                if rest:
                    self._chunked(rest)
                return
            self.state = _LENGTH
        if self.state == _LENGTH and len(buf) >= self.length:
            body = bytes(buf[: self.length])
            del buf[: self.length]
            self._finish(body)

    # Own chunked decoder on purpose: the bench shares no parser with the router.
    def _chunked(self, data: bytes) -> None:
        now = _clock()
        buf = self.buf
        buf += data
        pos, parts, finished = 0, [], False
        while True:
            eol = buf.find(b"\r\n", pos)
            if eol < 0:
                break
            size = int(bytes(buf[pos:eol]).split(b";", 1)[0], 16)
            start = eol + 2
            if size == 0:
                if len(buf) < start + 2:
                    break
                pos, finished = start + 2, True
                break
            if len(buf) < start + size + 2:
                break
            parts.append(bytes(buf[start : start + size]))
            pos = start + size + 2
        if pos:
            del buf[:pos]
        if parts:
            self._events(b"".join(parts), now)
        if finished:
            self._finish(b"")

    def _events(self, data: bytes, now: float) -> None:
        rec = self.rec
        if rec is None:  # a non-streaming body sent chunked (an error page): keep it
            self.ebuf += data
            return
        if self.status != 200:
            self.ebuf += data
            return
        data = self.ebuf + data if self.ebuf else data
        cut = data.rfind(b"\n\n")
        if cut < 0:
            self.ebuf = data
            return
        whole, self.ebuf = data[: cut + 2], data[cut + 2 :]
        n = whole.count(self.marker) - whole.count(self.empty)
        if n > 0:
            if rec.first is None:
                rec.first = now
            rec.tokens += n
            rec.reads.append(now)
            rec.counts.append(n)
        if b"data: [DONE]" in whole:
            rec.done = True

    def _finish(self, body: bytes) -> None:
        self.state = _HEAD
        fut, self.fut = self.fut, None
        if self.rec is not None and self.status != 200:
            self.rec.error = f"HTTP {self.status}: {(self.ebuf or body)[:200]!r}"
        if fut is not None and not fut.done():
            fut.set_result(body if self.rec is None else b"")
        if self.closing and self.transport is not None:
            self.transport.close()


def _post(
    host: str, path: str, body: bytes, request_id: str | None = None, api_key: str | None = None
) -> bytes:
    rid = b"X-Request-Id: %s\r\n" % request_id.encode() if request_id else b""
    if api_key:
        rid += b"Authorization: Bearer %s\r\n" % api_key.encode()
    return (
        b"POST %s HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
        b"Accept: text/event-stream\r\n%sContent-Length: %d\r\n\r\n%s"
        % (path.encode(), host.encode(), rid, len(body), body)
    )


@dataclass(frozen=True, slots=True)
class LoadSpec:
    """Where to send, how many streams, how many answers per stream."""

    concurrency: int
    requests_per_slot: int
    warmup_per_slot: int = 1  # the first answers of each slot pay for connecting: not measured
    target: tuple[str, int] | None = None  # a router (host, port), or None for the baseline
    prefill: tuple[str, int] | None = None  # the baseline's workers
    decode: tuple[str, int] | None = None
    model: str = "llama-3-8b"
    max_tokens: int = 128
    chat: bool = False
    stagger_s: float = 0.0  # spread the slots' first requests over this long
    request_timeout_s: float = 120.0
    # Via a router: slot i sends with api_keys[i % len] (tenants' keys); none: no key.
    api_keys: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.target is None and (self.prefill is None or self.decode is None):
            raise ValueError("a LoadSpec needs a router target, or prefill and decode workers")
        if self.concurrency < 1 or self.requests_per_slot < 1:
            raise ValueError("concurrency and requests_per_slot must be >= 1")


async def _connect(addr: tuple[str, int], chat: bool) -> _Conn:
    loop = asyncio.get_running_loop()
    _, proto = await loop.create_connection(lambda: _Conn(chat), addr[0], addr[1])
    return proto


class _Slot:
    """One client stream slot: its connections and its closed loop of requests."""

    def __init__(self, spec: LoadSpec, index: int, sink: Callable[[StreamRecord], None]) -> None:
        self.spec = spec
        self.index = index
        self.sink = sink
        self.conns: dict[tuple[str, int], _Conn] = {}
        path = "/v1/chat/completions" if spec.chat else "/v1/completions"
        self.path = path
        body = client_body(spec.model, spec.max_tokens)
        if spec.chat:
            body.pop("prompt")
            body["messages"] = [{"role": "user", "content": _PROMPT}]
        self.body = body
        self.body_bytes = orjson.dumps(body)
        self.prefill_bytes = orjson.dumps(prefill_body(body))
        keys = spec.api_keys
        self.api_key = keys[index % len(keys)] if keys else None

    async def conn(self, addr: tuple[str, int]) -> _Conn:
        c = self.conns.get(addr)
        if c is None or not c.usable:
            c = self.conns[addr] = await _connect(addr, self.spec.chat)
        return c

    async def one(self, rec: StreamRecord) -> None:
        spec = self.spec
        if spec.target is not None:
            conn = await self.conn(spec.target)
            rec.start = rec.start or _clock()  # open loop: from when it was sent for
            host = f"{spec.target[0]}:{spec.target[1]}"
            await conn.request(_post(host, self.path, self.body_bytes, api_key=self.api_key), rec)
            return
        assert spec.prefill is not None and spec.decode is not None
        p, d = await self.conn(spec.prefill), await self.conn(spec.decode)
        rid = uuid.uuid4().hex
        rec.start = rec.start or _clock()
        answer = await p.request(
            _post(f"{spec.prefill[0]}:{spec.prefill[1]}", self.path, self.prefill_bytes, rid), None
        )
        if p.status != 200:
            rec.status, rec.error = p.status, f"prefill HTTP {p.status}: {answer[:200]!r}"
            return
        params = orjson.loads(answer).get("kv_transfer_params")
        body = orjson.dumps({**self.body, "kv_transfer_params": params})
        await d.request(_post(f"{spec.decode[0]}:{spec.decode[1]}", self.path, body, rid), rec)

    async def run(self, delay: float) -> None:
        if delay > 0:
            await asyncio.sleep(delay)
        spec = self.spec
        for seq in range(spec.requests_per_slot):
            await self.once(StreamRecord(self.index, seq, warmup=seq < spec.warmup_per_slot))
        self.close()

    async def once(self, rec: StreamRecord) -> None:
        """One answer into `rec`, then to the sink: a failure is recorded, not raised (and the
        slot's connections are dropped: the next answer connects afresh)."""
        try:
            async with asyncio.timeout(self.spec.request_timeout_s):
                await self.one(rec)
        except (OSError, TimeoutError, ValueError) as exc:
            rec.error = rec.error or f"{type(exc).__name__}: {exc}"
            self.close()
        rec.end = _clock()
        self.sink(rec)

    def close(self) -> None:
        for c in self.conns.values():
            if c.transport is not None:
                c.transport.close()
        self.conns.clear()


async def run_load(spec: LoadSpec) -> tuple[list[StreamRecord], float, float]:
    """Run `spec`; return the records, the wall time and the window of measured answers.

    Returns (records, wall_s, measured_window_s) where the window runs from the first
    measured request's start to the last measured answer's end.
    """
    records: list[StreamRecord] = []
    slots = [_Slot(spec, i, records.append) for i in range(spec.concurrency)]
    step = spec.stagger_s / spec.concurrency if spec.concurrency > 1 else 0.0
    t0 = _clock()
    await asyncio.gather(*(s.run(i * step) for i, s in enumerate(slots)))
    wall = _clock() - t0
    measured = [r for r in records if not r.warmup]
    window = 0.0
    if measured:
        window = max(r.end or r.start for r in measured) - min(r.start for r in measured)
    return records, wall, window


async def run_arrivals(
    spec: LoadSpec, offsets: Sequence[float], warmup: int = 0
) -> tuple[list[StreamRecord], float, float]:
    """Open loop: answer i is asked for `offsets[i]` seconds after the start, whatever is still
    in flight (`spec.concurrency` and `requests_per_slot` are not used). Each goes out on an
    idle keep-alive slot, or a new one when every slot is busy (so the pool grows to what the
    rate needs, during the warm-up: the first `warmup` answers, not measured). A record's
    `due` is when it should have been sent, its `start` when the client got to it and `lag`
    the difference: the client's own lateness (its loop busy), not the target's latency. TTFT
    runs from `start`, so it includes connecting when no idle connection is left: a target
    slow to accept is slow to answer.
    Returns what `run_load` does."""
    records: list[StreamRecord] = []
    idle: list[_Slot] = []
    slots: list[_Slot] = []
    tasks: set[asyncio.Task[None]] = set()
    loop = asyncio.get_running_loop()

    async def send(slot: _Slot, rec: StreamRecord) -> None:
        await slot.once(rec)
        idle.append(slot)

    t0 = _clock() + 0.01
    for i, offset in enumerate(offsets):
        due = t0 + offset
        delay = due - _clock()
        if delay > 0:
            await asyncio.sleep(delay)
        if idle:
            slot = idle.pop()  # the most recently used: its connections are warm
        else:
            slot = _Slot(spec, len(slots), records.append)
            slots.append(slot)
        rec = StreamRecord(slot.index, i, i < warmup, due=due, start=_clock())
        task = loop.create_task(send(slot, rec))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
    if tasks:
        await asyncio.gather(*tasks)
    wall = _clock() - t0
    for slot in slots:
        slot.close()
    measured = [r for r in records if not r.warmup]
    window = 0.0
    if measured:
        window = max(r.end or r.start for r in measured) - min(r.start for r in measured)
    return records, wall, window
