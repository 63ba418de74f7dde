"""Answers of n > 1 choices (the request's `n`), streamed or whole, as vLLM serves them.

vLLM fans a request of n choices out into n sequences of one prompt (`vllm/v1/engine/
async_llm.py`, parallel sampling); prefix caching lets them share the prompt's full blocks, so
each extra choice holds only its own copy of the prompt's last, partial block and its own
output. The simulated worker does the same: choice 0 is the sequence an n=1 request would run
(all the prompt's blocks), choices 1..n-1 start with the prompt's tail only.

Streams interleave the choices' events in the order the decode steps produce them, each with
its `index`; a chat stream opens with one role chunk per choice, and the stream's tail (usage,
`[DONE]`) follows the last choice to finish. Usage counts every choice's tokens.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator

import orjson
from aiohttp import web

from .decode_engine import Sequence
from .openai_format import AnswerFormat
from .worker_state import Worker

__all__ = ["serve_choices"]

# (choice index, token, finish reason or None)
_Event = tuple[int, str, str | None]


async def _interleaved(seqs: list[Sequence]) -> AsyncGenerator[_Event, None]:
    """Every choice's tokens as they come, until the last choice has finished."""
    merged: asyncio.Queue[_Event] = asyncio.Queue()

    async def pump(index: int, seq: Sequence) -> None:
        while True:
            tok, finish = await seq.out.get()
            merged.put_nowait((index, tok, finish))
            if finish is not None:
                return

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(seqs)]
    try:
        running = len(seqs)
        while running:
            event = await merged.get()
            running -= event[2] is not None
            yield event
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def serve_choices(
    worker: Worker,
    request: web.Request,
    seqs: list[Sequence],
    fmt: AnswerFormat,
    die_after: int | None,
) -> web.StreamResponse:
    """The answer of the choices `seqs` (joined to the batch, choice i at index i)."""
    if fmt.stream:
        return await _stream(worker, request, seqs, fmt, die_after)
    texts: list[list[str]] = [[] for _ in seqs]
    finishes = ["length"] * len(seqs)
    sent = 0
    async with contextlib.aclosing(_interleaved(seqs)) as events:
        async for index, tok, finish in events:
            if die_after is not None and sent >= die_after:
                return _drop(request)
            if tok:
                texts[index].append(tok)
                sent += 1
            if finish is not None:
                finishes[index] = finish
    answer = fmt.full_choices([("".join(t), f) for t, f in zip(texts, finishes, strict=True)], sent)
    return web.Response(body=orjson.dumps(answer), content_type="application/json")


async def _stream(
    worker: Worker,
    request: web.Request,
    seqs: list[Sequence],
    fmt: AnswerFormat,
    die_after: int | None,
) -> web.StreamResponse:
    resp = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    sent = finished = 0
    try:
        async with contextlib.aclosing(_interleaved(seqs)) as events:
            async for index, tok, finish in events:
                if die_after is not None and sent >= die_after:
                    worker.metrics.inc("faults", label="decode_die_after_tokens")
                    return _drop(request, resp)
                if not resp.prepared:
                    # Headers go out with the first token, as for one choice (generation.py).
                    await resp.prepare(request)
                    await resp.write(b"".join(fmt.role_event(i) for i in range(len(seqs))))
                sent += 1 if tok else 0
                finished += finish is not None
                await resp.write(fmt.events(tok, finish, sent, index, finished == len(seqs)))
        await resp.write_eof()
    except ConnectionError:
        worker.metrics.inc("aborted")  # the caller's finally aborts every choice's sequence
    return resp


def _drop(request: web.Request, resp: web.StreamResponse | None = None) -> web.StreamResponse:
    """Close the connection mid-answer, as a dying GPU process would."""
    if request.transport is not None:
        request.transport.abort()
    return resp if resp is not None else web.Response()
