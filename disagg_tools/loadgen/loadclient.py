"""A many-connection checking client: every answer compared token for token with the sim's text.

The simulated workers answer with `disagg_tools.sim.textgen`'s deterministic greedy text, so the
client knows what must arrive before it sends: `expected_answer(path, body, headers)` with the
same `X-Sim-Output-Tokens` header the router forwards to the workers. Every request ends in
exactly one outcome:

    ok           200, the exact expected text and finish reason ([DONE] seen when streaming)
    shed         429 with a Retry-After and an OpenAI JSON error body (admission may shed)
    unavailable  503 with a Retry-After and an OpenAI JSON error body
    stream_error 200, then a valid SSE error frame and [DONE] (a clean mid-stream end)
    vanished     the client itself went away mid-stream on purpose (soak)
    -- failures --
    http_5xx     any other 5xx (or a 503 without Retry-After), e.g. the router's 500
    bad_refusal  a 429 without Retry-After or without an OpenAI JSON body
    http_4xx     any other status
    wrong_text   an answer that differs from the expected text (or finish reason)
    cut          a stream that ended without [DONE], or a broken frame
    hang         no end within the request's deadline
    conn_error   the connection failed (refused, reset before an answer)

`clean` is the set a tool accepts; the load run accepts ok and shed only, the soak all five.
"""

from __future__ import annotations

import asyncio
import re
import time
from array import array
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson

from disagg_tools.sim.textgen import expected_answer

__all__ = [
    "CLEAN",
    "FAILURES",
    "ORACLE_HEADER",
    "LoadRequest",
    "Result",
    "failure_examples",
    "failure_kinds",
    "make_request",
    "outcome_counts",
    "new_session",
    "percentiles",
    "send",
]

ORACLE_HEADER = "X-Sim-Output-Tokens"
CLEAN = ("ok", "shed", "unavailable", "stream_error", "vanished")
FAILURES = ("http_5xx", "bad_refusal", "http_4xx", "wrong_text", "cut", "hang", "conn_error")
_BODY_LIMIT = 4096
_clock = time.perf_counter

# Words for prompts: deterministic per request index, 4 characters per token like the sim.
_SYL = [c + v for c in "bdfgklmnprstvz" for v in "aeiou"]


def _prompt(index: int, tokens: int) -> str:
    words = [
        _SYL[(index * 7 + i * 13) % 70] + _SYL[(index + i * 31) % 70][0] for i in range(tokens)
    ]
    return f"req{index} " + " ".join(words)


@dataclass(frozen=True, slots=True)
class LoadRequest:
    """One request, ready to send, with the answer it must get."""

    index: int
    path: str
    body: bytes
    headers: Mapping[str, str]
    stream: bool
    expected_text: str
    expected_tokens: int
    expected_finish: str


def make_request(
    index: int,
    *,
    model: str,
    prompt_tokens: int,
    output_tokens: int,
    stream: bool = True,
    chat: bool = True,
    max_tokens: int | None = None,
    prompt: str | None = None,
    mean_output_tokens: int = 128,
) -> LoadRequest:
    text = prompt if prompt is not None else _prompt(index, prompt_tokens)
    payload: dict[str, Any] = {
        "model": model,
        "max_tokens": max_tokens or output_tokens,
        "stream": stream,
    }
    if stream:
        payload["stream_options"] = {"include_usage": True}
    if chat:
        path = "/v1/chat/completions"
        payload["messages"] = [{"role": "user", "content": text}]
    else:
        path = "/v1/completions"
        payload["prompt"] = text
    headers = {ORACLE_HEADER: str(output_tokens), "Content-Type": "application/json"}
    exp_text, exp_n, exp_finish = expected_answer(path, payload, headers, mean_output_tokens)
    return LoadRequest(
        index, path, orjson.dumps(payload), headers, stream, exp_text, exp_n, exp_finish
    )


@dataclass(slots=True)
class Result:
    """What one request did; times are perf_counter seconds, `ttft_s` and `itl_s` durations."""

    index: int
    outcome: str = "hang"
    status: int | None = None
    detail: str = ""
    t_send: float = 0.0
    t_end: float = 0.0
    ttft_s: float | None = None
    itl_s: array[float] = field(default_factory=lambda: array("d"))
    tokens: int = 0
    retry_after: str | None = None
    # A stream that ended with an error frame: whether what it sent before was an exact prefix
    # of the expected answer (no wrong, repeated or missing token before the end); None else.
    prefix_exact: bool | None = None

    @property
    def failed(self) -> bool:
        return self.outcome in FAILURES

    def __repr__(self) -> str:
        return f"Result(#{self.index} {self.outcome} status={self.status} {self.detail[:120]!r})"


def new_session(limit: int) -> aiohttp.ClientSession:
    """One session for all streams: `limit` connections, no total timeout (deadlines are ours)."""
    connector = aiohttp.TCPConnector(
        limit=limit, limit_per_host=limit, force_close=False, enable_cleanup_closed=False
    )
    return aiohttp.ClientSession(
        connector=connector,
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=None),
    )


def _openai_error(raw: bytes) -> str | None:
    """The message of an OpenAI error body {"error": {"message": ...}}, or None if not one."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None
    err = body.get("error") if isinstance(body, dict) else None
    if isinstance(err, dict) and isinstance(err.get("message"), str):
        return str(err["message"])
    return None


async def send(
    session: aiohttp.ClientSession,
    base_url: str,
    req: LoadRequest,
    *,
    deadline_s: float,
    vanish_after_tokens: int | None = None,
    on_token: Callable[[], None] | None = None,
) -> Result:
    """Send one request and classify its end; never raises (except cancellation)."""
    res = Result(req.index)
    res.t_send = _clock()
    try:
        async with asyncio.timeout(deadline_s):
            async with session.post(
                base_url + req.path, data=req.body, headers=req.headers
            ) as resp:
                res.status = resp.status
                if resp.status != 200:
                    await _refusal(resp, res)
                elif req.stream:
                    await _stream(resp, req, res, vanish_after_tokens, on_token)
                else:
                    await _whole(resp, req, res)
    except aiohttp.ServerTimeoutError as exc:  # connect or read timeout of the connector
        res.outcome = "cut" if res.status == 200 else "conn_error"
        res.detail = f"{type(exc).__name__} after {_clock() - res.t_send:.1f} s: {exc}"
    except TimeoutError:
        res.outcome = "hang"
        res.detail = f"no end within {deadline_s:.0f} s (status {res.status}, {res.tokens} tokens)"
    except (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError) as exc:
        res.outcome = "cut" if res.status == 200 else "conn_error"
        res.detail = f"{type(exc).__name__} after {_clock() - res.t_send:.1f} s: {exc}"
    except (aiohttp.ClientError, OSError) as exc:
        res.outcome = "conn_error"
        res.detail = f"{type(exc).__name__} after {_clock() - res.t_send:.1f} s: {exc}"
    finally:
        res.t_end = _clock()
    return res


async def _refusal(resp: aiohttp.ClientResponse, res: Result) -> None:
    raw = await resp.content.read(_BODY_LIMIT)
    message = _openai_error(raw)
    res.retry_after = resp.headers.get("Retry-After")
    has_retry = res.retry_after is not None and res.retry_after.strip().isdigit()
    res.detail = message or raw[:200].decode("utf-8", "replace")
    if resp.status == 429:
        res.outcome = "shed" if has_retry and message is not None else "bad_refusal"
    elif resp.status == 503 and has_retry and message is not None:
        res.outcome = "unavailable"
    elif resp.status >= 500:
        res.outcome = "http_5xx"
    else:
        res.outcome = "http_4xx"


async def _whole(resp: aiohttp.ClientResponse, req: LoadRequest, res: Result) -> None:
    raw = await resp.read()
    res.ttft_s = _clock() - res.t_send
    try:
        body = orjson.loads(raw)
        choice = body["choices"][0]
        text = choice["message"]["content"] if "message" in choice else choice["text"]
        finish = choice.get("finish_reason")
    except orjson.JSONDecodeError as exc:
        res.outcome, res.detail = "cut", f"truncated or invalid JSON ({exc}): {raw[:200]!r}"
        return
    except (KeyError, IndexError, TypeError) as exc:
        # Valid JSON, but not one answer (e.g. `"choices": []`): a wrong answer, not a cut one.
        res.outcome, res.detail = "wrong_text", f"not an OpenAI answer ({exc!r}): {raw[:200]!r}"
        return
    res.tokens = req.expected_tokens if text == req.expected_text else 0
    _verdict(req, res, text, finish)


def _verdict(req: LoadRequest, res: Result, text: str, finish: Any) -> None:
    if text == req.expected_text and finish == req.expected_finish:
        res.outcome = "ok"
        return
    res.outcome = "wrong_text"
    i = next(
        (k for k, (a, b) in enumerate(zip(text, req.expected_text, strict=False)) if a != b),
        min(len(text), len(req.expected_text)),
    )
    res.detail = (
        f"{len(text)} chars (expected {len(req.expected_text)}), finish {finish!r} "
        f"(expected {req.expected_finish!r}), first difference at char {i}: "
        f"{text[i : i + 30]!r} vs {req.expected_text[i : i + 30]!r}"
    )


async def _stream(
    resp: aiohttp.ClientResponse,
    req: LoadRequest,
    res: Result,
    vanish_after: int | None,
    on_token: Callable[[], None] | None,
) -> None:
    pieces: list[str] = []
    finish: Any = None
    errored = False
    last: float | None = None
    async for raw in resp.content:
        line = raw.rstrip(b"\r\n")
        if not line.startswith(b"data:"):
            continue  # blank separators, ":" keep-alive comments, event:/id: fields
        payload = line[5:].strip()
        if payload == b"[DONE]":
            if errored:
                res.outcome = "stream_error"
                res.prefix_exact = req.expected_text.startswith("".join(pieces))
            else:
                _verdict(req, res, "".join(pieces), finish)
            return
        if errored:
            res.outcome, res.detail = "cut", f"data after an error frame: {payload[:120]!r}"
            return
        try:
            chunk = orjson.loads(payload)
        except orjson.JSONDecodeError:
            res.outcome, res.detail = "cut", f"invalid JSON frame: {payload[:120]!r}"
            return
        if not isinstance(chunk, dict):
            res.outcome, res.detail = "cut", f"not an object: {payload[:120]!r}"
            return
        if "error" in chunk:
            message = _openai_error(payload)
            if message is None:
                res.outcome, res.detail = "cut", f"malformed error frame: {payload[:120]!r}"
                return
            errored, res.detail = True, message
            continue
        for choice in chunk.get("choices") or ():
            delta = choice.get("delta")
            text = delta.get("content") if isinstance(delta, dict) else choice.get("text")
            if choice.get("finish_reason") is not None:
                finish = choice["finish_reason"]
            if text:
                now = _clock()
                if last is None:
                    res.ttft_s = now - res.t_send
                else:
                    res.itl_s.append(now - last)
                last = now
                pieces.append(text)
                res.tokens += 1
                if on_token is not None:
                    on_token()
        if vanish_after is not None and res.tokens >= vanish_after:
            res.outcome, res.detail = "vanished", f"left after {res.tokens} tokens"
            resp.close()
            return
    res.outcome = "cut"
    res.detail = res.detail or f"stream ended without [DONE] after {res.tokens} tokens"


def percentiles(
    values: list[float] | array[float], ps: tuple[float, ...] = (50, 90, 99)
) -> dict[str, float | None]:
    if not values:
        return {f"p{p:g}": None for p in ps}
    ordered = sorted(values)
    n = len(ordered)
    return {f"p{p:g}": ordered[min(n - 1, max(0, round(p / 100 * n + 0.5) - 1))] for p in ps}


def failure_examples(
    results: list[Result], allowed: tuple[str, ...], per_kind: int = 3
) -> list[str]:
    """A few failures of each kind, so a rare kind is not hidden behind a common one."""
    seen: Counter[str] = Counter()
    out = []
    for r in results:
        if r.outcome not in allowed and seen[r.outcome] < per_kind:
            seen[r.outcome] += 1
            out.append(repr(r))
    return out


def failure_kinds(results: list[Result], allowed: tuple[str, ...]) -> dict[str, int]:
    """Failures counted by outcome and the start of their detail (numbers masked)."""
    kinds: Counter[str] = Counter()
    for r in results:
        if r.outcome not in allowed:
            kinds[f"{r.outcome}: {re.sub(r'[0-9.]+', 'N', r.detail)[:60]}"] += 1
    return dict(kinds.most_common(10))


def outcome_counts(results: list[Result]) -> dict[str, int]:
    counts = Counter(r.outcome for r in results)
    return {k: counts.get(k, 0) for k in (*CLEAN, *FAILURES) if counts.get(k, 0)}
