"""The flood benchmark's load: one open-loop Poisson stream of streamed completions per tenant.

Each tenant sends with its own API key at its own rate; arrivals do not wait for answers (a
client that waited would slow itself down under a flood and hide it). One `Shot` per request:

    200     first token time (TTFT from the request's start), tokens, whether `[DONE]` came;
            an `"error"` event inside the stream is recorded as `stream_error`
    not 200 the status, the body's `error.code` and the `Retry-After` header as sent
    failed   the exception's name (connection refused, the client's own timeout)

aiohttp, not the overhead ladder's raw client: the rates here are tens a second, and reading
statuses, headers and error bodies is what is measured, not the client's CPU.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass

import aiohttp
import orjson

__all__ = ["Shot", "TenantLoad", "run_tenants"]

_clock = time.perf_counter
# About 50 prompt tokens at the router's 4 characters a token (no tokenizer is configured).
_PROMPT = "Summarise in one line why a router keeps tenants apart when one floods. " * 3


@dataclass(frozen=True, slots=True)
class TenantLoad:
    """One tenant's stream: its key, its Poisson rate (requests/s) and each answer's length."""

    tenant: str
    key: str
    rate: float
    max_tokens: int


@dataclass(slots=True)
class Shot:
    """One request as the client saw it; times in seconds from the run's start."""

    tenant: str
    sent: float
    status: int = 0
    ttft: float | None = None
    end: float | None = None
    tokens: int = 0
    done: bool = False
    code: str | None = None
    retry_after: str | None = None
    error: str | None = None

    @property
    def answered(self) -> bool:
        return self.status == 200 and self.done and self.error is None


def _body(model: str, max_tokens: int) -> bytes:
    return orjson.dumps(
        {
            "model": model,
            "prompt": _PROMPT,
            "max_tokens": max_tokens,
            "stream": True,
            "ignore_eos": True,
            "temperature": 0.0,
        }
    )


async def _shoot(
    session: aiohttp.ClientSession, url: str, load: TenantLoad, body: bytes, shot: Shot, t0: float
) -> None:
    headers = {"Authorization": f"Bearer {load.key}", "Content-Type": "application/json"}
    start = _clock()
    try:
        async with session.post(url, data=body, headers=headers) as resp:
            shot.status = resp.status
            if resp.status != 200:
                shot.retry_after = resp.headers.get("Retry-After")
                raw = await resp.read()
                try:
                    err = orjson.loads(raw).get("error", {})
                    shot.code = str(err.get("code") or err.get("type") or "") or None
                except (orjson.JSONDecodeError, AttributeError):
                    shot.code = None
                return
            async for line in resp.content:
                if not line.startswith(b"data: "):
                    continue
                if line.startswith(b"data: [DONE]"):
                    shot.done = True
                elif b'"error"' in line:
                    shot.error = "stream_error"
                elif b'"text":"' in line and b'"text":""' not in line:
                    if shot.ttft is None:
                        shot.ttft = _clock() - start
                    shot.tokens += 1
    except (TimeoutError, aiohttp.ClientError, OSError) as exc:
        shot.error = type(exc).__name__
    finally:
        shot.end = _clock() - t0


async def _tenant(
    session: aiohttp.ClientSession,
    url: str,
    model: str,
    load: TenantLoad,
    duration_s: float,
    rng: random.Random,
    t0: float,
    shots: list[Shot],
    tasks: set[asyncio.Task[None]],
) -> None:
    body = _body(model, load.max_tokens)
    due = rng.expovariate(load.rate)
    while due < duration_s:
        await asyncio.sleep(max(0.0, t0 + due - _clock()))
        shot = Shot(load.tenant, _clock() - t0)
        shots.append(shot)
        task = asyncio.create_task(_shoot(session, url, load, body, shot, t0))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
        due += rng.expovariate(load.rate)


async def run_tenants(
    base_url: str,
    model: str,
    loads: list[TenantLoad],
    duration_s: float,
    seed: int = 0,
    request_timeout_s: float = 60.0,
) -> list[Shot]:
    """Every tenant's arrivals for `duration_s`, then until every request has ended (each is
    bounded by `request_timeout_s`)."""
    shots: list[Shot] = []
    tasks: set[asyncio.Task[None]] = set()
    timeout = aiohttp.ClientTimeout(total=request_timeout_s)
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        url = f"{base_url}/v1/completions"
        t0 = _clock()
        await asyncio.gather(
            *(
                _tenant(
                    session,
                    url,
                    model,
                    load,
                    duration_s,
                    random.Random(seed * 1000 + i),
                    t0,
                    shots,
                    tasks,
                )
                for i, load in enumerate(loads)
                if load.rate > 0
            )
        )
        while tasks:
            await asyncio.gather(*list(tasks), return_exceptions=True)
    return shots
