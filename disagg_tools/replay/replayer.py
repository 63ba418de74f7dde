"""Open-loop trace replay against any OpenAI-compatible endpoint.

Open loop: request i is sent at its arrival time whether or not earlier ones have finished, so a
slow server sees the queue build up exactly as production would (a closed loop would hide it by
slowing the client down). Every request is streamed and timed per SSE chunk:

    send ── TTFT ──> chunk 1 ── gap ──> chunk 2 ── gap ──> ... ── [DONE]      (one chunk = 1 token)

The true output length goes only in the `X-Sim-Output-Tokens` header, which the simulated
workers replay; `max_tokens` is the realistic cap a client would send (the router must not read
the header, so its length estimator is tested honestly).

Time scaling: with `time_scale` S, arrival gaps are divided by S on the wall clock (the simulated
workers are started S times faster too), and every time recorded here (arrival, send, TTFT, gaps,
end-to-end, duration) is multiplied back by S, so it reads as seconds of the real cluster.
`rate_scale` X multiplies the request rate (arrival gaps divided by X) and is already applied
to the recorded arrivals. `timeout_s` is in the same real-cluster seconds.
"""

from __future__ import annotations

import asyncio
import time
from array import array
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from email.utils import parsedate_to_datetime
from typing import Any, Literal

import aiohttp
import orjson

from disagg_tools.traces import TraceRequest, prompt_text

__all__ = [
    "ORACLE_HEADER",
    "OUTCOMES",
    "Endpoint",
    "Outcome",
    "ProgressFn",
    "ReplayResult",
    "RequestRecord",
    "endpoint_url",
    "replay",
]

ORACLE_HEADER = "X-Sim-Output-Tokens"
Outcome = Literal["ok", "rejected", "error", "timeout", "cut"]
OUTCOMES: tuple[Outcome, ...] = ("ok", "rejected", "error", "timeout", "cut")
Endpoint = Literal["chat", "completions"]
# Called after each request finishes: (finished so far, total, that request's record).
ProgressFn = Callable[[int, int, "RequestRecord"], None]

_ERROR_BODY_LIMIT = 2048
# Slack on top of the last arrival + per-request timeout before stragglers are cut off: every
# request is already bounded by its own timeout, this is the "never hang" backstop.
_BACKSTOP_SLACK_S = 5.0


@dataclass(slots=True)
class RequestRecord:
    """What one request did. Times are real-cluster seconds (wall × time_scale).

    `arrival_s` and `send_s` count from the start of the run; `ttft_s` and `e2e_s` from the
    send. `tokens` counts SSE chunks with content; `usage_tokens` is the server's own count.
    """

    index: int
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    send_s: float | None = None
    status: int | None = None
    outcome: Outcome = "timeout"  # until proven otherwise: a record never left unclassified
    ttft_s: float | None = None
    itl_s: array[float] = field(default_factory=lambda: array("d"))
    e2e_s: float | None = None
    tokens: int = 0
    usage_tokens: int | None = None
    retry_after_s: float | None = None
    error: str | None = None

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first: (e2e − TTFT) / (tokens − 1)."""
        if self.ttft_s is None or self.e2e_s is None or self.tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.tokens - 1)

    def to_dict(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "arrival_s": self.arrival_s,
            "send_s": self.send_s,
            "prompt_tokens": self.prompt_tokens,
            "output_tokens": self.output_tokens,
            "status": self.status,
            "outcome": self.outcome,
            "ttft_s": self.ttft_s,
            "tpot_s": self.tpot_s,
            "e2e_s": self.e2e_s,
            "tokens": self.tokens,
            "usage_tokens": self.usage_tokens,
            "retry_after_s": self.retry_after_s,
            "error": self.error,
            "itl_s": list(self.itl_s),
        }

    def __repr__(self) -> str:
        return (
            f"RequestRecord(#{self.index} {self.outcome} status={self.status} "
            f"tokens={self.tokens}/{self.output_tokens} ttft={self.ttft_s})"
        )


@dataclass(slots=True)
class ReplayResult:
    """All records of one run, in arrival order, and how the run was set up.

    `duration_s` runs from the first scheduled arrival to the last request's end
    (real-cluster seconds).
    """

    records: list[RequestRecord]
    duration_s: float
    base_url: str
    model: str
    endpoint: Endpoint
    time_scale: float
    rate_scale: float
    started_at_unix: float

    def counts(self) -> dict[str, int]:
        counts: dict[str, int] = dict.fromkeys(OUTCOMES, 0)
        for rec in self.records:
            counts[rec.outcome] += 1
        return counts

    def to_dict(self) -> dict[str, Any]:
        return {
            "base_url": self.base_url,
            "model": self.model,
            "endpoint": self.endpoint,
            "time_scale": self.time_scale,
            "rate_scale": self.rate_scale,
            "started_at_unix": self.started_at_unix,
            "duration_s": self.duration_s,
            "records": [r.to_dict() for r in self.records],
        }

    def __repr__(self) -> str:
        return (
            f"ReplayResult({len(self.records)} requests, {self.counts()}, {self.duration_s:.1f}s)"
        )


def endpoint_url(base_url: str, endpoint: Endpoint) -> str:
    """`http://h:p` or `http://h:p/v1` + the OpenAI path of `endpoint`."""
    base = base_url.rstrip("/")
    if not base.endswith("/v1"):
        base += "/v1"
    return base + ("/chat/completions" if endpoint == "chat" else "/completions")


async def replay(
    base_url: str,
    requests: Sequence[TraceRequest],
    *,
    model: str,
    endpoint: Endpoint = "chat",
    max_tokens_cap: int,
    time_scale: float = 1.0,
    rate_scale: float = 1.0,
    oracle_header: bool = True,
    api_key: str | None = None,
    timeout_s: float = 600.0,
    progress: ProgressFn | None = None,
    extra_headers: Mapping[str, str] | None = None,
    max_connections: int = 1024,
) -> ReplayResult:
    """Send `requests` open-loop at their arrival times and record every one of them.

    Returns when every request has finished, failed or timed out; the whole run is bounded by
    the last arrival plus `timeout_s` (plus a few seconds). `max_connections` bounds the pool:
    beyond it requests wait in the client and that wait counts in their TTFT.
    """
    if time_scale <= 0 or rate_scale <= 0:
        raise ValueError("time_scale and rate_scale must be > 0")
    if timeout_s <= 0 or max_tokens_cap < 1 or max_connections < 1:
        raise ValueError("timeout_s, max_tokens_cap and max_connections must be positive")
    if endpoint not in ("chat", "completions"):
        raise ValueError(f"endpoint must be 'chat' or 'completions', not {endpoint!r}")
    ordered = sorted(requests, key=lambda r: r.arrival_s)
    records = [
        RequestRecord(
            index=r.index,
            arrival_s=r.arrival_s / rate_scale,
            prompt_tokens=r.prompt_tokens,
            output_tokens=r.output_tokens,
        )
        for r in ordered
    ]
    run = _Run(
        url=endpoint_url(base_url, endpoint),
        endpoint=endpoint,
        model=model,
        max_tokens_cap=max_tokens_cap,
        time_scale=time_scale,
        timeout_wall=timeout_s / time_scale,
        headers=_base_headers(api_key, extra_headers),
        oracle_header=oracle_header,
        progress=progress,
        total=len(records),
    )
    started_at = time.time()
    # aiohttp sets TCP_NODELAY on every connection it opens (BaseProtocol.connection_made), so
    # small SSE chunks are not held back by Nagle's algorithm.
    connector = aiohttp.TCPConnector(limit=min(max_connections, max(1, len(records))))
    async with aiohttp.ClientSession(
        connector=connector, timeout=aiohttp.ClientTimeout(total=None)
    ) as session:
        run.t0 = time.perf_counter()
        await run.dispatch(session, ordered, records)
    end = run.last_end if run.last_end is not None else run.t0
    return ReplayResult(
        records=records,
        duration_s=max(0.0, end - run.t0) * time_scale,
        base_url=base_url,
        model=model,
        endpoint=endpoint,
        time_scale=time_scale,
        rate_scale=rate_scale,
        started_at_unix=started_at,
    )


@dataclass(slots=True)
class _Run:
    """The settings and clock of one replay; `dispatch` drives it."""

    url: str
    endpoint: Endpoint
    model: str
    max_tokens_cap: int
    time_scale: float
    timeout_wall: float
    headers: dict[str, str]
    oracle_header: bool
    progress: ProgressFn | None
    total: int
    t0: float = 0.0
    done: int = 0
    last_end: float | None = None

    def cluster_s(self, wall_delta: float) -> float:
        return wall_delta * self.time_scale

    async def dispatch(
        self,
        session: aiohttp.ClientSession,
        reqs: Sequence[TraceRequest],
        records: Sequence[RequestRecord],
    ) -> None:
        tasks: list[asyncio.Task[None]] = []
        try:
            for req, rec in zip(reqs, records, strict=True):
                # Build the body before sleeping, so long prompts are generated in the idle gap
                # rather than delaying the send.
                body = self.body(req)
                delay = self.t0 + rec.arrival_s / self.time_scale - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(self.one(session, req, rec, body)))
            if tasks:
                _, pending = await asyncio.wait(
                    tasks, timeout=self.timeout_wall + _BACKSTOP_SLACK_S
                )
                for task in pending:
                    task.cancel()
        finally:
            # Also reached when the replay itself is cancelled: no request outlives it.
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def body(self, req: TraceRequest) -> bytes:
        text = prompt_text(req)
        payload: dict[str, Any] = {
            "model": self.model,
            "max_tokens": self.max_tokens_cap,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.endpoint == "chat":
            payload["messages"] = [{"role": "user", "content": text}]
        else:
            payload["prompt"] = text
        return orjson.dumps(payload)

    async def one(
        self, session: aiohttp.ClientSession, req: TraceRequest, rec: RequestRecord, body: bytes
    ) -> None:
        headers = dict(self.headers)
        if self.oracle_header:
            headers[ORACLE_HEADER] = str(req.output_tokens)
        sent = time.perf_counter()
        rec.send_s = self.cluster_s(sent - self.t0)
        try:
            async with asyncio.timeout(self.timeout_wall):
                async with session.post(self.url, data=body, headers=headers) as resp:
                    rec.status = resp.status
                    if resp.status != 200:
                        await self._record_refusal(resp, rec)
                        return
                    await self._read_stream(resp, rec, sent)
        except TimeoutError:
            rec.outcome, rec.error = "timeout", "no answer within timeout_s"
        except asyncio.CancelledError:
            rec.outcome, rec.error = "timeout", "cut off by the run's backstop or cancellation"
            raise
        except (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError) as exc:
            # Mid-stream these mean the connection broke before [DONE].
            rec.outcome = "cut" if rec.status == 200 else "error"
            rec.error = f"{type(exc).__name__}: {exc}"
        except (aiohttp.ClientError, OSError, ValueError) as exc:
            rec.outcome, rec.error = "error", f"{type(exc).__name__}: {exc}"
        finally:
            end = time.perf_counter()
            rec.e2e_s = self.cluster_s(end - sent)
            self.last_end = end if self.last_end is None else max(self.last_end, end)
            self.done += 1
            if self.progress is not None:
                self.progress(self.done, self.total, rec)

    async def _record_refusal(self, resp: aiohttp.ClientResponse, rec: RequestRecord) -> None:
        rec.outcome = "rejected" if resp.status == 429 else "error"
        rec.retry_after_s = _parse_retry_after(resp.headers.get("Retry-After"))
        raw = await resp.content.read(_ERROR_BODY_LIMIT)
        rec.error = _error_message(raw) or f"HTTP {resp.status}"

    async def _read_stream(
        self, resp: aiohttp.ClientResponse, rec: RequestRecord, sent: float
    ) -> None:
        """Parse SSE events until [DONE]; classify the outcome on the way out."""
        last_token: float | None = None
        data: list[bytes] = []
        async for raw in resp.content:
            line = raw.rstrip(b"\r\n")
            if line and not line.startswith(b":"):  # ":" lines are comments (keep-alive)
                name, _, value = line.partition(b":")
                if name == b"data":
                    data.append(value[1:] if value.startswith(b" ") else value)
                continue
            if not line and data:
                now = time.perf_counter()
                verdict = self._event(b"\n".join(data), rec)
                data.clear()
                if verdict == "token":
                    if last_token is None:
                        rec.ttft_s = self.cluster_s(now - sent)
                    else:
                        rec.itl_s.append(self.cluster_s(now - last_token))
                    last_token = now
                elif verdict is not None:
                    rec.outcome = verdict
                    return
        # A final event without its blank line still counts, if it is the terminator.
        if data and self._event(b"\n".join(data), rec) == "ok":
            rec.outcome = "ok"
            return
        rec.outcome = "cut"
        rec.error = rec.error or "stream ended without [DONE]"

    def _event(self, payload: bytes, rec: RequestRecord) -> Literal["token", "ok", "error"] | None:
        """Classify one SSE data payload; None for a chunk that carries no token."""
        if payload.strip() == b"[DONE]":
            return "ok"
        try:
            chunk = orjson.loads(payload)
        except orjson.JSONDecodeError:
            rec.error = f"invalid JSON in stream: {payload[:200]!r}"
            return "error"
        if not isinstance(chunk, dict):
            rec.error = f"unexpected stream frame: {payload[:200]!r}"
            return "error"
        if "error" in chunk or chunk.get("object") == "error":
            rec.error = _error_message(payload) or "error frame in stream"
            return "error"
        usage = chunk.get("usage")
        if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
            rec.usage_tokens = usage["completion_tokens"]
        for choice in chunk.get("choices") or ():
            if _choice_text(choice):
                rec.tokens += 1
                return "token"
        return None


def _choice_text(choice: Any) -> str:
    if not isinstance(choice, dict):
        return ""
    delta = choice.get("delta")
    if isinstance(delta, dict):
        content = delta.get("content") or delta.get("reasoning_content")
        return content if isinstance(content, str) else ""
    text = choice.get("text")
    return text if isinstance(text, str) else ""


def _base_headers(api_key: str | None, extra: Mapping[str, str] | None) -> dict[str, str]:
    headers = {"Content-Type": "application/json", "Accept": "text/event-stream"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    if extra:
        headers.update(extra)
    return headers


def _parse_retry_after(value: str | None) -> float | None:
    """Retry-After as seconds: either delta-seconds or an HTTP date (RFC 9110 §10.2.3)."""
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


def _error_message(raw: bytes) -> str | None:
    """The message of an OpenAI error body (nested or flat), or the raw text."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        text = raw.decode("utf-8", "replace").strip()
        return text[:200] or None
    if isinstance(body, dict):
        err = body.get("error", body)
        if isinstance(err, dict) and isinstance(err.get("message"), str):
            return str(err["message"])
        if isinstance(err, str):
            return err
    return raw.decode("utf-8", "replace")[:200]
