"""A fixed-rate stand-in GPU worker for the router-overhead benchmark: N tokens, one every I ms.

    python -m disagg_tools.overhead.fixed_worker --role prefill|decode --port N
                                                 [--interval-ms 20] [--prefill-ms 10]

Why not the simulated worker (`disagg_tools.sim.worker`): its step time follows the roofline
model, so ITL grows with the batch (1 → 1,024 streams), its aiohttp stack costs ~30 µs of CPU
per token on a core the load generator needs, and it speaks only vLLM's NIXL protocol. The
overhead benchmark needs the opposite: a worker whose timing does not depend on load (every
stream gets its tokens at `first + k × interval`, whatever the concurrency), cheap enough in CPU
to share a core with the load generator, and speaking both PD protocols the peers use:

    vLLM NIXL (pull):  kv_transfer_params.do_remote_decode → prefill: one token + kv_transfer_params
                       kv_transfer_params.do_remote_prefill (or none) → decode: the stream
    SGLang bootstrap:  bootstrap_room in the body → prefill role answers after --prefill-ms (its
                       answer is dropped by the router), decode role streams

    GET /health /v1/models /version /metrics /server_info /get_server_info /model_info /get_load
    (what a router started with no configuration file reads at start-up, as vLLM answers it:
    the served model and max_model_len in /v1/models, the KV capacity in /metrics'
    `vllm:cache_config_info`, `--kv-blocks`)

A raw asyncio protocol (HTTP/1.1, keep-alive, chunked responses), one timer per stream: when the
reader falls behind (transport paused) the tokens that came due are written together, as vLLM's
output queue coalesces deltas for a slow consumer. Each stream is `max_tokens` long (ignore_eos
semantics: always exactly that many). Answers are vLLM-shaped: completions send one `text` chunk
per token, the last with finish_reason "length"; chat sends a role chunk, one `content` chunk per
token and an empty finish chunk; then `data: [DONE]`.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import signal
import socket as _socket
import sys
import time
import uuid
from pathlib import Path
from typing import Any, cast
from urllib.parse import parse_qs

import orjson

from disagg_tools import uvrun

__all__ = ["FixedWorker", "serve", "main"]

_CHAT = b"/v1/chat/completions"
_TOKEN_TEXT = " tok"
_MAX_BODY = 64 * 1024 * 1024
# The KV capacity a decode stand-in reports (`vllm:cache_config_info`): far beyond any ladder
# (1,024 streams of a few thousand tokens), so a router's admission never limits what is
# measured, as the configuration file's `kv_blocks: 100000000` does for `ours`.
DEFAULT_KV_BLOCKS = 100_000_000
BLOCK_SIZE = 16  # tokens per KV block, vLLM's default


_OWN_GAUGES = re.compile(
    r"vllm:(num_requests_running|num_requests_waiting|kv_cache_usage_perc|cache_config_info)\b"
)


def other_families(text: str) -> str:
    """A real engine's /metrics text without the lines of the gauges a fixed worker reports
    itself (samples, HELP and TYPE alike)."""
    lines = [line for line in text.splitlines() if not _OWN_GAUGES.search(line)]
    return "\n".join(lines) + "\n" if lines else ""


def restricted(text: str, names: set[str]) -> str:
    """`text` with only the samples (and HELP/TYPE lines) of `names`: what prometheus_client,
    which serves vLLM's /metrics, answers a request naming them with `name[]`."""

    def name_of(line: str) -> str:
        if line.startswith("#"):
            parts = line.split(None, 3)
            return parts[2] if len(parts) > 2 else ""
        return re.split(r"[{\s]", line, maxsplit=1)[0]

    lines = [line for line in text.splitlines() if name_of(line) in names]
    return "\n".join(lines) + "\n" if lines else ""


class FixedWorker:
    """Settings and counters shared by every connection of one worker process."""

    def __init__(
        self,
        role: str,
        model: str,
        interval_s: float,
        prefill_s: float,
        first_token_s: float | None,
        host: str,
        port: int,
        kv_blocks: int = DEFAULT_KV_BLOCKS,
        metrics_extra: str = "",
    ) -> None:
        self.role = role
        self.model = model
        self.interval_s = interval_s
        self.prefill_s = prefill_s
        self.first_token_s = interval_s if first_token_s is None else first_token_s
        self.host = host
        self.port = port
        self.kv_blocks = kv_blocks
        # A real engine's other families, served after this worker's own (`--metrics-extra`).
        self.metrics_extra = metrics_extra
        self.engine_id = uuid.uuid4().hex
        self.running = 0
        self.served = 0
        self.tokens = 0
        self.connections = 0  # accepted since start: shows whether clients keep connections

    def metrics_text(self) -> str:
        """vLLM's load gauges and `vllm:cache_config_info` (a router started with no
        configuration file, router/edge/dropin.py, reads the KV capacity from it), then this
        worker's own counters (the benchmark's upstream accounting)."""
        model = self.model
        return (
            f'vllm:num_requests_running{{model_name="{model}"}} {self.running}\n'
            f'vllm:num_requests_waiting{{model_name="{model}"}} 0\n'
            f'vllm:kv_cache_usage_perc{{model_name="{model}"}} 0.0\n'
            "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n"
            "# TYPE vllm:cache_config_info gauge\n"
            f'vllm:cache_config_info{{block_size="{BLOCK_SIZE}",cache_dtype="auto",'
            f'engine="0",num_gpu_blocks="{self.kv_blocks}"}} 1.0\n'
            f"fixed_worker_connections_total {self.connections}\n"
            f"fixed_worker_requests_total {self.served}\n"
            f"fixed_worker_tokens_total {self.tokens}\n"
        ) + self.metrics_extra

    def __repr__(self) -> str:
        return (
            f"FixedWorker({self.role} :{self.port} interval={self.interval_s * 1e3:g}ms "
            f"running={self.running} served={self.served} tokens={self.tokens})"
        )


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def _sse(obj: Any) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


_STREAM_HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncache-control: no-cache\r\n"
    b"transfer-encoding: chunked\r\n"
)
_DONE = _chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n"


class _Stream:
    """One decode answer: pre-built token bytes written on a fixed schedule."""

    __slots__ = (
        "conn",
        "n",
        "sent",
        "first_at",
        "interval",
        "token",
        "last",
        "handle",
        "whole",
        "text",
    )

    def __init__(
        self,
        conn: _Conn,
        n: int,
        first_at: float,
        interval: float,
        token: bytes,
        last: bytes,
        whole: bool,
    ) -> None:
        self.conn = conn
        self.n = n
        self.sent = 0
        self.first_at = first_at
        self.interval = interval
        self.token = token
        self.last = last
        self.whole = whole
        self.handle: asyncio.TimerHandle | None = None

    def tick(self) -> None:
        conn = self.conn
        transport = conn.transport
        if transport is None or transport.is_closing():
            conn.finish_stream(aborted=True)
            return
        loop = conn.loop
        now = loop.time()
        due = (
            min(self.n, int((now - self.first_at) / self.interval + 0.25) + 1)
            if self.interval
            else self.n
        )
        if conn.paused and due < self.n:
            # The reader is behind: let tokens accumulate and write them together later.
            self.handle = loop.call_at(now + max(self.interval, 0.001), self.tick)
            return
        k = due - self.sent
        if k > 0 and not self.whole:
            if due == self.n:
                out = self.token * (k - 1) + self.last + _DONE
            else:
                out = self.token * k
            transport.write(out)
        self.sent = due
        if due >= self.n:
            if self.whole:
                transport.write(conn.whole_answer(self.n))
            conn.worker.tokens += self.n
            conn.finish_stream(aborted=False)
            return
        self.handle = loop.call_at(self.first_at + self.sent * self.interval, self.tick)


class _Conn(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection; requests are served one after another."""

    def __init__(self, worker: FixedWorker) -> None:
        self.worker = worker
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.busy = False
        self.paused = False
        self.close_after = False
        self.stream: _Stream | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.req: tuple[bytes, bytes, dict[bytes, bytes], bytes] | None = None

    # -- transport callbacks --------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A TCP connection (uvloop's or asyncio's), so a full Transport: written, paused, closed.
        self.transport = cast(asyncio.Transport, transport)
        self.worker.connections += 1
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(_socket.IPPROTO_TCP, _socket.TCP_NODELAY, 1)

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        if self.stream is not None and self.stream.handle is not None:
            self.stream.handle.cancel()
            self.finish_stream(aborted=True)
        if self.timer is not None:
            self.timer.cancel()

    def pause_writing(self) -> None:
        self.paused = True

    def resume_writing(self) -> None:
        self.paused = False

    def data_received(self, data: bytes) -> None:
        if not self.buf and data.startswith(b"PRI * HTTP/2.0"):
            # An HTTP/2 prior-knowledge probe (SGLang's router tries one): HTTP/1.1 only here.
            assert self.transport is not None
            self.transport.close()
            return
        self.buf += data
        if not self.busy:
            self._next_request()

    # -- request parsing ------------------------------------------------------------------------
    def _next_request(self) -> None:
        buf = self.buf
        end = buf.find(b"\r\n\r\n")
        if end < 0:
            return
        head = bytes(buf[:end]).split(b"\r\n")
        try:
            method, target, _ = head[0].split(b" ", 2)
        except ValueError:
            self._reply(400, b'{"error":"bad request line"}', close=True)
            return
        headers: dict[bytes, bytes] = {}
        for line in head[1:]:
            name, _, value = line.partition(b":")
            headers[name.strip().lower()] = value.strip()
        start = end + 4
        if headers.get(b"transfer-encoding", b"").lower() == b"chunked":
            body, consumed = _dechunk(buf, start)
            if body is None:
                return
        else:
            length = int(headers.get(b"content-length", b"0") or 0)
            if length > _MAX_BODY:
                self._reply(413, b'{"error":"body too large"}', close=True)
                return
            if len(buf) < start + length:
                return
            body, consumed = bytes(buf[start : start + length]), start + length
        del buf[:consumed]
        self.close_after = headers.get(b"connection", b"").lower() == b"close"
        self.busy = True
        self._dispatch(method, target, headers, body)

    def _done(self) -> None:
        self.busy = False
        if self.close_after and self.transport is not None:
            self.transport.close()
            return
        if self.buf:
            self._next_request()

    def _reply(
        self, status: int, body: bytes, ctype: bytes = b"application/json", close: bool = False
    ) -> None:
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        reason = {200: b"OK", 400: b"Bad Request", 404: b"Not Found", 413: b"Too Large"}.get(
            status, b"Error"
        )
        transport.write(
            b"HTTP/1.1 %d %s\r\ncontent-type: %s\r\ncontent-length: %d\r\n\r\n%s"
            % (status, reason, ctype, len(body), body)
        )
        if close:
            transport.close()
        else:
            self._done()

    # -- endpoints ------------------------------------------------------------------------------
    def _dispatch(
        self, method: bytes, path: bytes, headers: dict[bytes, bytes], body: bytes
    ) -> None:
        w = self.worker
        path, _, query = path.partition(b"?")
        if method == b"GET":
            if path == b"/health" or path == b"/health_generate":
                self._reply(200, b"")
            elif path == b"/v1/models":
                self._reply(
                    200,
                    orjson.dumps(
                        {
                            "object": "list",
                            "data": [
                                {
                                    "id": w.model,
                                    "object": "model",
                                    "created": 0,
                                    "owned_by": "fixed",
                                    "root": w.model,
                                    "parent": None,
                                    "max_model_len": 32768,
                                }
                            ],
                        }
                    ),
                )
            elif path == b"/version":
                self._reply(200, b'{"version":"0.0.0-fixed"}')
            elif path in (b"/metrics", b"/metrics/"):  # as vLLM: /metrics/ is the same text
                text = w.metrics_text()
                names = parse_qs(query.decode("latin-1")).get("name[]")
                if names:  # as prometheus_client: only the families named
                    text = restricted(text, set(names))
                self._reply(200, text.encode(), b"text/plain; version=0.0.4")
            elif path in (b"/server_info", b"/get_server_info"):
                self._reply(
                    200,
                    orjson.dumps(
                        {
                            "model_path": w.model,
                            "tokenizer_path": w.model,
                            "served_model_name": w.model,
                            "dp_size": 1,
                            "tp_size": 1,
                            "disaggregation_mode": w.role,
                            "disaggregation_bootstrap_port": None,
                            "version": "0.0.0-fixed",
                        }
                    ),
                )
            elif path in (b"/model_info", b"/get_model_info"):
                self._reply(
                    200,
                    orjson.dumps(
                        {"model_path": w.model, "tokenizer_path": w.model, "is_generation": True}
                    ),
                )
            elif path == b"/get_load":
                self._reply(
                    200,
                    orjson.dumps(
                        [
                            {
                                "dp_rank": 0,
                                "num_reqs": w.running,
                                "num_waiting_reqs": 0,
                                "num_tokens": 0,
                            }
                        ]
                    ),
                )
            else:
                self._reply(404, b'{"error":{"message":"not found","type":"NotFoundError"}}')
            return
        if method != b"POST" or path not in (b"/v1/completions", _CHAT, b"/generate"):
            self._reply(404, b'{"error":{"message":"not found","type":"NotFoundError"}}')
            return
        try:
            req = orjson.loads(body)
            if not isinstance(req, dict):
                raise ValueError("not an object")
        except ValueError:
            self._reply(400, b'{"error":{"message":"invalid JSON","type":"BadRequestError"}}')
            return
        rid = headers.get(b"x-request-id", b"").decode() or uuid.uuid4().hex
        kv = req.get("kv_transfer_params")
        is_prefill = (isinstance(kv, dict) and bool(kv.get("do_remote_decode"))) or (
            "bootstrap_room" in req and w.role == "prefill"
        )
        self.req = (path, rid.encode(), headers, body)
        self._parsed = req
        self._chat = path == _CHAT
        if is_prefill:
            w.running += 1
            self.timer = self.loop.call_later(w.prefill_s, self._prefill_done)
        else:
            self._start_decode()

    def _prefill_done(self) -> None:
        w = self.worker
        w.running -= 1
        w.served += 1
        self.timer = None
        req = self._parsed
        assert self.req is not None
        rid = self.req[1].decode()
        if req.get("stream") is True:  # SGLang sends the client's body to P as it is
            self._begin_stream()
            tok, last = self._token_events(rid)
            assert self.transport is not None
            if not self.transport.is_closing():
                self.transport.write(last + _DONE)
            self.stream = None
            self._done()
            return
        params = None
        if isinstance(req.get("kv_transfer_params"), dict):
            params = {
                "do_remote_prefill": True,
                "do_remote_decode": False,
                "remote_engine_id": w.engine_id,
                "remote_block_ids": [1, 2, 3],
                "remote_request_id": rid,
                "remote_host": w.host,
                "remote_port": 5600,
                "tp_size": 1,
            }
        self._reply(200, self._whole(rid, 1, params))

    def _whole(self, rid: str, n: int, params: Any) -> bytes:
        text = _TOKEN_TEXT * n
        if self._chat:
            choice: dict[str, Any] = {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": None,
                "finish_reason": "length",
            }
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": "length"}
        return orjson.dumps(
            {
                "id": ("chatcmpl-" if self._chat else "cmpl-") + rid,
                "object": "chat.completion" if self._chat else "text_completion",
                "created": int(time.time()),
                "model": self.worker.model,
                "choices": [choice],
                "usage": {"prompt_tokens": 8, "completion_tokens": n, "total_tokens": 8 + n},
                "kv_transfer_params": params,
            }
        )

    def whole_answer(self, n: int) -> bytes:
        assert self.req is not None
        body = self._whole(self.req[1].decode(), n, None)
        return (
            b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n%s" % (len(body), body)
        )

    def _token_events(self, rid: str) -> tuple[bytes, bytes]:
        created = int(time.time())
        model = self.worker.model
        if self._chat:
            base = {
                "id": "chatcmpl-" + rid,
                "object": "chat.completion.chunk",
                "created": created,
                "model": model,
            }
            tok = _sse(
                {
                    **base,
                    "choices": [
                        {
                            "index": 0,
                            "delta": {"content": _TOKEN_TEXT},
                            "logprobs": None,
                            "finish_reason": None,
                        }
                    ],
                }
            )
            fin = _sse(
                {
                    **base,
                    "choices": [
                        {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "length"}
                    ],
                }
            )
            return _chunk(tok), _chunk(tok + fin)
        base = {
            "id": "cmpl-" + rid,
            "object": "text_completion",
            "created": created,
            "model": model,
        }
        tok = _sse(
            {
                **base,
                "choices": [
                    {
                        "index": 0,
                        "text": _TOKEN_TEXT,
                        "logprobs": None,
                        "finish_reason": None,
                        "stop_reason": None,
                    }
                ],
            }
        )
        last = _sse(
            {
                **base,
                "choices": [
                    {
                        "index": 0,
                        "text": _TOKEN_TEXT,
                        "logprobs": None,
                        "finish_reason": "length",
                        "stop_reason": None,
                    }
                ],
            }
        )
        return _chunk(tok), _chunk(last)

    def _begin_stream(self) -> None:
        assert self.transport is not None and self.req is not None
        head = _STREAM_HEAD + b"x-request-id: " + self.req[1] + b"\r\n\r\n"
        if self._chat:
            rid = self.req[1].decode()
            head += _chunk(
                _sse(
                    {
                        "id": "chatcmpl-" + rid,
                        "object": "chat.completion.chunk",
                        "created": int(time.time()),
                        "model": self.worker.model,
                        "choices": [
                            {
                                "index": 0,
                                "delta": {"role": "assistant", "content": ""},
                                "logprobs": None,
                                "finish_reason": None,
                            }
                        ],
                    }
                )
            )
        self.transport.write(head)

    def _start_decode(self) -> None:
        w = self.worker
        req = self._parsed
        n = (
            req.get("max_tokens")
            or req.get("max_completion_tokens")
            or req.get("sampling_params", {}).get("max_new_tokens")
            or 16
        )
        n = max(1, int(n))
        assert self.req is not None
        rid = self.req[1].decode()
        whole = req.get("stream") is not True
        token, last = self._token_events(rid)
        if not whole:
            self._begin_stream()
        w.running += 1
        now = self.loop.time()
        s = _Stream(self, n, now + w.first_token_s, w.interval_s, token, last, whole)
        self.stream = s
        s.handle = self.loop.call_at(s.first_at, s.tick)

    def finish_stream(self, aborted: bool) -> None:
        if self.stream is None:
            return
        self.stream = None
        self.worker.running -= 1
        if aborted:
            return
        self.worker.served += 1
        self._done()


# Own chunked decoder on purpose: the bench shares no parser with the router.
def _dechunk(buf: bytearray, pos: int) -> tuple[bytes | None, int]:
    """A chunked request body from `buf[pos:]`: (body, end) or (None, 0) when incomplete."""
    parts: list[bytes] = []
    while True:
        eol = buf.find(b"\r\n", pos)
        if eol < 0:
            return None, 0
        size = int(bytes(buf[pos:eol]).split(b";")[0], 16)
        start = eol + 2
        if size == 0:
            end = buf.find(b"\r\n\r\n", eol)
            if end < 0:
                return None, 0
            return b"".join(parts), end + 4
        if len(buf) < start + size + 2:
            return None, 0
        parts.append(bytes(buf[start : start + size]))
        pos = start + size + 2


async def serve(worker: FixedWorker, ready: Any = None) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(
        lambda: _Conn(worker), worker.host, worker.port, backlog=4096, reuse_address=True
    )
    worker.port = server.sockets[0].getsockname()[1]
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    print(f"fixed worker {worker.role} listening on http://{worker.host}:{worker.port}", flush=True)
    if ready is not None:
        ready(worker)
    async with server:
        await stop.wait()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m disagg_tools.overhead.fixed_worker",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--role", choices=("prefill", "decode"), required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--model", default="llama-3-8b")
    p.add_argument("--interval-ms", type=float, default=20.0, help="time between tokens")
    p.add_argument(
        "--first-token-ms",
        type=float,
        default=None,
        help="decode: request to first token (default: one interval)",
    )
    p.add_argument("--prefill-ms", type=float, default=10.0, help="prefill answer delay")
    p.add_argument(
        "--kv-blocks",
        type=int,
        default=DEFAULT_KV_BLOCKS,
        help="KV capacity reported in /metrics (vllm:cache_config_info num_gpu_blocks)",
    )
    p.add_argument(
        "--metrics-extra",
        type=Path,
        default=None,
        help="a real engine's /metrics text: its families other than the gauges this worker "
        "reports are served too, so that reading /metrics costs the router what it costs "
        "against that engine (tests/router/workers/texts/vllm-0.32-metrics.txt: 53 KB)",
    )
    ns = p.parse_args(argv)
    worker = FixedWorker(
        ns.role,
        ns.model,
        ns.interval_ms / 1e3,
        ns.prefill_ms / 1e3,
        None if ns.first_token_ms is None else ns.first_token_ms / 1e3,
        ns.host,
        ns.port,
        ns.kv_blocks,
        other_families(ns.metrics_extra.read_text()) if ns.metrics_extra else "",
    )
    uvrun.run(serve(worker))
    return 0


if __name__ == "__main__":
    sys.exit(main())
