"""One request served by one worker alone, with no disaggregation and no decode reservation:
the leg of the passthrough routes (router/edge/passthrough.py: embeddings, (de)tokenize, a
Responses request served whole on one worker).

The leg is the main path's (router/request/legs.py `leg_errors`), so the error mapping is the
same one. A connection error, a timeout, a 5xx, a 429/503, or a 200 that is not an answer, is a
retryable `LegFailure` charged to the worker's breaker. The worker's own 4xx is its verdict on
the request: it passes through and nobody's breaker is charged. The breaker's `Verdict` is
settled exactly once however the request ends; a client that leaves gives a half-open probe's
place back instead of keeping it forever.

A stream goes through the main path's relay (router/relay/aiohttp_relay.py and its SSE cutter,
router/relay/sse_cut.py) and is judged by its whole answer. The client's stream starts with the
first whole event the cutter lets through, so a stream that breaks before that event is retried
like a failed leg. One that breaks after it ends with the route's error frame
(router/errors.py `stream_error_frame`): it cannot be resumed, because these answers carry no KV
handle to resume from.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Generic, TypeVar

import aiohttp
import orjson

from router.config import Timeouts
from router.errors import UpstreamError, stream_error_frame
from router.metrics import RouterMetrics
from router.relay.aiohttp_relay import relay_sse
from router.relay.contract import Relay
from router.request.attempt import LegFailure, upstream_failure
from router.request.legs import leg_errors
from router.request.respond import ClientStream
from router.workers.worker_state import WorkerState

__all__ = ["OneWorker", "Whole"]

S = TypeVar("S", bound=ClientStream)


@dataclass(frozen=True, slots=True)
class Whole:
    """A whole answer: the worker's body (a JSON object) and its content type."""

    body: bytes
    content_type: str

    def __repr__(self) -> str:
        return f"Whole({len(self.body)} bytes, {self.content_type})"


class _StartedByFirstWrite(Generic[S]):
    """The client's stream, started (its headers sent) by the first bytes the relay forwards:
    a stream that breaks before them has told the client nothing, and can be retried."""

    __slots__ = ("_start", "_headers", "stream")

    def __init__(self, start: Callable[[dict[str, str]], Awaitable[S]], headers: dict[str, str]):
        self._start, self._headers = start, headers
        self.stream: S | None = None

    def __repr__(self) -> str:
        return f"_StartedByFirstWrite(started={self.stream is not None})"

    async def write(self, data: bytes) -> None:
        if self.stream is None:
            self.stream = await self._start(self._headers)
        await self.stream.write(data)


def _json_object(data: bytes) -> bool:
    try:
        return isinstance(orjson.loads(data), dict)
    except orjson.JSONDecodeError:
        return False


@dataclass(frozen=True, slots=True)
class OneWorker:
    """The one-worker leg: what it needs of the replica, handed to it once."""

    session: aiohttp.ClientSession
    metrics: RouterMetrics
    timeouts: Timeouts
    clock: Callable[[], float]

    def __repr__(self) -> str:
        return "OneWorker()"

    def _failure(self, worker: WorkerState, status: int, data: bytes) -> LegFailure:
        failure = upstream_failure(worker.spec.role, worker.spec.id, status, data)
        failure.kind = str(status)  # counted by status, whichever role the worker has
        return failure

    async def whole(
        self, worker: WorkerState, path: str, raw: bytes, headers: Mapping[str, str]
    ) -> Whole:
        """POST `raw` to `worker`'s `path`; its whole answer within the whole-leg deadline, or
        a LegFailure."""
        spec, t = worker.spec, self.timeouts
        deadline = t.total_s or t.prefill_s
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=t.connect_s)
        async with leg_errors(self.metrics, spec.role, worker, deadline):
            async with self.session.post(
                spec.url + path, data=raw, headers=headers, timeout=timeout
            ) as resp:
                data = await resp.read()
            if resp.status != 200:
                raise self._failure(worker, resp.status, data)
            if not _json_object(data):
                # A 200 that does not parse (a broken engine, a proxy's page): nothing reached
                # the client yet, so it is retried like a failed worker.
                err = UpstreamError(f"worker {spec.id} answered 200 with a body that is not JSON")
                failure = LegFailure(spec.role, spec.id, err, True)
                failure.kind = "malformed"
                raise failure
        return Whole(data, resp.content_type or "application/json")

    async def stream(
        self,
        worker: WorkerState,
        path: str,
        raw: bytes,
        headers: Mapping[str, str],
        start_stream: Callable[[dict[str, str]], Awaitable[S]],
        *,
        responses: bool,
    ) -> None:
        """POST `raw` to `worker`'s `path` and relay its SSE answer: the first byte within the
        TTFT deadline, then no more than idle_s between bytes. `start_stream(headers)` sends
        the client's headers (raises ConnectionError once the client has gone); it is called
        with the first whole event. Returns once the stream ended (well, with its error frame,
        or the client left); a LegFailure when nothing reached the client."""
        spec, t = worker.spec, self.timeouts
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=t.connect_s, sock_read=t.idle_s)
        async with leg_errors(self.metrics, spec.role, worker, t.ttft_s, deferred=True) as verdict:
            resp = await self.session.post(
                spec.url + path, data=raw, headers=headers, timeout=timeout
            )
            if resp.status != 200:
                try:
                    data = await resp.read()
                finally:
                    resp.release()
                raise self._failure(worker, resp.status, data)
        # From here the verdict waits for the end of the answer (leg_errors gives it no more).
        answer = Relay(resp, relay_sse)
        client = _StartedByFirstWrite(
            start_stream,
            {
                "Content-Type": resp.headers.get("Content-Type", "text/event-stream"),
                "Cache-Control": "no-cache",
            },
        )
        try:
            result = await answer.relay(
                client,
                chat=False,
                responses=responses,
                clock=self.clock,
                observer=None,
                first_event_by=None,
            )
        except BaseException:
            verdict.abandon()  # cancelled: the client left; no verdict on the worker
            raise
        finally:
            answer.close()  # unfinished: dropping the connection is the worker's abort signal
        if result.client_gone:
            verdict.abandon()
            self.metrics.client_disconnects.inc()
            return
        ended = client.stream
        if result.completed and ended is not None:  # a finished stream forwarded its end
            verdict.ok()
        else:
            verdict.failed()
            kind = result.error_kind or "stream_cut"
            self.metrics.upstream_errors.labels(side=spec.role, kind=kind).inc()
            reason = f"worker {spec.id} ended the stream early: {result.upstream_error}"
            failure = LegFailure(spec.role, spec.id, UpstreamError(reason), True)
            if ended is None:
                raise failure  # the client has nothing yet: another worker may answer it
            try:
                await ended.write(stream_error_frame(failure.error, responses_api=responses))
            except (ConnectionError, RuntimeError):
                self.metrics.client_disconnects.inc()
                return
        try:
            await ended.write_eof()
        except (ConnectionError, RuntimeError):
            self.metrics.client_disconnects.inc()
