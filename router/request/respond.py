"""The client's answer from the decode worker's: streamed, whole, or assembled from a stream.

Entry point: `Responder.respond(attempt, decode, ask)` serves one open decode answer (bound to
its relay by the leg: router/request/legs.py `DecodeAnswer`) and returns
`Served` (the request is answered, or the client left) or `Broken` (nothing usable came; the
orchestrator retries, or resumes a stream that had started). The relay reports progress to one
`Progress` object (`first_token()`, `tokens(total)`), never into the orchestrator.

The client side is a `ClientSide` value, not aiohttp's request, so the path runs without a
server (tests/router/request/test_request_path.py). Its disconnect signal is the one the relays
already read:
`start_stream` and the stream's `write` raise `ConnectionError` once the client has gone (and
the server cancels the request's task: router/edge/server.py `handler_cancellation`).
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import aiohttp
import orjson

from policies.priority_classes import class_name
from router.config import Timeouts
from router.errors import RouterError, UpstreamRejected, stream_error_frame
from router.metrics import RouterMetrics
from router.openai.api import CHAT, COMPLETIONS, RESPONSES, ParsedRequest
from router.relay.contract import RelayResult
from router.request.assemble import DISCARD, assemble, assembled, output_tokens
from router.request.attempt import Ask, Attempt, Call, LegFailure
from router.request.legs import DecodeAnswer
from router.request.preemption import LiveStream, Preemptor, Victims
from router.request.priority_class import PRIORITY_HEADER
from router.request.resumed_usage import usage_rewrite

__all__ = [
    "Answering",
    "Broken",
    "ClientSide",
    "Preempted",
    "ClientStream",
    "Progress",
    "Responder",
    "Served",
]


@dataclass(frozen=True, slots=True)
class Answering:
    """The respond stage's share of the replica, handed to it once."""

    metrics: RouterMetrics
    timeouts: Timeouts
    clock: Callable[[], float]
    preemptor: Preemptor


class ClientStream(Protocol):
    """The client's streamed response once its headers are sent (aiohttp's StreamResponse)."""

    async def write(self, data: bytes) -> None: ...

    async def write_eof(self) -> None: ...


@dataclass(frozen=True, slots=True)
class ClientSide:
    """The client's end of one request: its validated body, its headers, and how to start a
    streamed response (sends the headers; raises ConnectionError if the client has gone)."""

    parsed: ParsedRequest
    headers: Mapping[str, str]
    start_stream: Callable[[dict[str, str]], Awaitable[ClientStream]]

    def __repr__(self) -> str:
        return f"ClientSide({self.parsed!r})"


@dataclass(frozen=True, slots=True)
class Served:
    """The request is answered: `body` is a whole answer to send, None when it was streamed
    (the stream's end is written by `Responder.finish`, after the release); status 499 when the
    client left."""

    status: int
    output_tokens: int | None = None
    body: bytes | None = None


@dataclass(frozen=True, slots=True)
class Broken:
    """Nothing usable came from this attempt's decode answer (`failure` says whose fault)."""

    failure: LegFailure


@dataclass(frozen=True, slots=True)
class Preempted:
    """The router stopped this attempt's stream to give its room back (`reason`:
    router/request/preemption.py); `tokens` it had relayed. The request resumes: not the
    worker's failure, not a retry."""

    reason: str
    tokens: int


def resumable(parsed: ParsedRequest) -> bool:
    """A stream the router can stop and continue exactly (router/request/resume.py): streamed,
    one choice, chat, or completions with a text prompt (token ids need a tokenizer)."""
    if not parsed.stream or parsed.n != 1:
        return False
    if parsed.path == CHAT:
        return True
    if parsed.path != COMPLETIONS:
        return False
    prompt = parsed.body.get("prompt")
    return isinstance(prompt, str) or (
        isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str)
    )


class Progress:
    """What the relay reports as an answer streams, applied where it belongs: the first token
    tells the stranded KV's owner the decode took it, observes the TTFT and moves the request's
    deadline from TTFT to total; the token count grows the reservation (both owners:
    router/request/holdings.py)."""

    __slots__ = (
        "call",
        "stage",
        "deadline",
        "first_token_at",
        "preempted",
        "live",
        "_attempt",
        "_ask",
    )

    def __init__(self, call: Call, stage: Answering) -> None:
        self.call, self.stage = call, stage
        self.deadline: asyncio.Timeout | None = None  # the request's (router/request/lifecycle.py)
        self.first_token_at: float | None = None  # of the request: a resumed stream keeps it
        self.preempted = 0  # times the request's stream was preempted (and resumed)
        self.live: LiveStream | None = None  # the stream relayed now, if it may be preempted
        self._attempt: Attempt | None = None
        self._ask: Ask | None = None

    def watch(self, attempt: Attempt, ask: Ask) -> None:
        """The attempt whose stream is relayed next, and the try it serves."""
        self._attempt, self._ask = attempt, ask

    def first_token(self) -> None:
        call, stage = self.call, self.stage
        if self._attempt is not None:
            kv_accepted(call, self._attempt)
        if self.first_token_at is not None:  # a resumed stream: TTFT was the first attempt's
            return
        self.first_token_at = stage.clock()
        stage.metrics.ttft.observe(self.first_token_at - call.started)
        t = stage.timeouts
        if self.deadline is not None:
            end = None
            if t.total_s:  # the total deadline, on the loop's clock as asyncio's are
                end = call.started + t.total_s
                end += asyncio.get_running_loop().time() - stage.clock()
            self.deadline.reschedule(end)

    def tokens(self, total: int) -> int:
        """Grow the reservation if `total` outgrew it; the relay calls again only once the
        count passes the returned growth point (RelayObserver.tokens), so a stream within its
        reservation costs no call per token. A growth on its way, or one that failed, leaves
        the point where it was, below the count: the next read calls again, as grow wants."""
        attempt, ask = self._attempt, self._ask
        if attempt is None or ask is None or attempt.decode_id is None:
            return sys.maxsize  # nothing to grow
        reservation = attempt.reservation
        n = self.call.parsed.n
        reservation.grow(total, prompt_tokens=ask.prompt_tokens, resumed=ask.resumed, n=n)
        forced_at = self.stage.preemptor.settings.force_after_tokens
        if forced_at and self.live is not None and not self.preempted:
            # TESTS ONLY (preemption.force_after_tokens): stop the stream once, mid-way.
            if total >= forced_at:
                victim = Victims((self.live.reservation_id,), True)
                self.stage.preemptor.preempt(victim, "forced")
                return sys.maxsize
            return min(reservation.grow_at_tokens, forced_at - 1)
        return reservation.grow_at_tokens


def kv_accepted(call: Call, attempt: Attempt) -> None:
    """The decode worker produced output, so it holds the KV (the handoff's span ends)."""
    call.trace.finish("kv_handoff")
    if attempt.stranded is not None:
        attempt.stranded.accepted()


def _is_answer(answer: Any, path: str) -> bool:
    """A whole answer's shape: the Responses API's `output` list, or a non-empty `choices`."""
    if not isinstance(answer, dict):
        return False
    if path == RESPONSES:
        return isinstance(answer.get("output"), list)
    choices = answer.get("choices")
    return isinstance(choices, list) and bool(choices)


class Responder:
    """One request's answer in its mode (chosen once, from the request): `stream` relays into
    the client's stream (resumable: `sent` keeps what the client has); whole asks the decode
    worker for one JSON body; assembled streams from the worker and answers whole."""

    __slots__ = ("call", "stage", "client", "progress", "stream", "sent")

    def __init__(self, call: Call, client: ClientSide, progress: Progress) -> None:
        self.call, self.client, self.progress = call, client, progress
        self.stage = progress.stage
        self.stream: ClientStream | None = None  # once the client's stream has started
        self.sent: list[bytes] = []  # every event the client's stream has been written

    async def respond(
        self, attempt: Attempt, decode: DecodeAnswer, ask: Ask
    ) -> Served | Broken | Preempted:
        if self.call.assembling:
            return await self._assembled(attempt, decode, ask)
        if not self.call.parsed.stream:
            return await self._whole(attempt, decode)
        return await self._streamed(attempt, decode, ask)

    async def finish(self) -> None:
        """End a completed stream (after the release: a slow client holds no decode room)."""
        if self.stream is None:
            return
        try:
            await self.stream.write_eof()
        except (ConnectionError, RuntimeError):
            self.stage.metrics.client_disconnects.inc()

    async def write_end(self, frames: bytes) -> None:
        """End a stream the worker left unfinished with the events a finished one ends with."""
        if self.stream is None:
            return
        try:
            await self.stream.write(frames)
            self.sent.append(frames)
            await self.stream.write_eof()
        except (ConnectionError, RuntimeError):
            self.stage.metrics.client_disconnects.inc()

    async def write_error(self, err: RouterError) -> None:
        """Headers are gone: end the stream with a valid SSE error frame, never a silent cut."""
        if self.stream is None:
            return
        frame = stream_error_frame(err, responses_api=self.call.parsed.path == RESPONSES)
        try:
            await self.stream.write(frame)
            await self.stream.write_eof()
        except (ConnectionError, RuntimeError):
            pass

    async def _relay(
        self, attempt: Attempt, decode: DecodeAnswer, sink: Any, ask: Ask
    ) -> RelayResult:
        """One decode stream into `sink` (the client's stream, or DISCARD when assembling); the
        connection is closed afterwards (unfinished: dropping it is vLLM's abort signal)."""
        worker, answer = decode.worker, decode.answer
        worker.resident_seqs += 1
        # A role drain past its deadline may cut it (router/control/role_manager.py).
        worker.open_streams.add(answer)
        self.progress.watch(attempt, ask)
        # A growth with no room may preempt it (router/request/preemption.py).
        preemptor, live = self.stage.preemptor, None
        if preemptor.enabled and sink is not DISCARD and resumable(self.call.parsed):
            reservation = attempt.reservation
            live = LiveStream(
                reservation.reservation_id,
                worker.spec.id,
                self.call.tenant,
                self.stage.clock(),
                self.progress.preempted,
                lambda: reservation.blocks,
                answer.close,
                self.call.priority,
            )
            preemptor.register(live)
        self.progress.live = live
        try:
            return await answer.relay(
                sink,
                chat=self.call.parsed.path == CHAT,
                responses=self.call.parsed.path == RESPONSES,
                clock=self.stage.clock,
                observer=self.progress,
                first_event_by=attempt.handoff_by,
                # A continuation's usage counts what the client has as prompt: one answer's.
                rewrite=usage_rewrite(ask.resumed) if ask.resumed else None,
            )
        finally:
            if live is not None:
                preemptor.unregister(live)
            worker.resident_seqs -= 1
            worker.open_streams.discard(answer)
            answer.close()

    async def _streamed(
        self, attempt: Attempt, decode: DecodeAnswer, ask: Ask
    ) -> Served | Broken | Preempted:
        metrics = self.stage.metrics
        if self.stream is None:
            headers = {
                "Content-Type": "text/event-stream",
                "Cache-Control": "no-cache",
                "X-Request-Id": self.call.request_id,
                # The class it is served in: a more urgent one than asked for is not granted.
                PRIORITY_HEADER: class_name(self.call.priority),
            }
            try:
                self.stream = await self.client.start_stream(headers)
            except BaseException as exc:
                # The client left while its decode leg was being opened: abort the leg now
                # (closing is vLLM's abort signal) instead of leaving it to stream unread.
                decode.answer.close()
                if not isinstance(exc, ConnectionError):
                    raise
                metrics.client_disconnects.inc()
                return Served(499)
        result = await self._relay(attempt, decode, self.stream, ask)
        self.sent.extend(result.chunks)
        metrics.tokens_relayed.inc(result.tokens)
        if result.client_gone:
            metrics.client_disconnects.inc()
            return Served(499)
        if result.completed:
            decode.answered()
            return Served(200, ask.resumed + result.tokens)
        live = self.progress.live
        if live is not None and live.reason is not None:
            # The router stopped it, not the worker: no breaker pays.
            if attempt.decode_verdict is not None:
                attempt.decode_verdict.abandon()
            return Preempted(live.reason, result.tokens)
        return Broken(decode.failure(result))

    async def _whole(self, attempt: Attempt, decode: DecodeAnswer) -> Served | Broken:
        """Answered whole by the decode worker (`assemble_non_streaming: false`, or a request
        vLLM cannot stream): nothing reaches the client until the answer is whole, so a broken
        answer is retried like a failed leg."""
        try:
            data = await decode.answer.read()
            answer = orjson.loads(data)
            if not _is_answer(answer, self.call.parsed.path):
                raise ValueError(f"not an answer: {data[:80]!r}")
            usage = answer.get("usage") or {}
        except (aiohttp.ClientError, ValueError) as exc:  # JSONDecodeError is a ValueError
            # A 200 that is not an answer is the worker's failure, like a 500 (issue 20).
            result = RelayResult(upstream_error=f"answered badly: {exc!r}", error_kind="malformed")
            return Broken(decode.failure(result))
        finally:
            decode.answer.close()
        decode.answered()
        kv_accepted(self.call, attempt)
        self.stage.metrics.ttft.observe(self.stage.clock() - self.call.started)
        # Chat and completions count `completion_tokens`, the Responses API `output_tokens`.
        tokens = usage.get("completion_tokens") or usage.get("output_tokens") or 0
        return Served(200, int(tokens), data)

    async def _assembled(self, attempt: Attempt, decode: DecodeAnswer, ask: Ask) -> Served | Broken:
        """Asked for whole, streamed from the decode worker: the first token clears the stranded
        KV and the TTFT deadline as in a stream. Nothing reaches the client before the answer
        is whole, so a broken stream is retried from the start, never resumed."""
        # The relay keeps every whole event it passes on (`result.chunks`): the answer is
        # assembled from those, so the sink keeps nothing.
        result = await self._relay(attempt, decode, DISCARD, ask)
        if self.call.parsed.path == RESPONSES:
            answer = assembled(result.chunks) if result.completed else None
            if answer is not None:
                decode.answered()
                return Served(200, output_tokens(answer) or result.tokens, orjson.dumps(answer))
            if result.completed:  # a completing event that does not parse: retried as broken
                result.completed, result.error_kind = False, "malformed"
                result.upstream_error = "the decode stream's response.completed does not parse"
            return Broken(decode.failure(result))
        whole = assemble(result.chunks, self.call.parsed.path == CHAT) if result.completed else None
        if isinstance(whole, dict) and not whole["choices"]:
            # A stream that ended well but spelled no answer (events that do not parse):
            # nothing reached the client, so it is retried like a broken one.
            result.completed, result.error_kind = False, "malformed"
            result.upstream_error = "the decode stream held no answer that parses"
        elif whole is not None:
            decode.answered()  # a whole answer, or the worker's verdict on the request
            if not isinstance(whole, dict):  # a 4xx the worker reported in the stream
                raise UpstreamRejected(
                    whole.status or 400,
                    whole.message,
                    type_=whole.type or "invalid_request_error",
                    param=whole.param,
                    code=whole.code,
                )
            usage = whole.get("usage") or {}
            tokens = int(usage.get("completion_tokens") or result.tokens)
            return Served(200, tokens, orjson.dumps(whole))
        return Broken(decode.failure(result))
