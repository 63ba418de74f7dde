"""Endpoints passed through to one worker of the model: no disaggregation, no decode reservation.

    POST /v1/embeddings, /tokenize, /detokenize   any worker of the model (every role has the
                                                  model's tokenizer and weights)
    POST /v1/responses                            a worker that runs both phases
                                                  (router/openai/responses.py)

Behind the same front door as chat (router/edge/front_door.py: the shutdown check, the API keys, the
body limit and read timeout, the request id), with the same OpenAI error shapes; an unknown
model is a 404 `model_not_found`. The worker is the least busy one in rotation (healthy, breaker
closed, not drained) that serves the model, the least recently picked among equals, and is sent
the headers every leg is (router/upstream_headers.py). A failure before the client got a byte —
connection error, timeout, 5xx, 429/503 — is charged to that worker's breaker and retried on
another worker by the retry policy chat's legs have (router/request/retry_policy.py: the attempts
cap,
the cluster-wide budget, jittered backoff); a worker's own 4xx passes through unchanged. No
worker in rotation: 503 `no_worker_in_rotation` with Retry-After.

Streams (a Responses request with `stream: true`) are forwarded event by event; a stream the
worker breaks after the first byte ends with the route's error frame (router/errors.py
`stream_error_frame`; it cannot be resumed: these endpoints carry no KV handle to resume from).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from router.edge.front_door import RequestCount, enter
from router.edge.gateway import Gateway
from router.errors import (
    DeadlineExceeded,
    InvalidRequest,
    ModelNotFound,
    NotInRotation,
    RouterError,
    UpstreamError,
    stream_error_frame,
)
from router.openai.api import RESPONSES, parse_json_object
from router.request.attempt import LegFailure, upstream_failure
from router.request.retry_policy import RetryPolicy
from router.upstream_headers import upstream_headers
from router.workers.pools import WorkerState

__all__ = [
    "ANY_ROLE",
    "BOTH_PHASES",
    "PASSTHROUGH_ROUTES",
    "Route",
    "add_passthrough_routes",
    "forward",
]

log = logging.getLogger(__name__)

ANY_ROLE: tuple[frozenset[str], ...] = (frozenset({"prefill", "decode", "both"}),)
# A whole generation on one worker: one registered as `both` first; else a decode worker, which
# prefills locally a request that carries no kv_transfer_params (vLLM's kv_consumer does).
BOTH_PHASES: tuple[frozenset[str], ...] = (frozenset({"both"}), frozenset({"decode"}))


@dataclass(frozen=True, slots=True)
class Route:
    path: str
    tiers: tuple[frozenset[str], ...]  # worker roles that serve it, most preferred first
    # The route's own checks: the body to send (the same object when unchanged) and whether
    # the answer streams (400s raised here); None = the body as is, never streamed.
    shape: Callable[[dict[str, Any]], tuple[dict[str, Any], bool]] | None = None

    def __repr__(self) -> str:
        return f"Route({self.path})"


PASSTHROUGH_ROUTES = (
    Route("/v1/embeddings", ANY_ROLE),
    Route("/tokenize", ANY_ROLE),
    Route("/detokenize", ANY_ROLE),
)


class Picks:
    """This replica's passthrough requests in flight per worker, and a round-robin tiebreak."""

    def __init__(self) -> None:
        self.inflight: Counter[str] = Counter()
        self.last_pick: dict[str, int] = {}
        self._clock = itertools.count()

    def __repr__(self) -> str:
        return f"Picks({dict(self.inflight)})"

    def choose(self, workers: list[WorkerState]) -> WorkerState:
        best = min(
            workers,
            key=lambda w: (self.inflight[w.spec.id], self.last_pick.get(w.spec.id, -1)),
        )
        self.last_pick[best.spec.id] = next(self._clock)
        return best


_PICKS = web.AppKey("passthrough_picks", Picks)


def _candidates(gw: Gateway, route: Route, model: str | None, tried: set[str]) -> list[WorkerState]:
    """The most preferred tier's workers in rotation for `model`, untried ones first."""
    for fresh_only in (True, False):
        for roles in route.tiers:
            found = [
                w
                for w in gw.pools.workers.values()
                if w.spec.role in roles
                and w.available
                and w.spec.serves(model)
                and not (fresh_only and w.spec.id in tried)
            ]
            if found:
                return found
    return []


def _json_object(data: bytes) -> bool:
    try:
        return isinstance(orjson.loads(data), dict)
    except orjson.JSONDecodeError:
        return False


def _served_model(body: dict[str, Any], models: tuple[str, ...]) -> str | None:
    """The model the body names, one this router serves (400, 404); None when it names none
    (vLLM's tokenize takes none either: any worker answers)."""
    model = body.get("model")
    if model is None:
        return None
    if not isinstance(model, str) or not model:
        raise InvalidRequest("'model' must be a non-empty string", param="model")
    if model not in models:
        raise ModelNotFound(f"The model `{model}` does not exist.", param="model")
    return model


def _none_in_rotation(gw: Gateway, route: Route, model: str | None) -> NotInRotation:
    workers = gw.pools.workers.values()
    known = any(
        w.spec.serves(model) and any(w.spec.role in r for r in route.tiers) for w in workers
    )
    return NotInRotation(
        f"worker for {route.path} of model {model or '(any)'}",
        "health probes failing, circuit breakers open or drained" if known else "",
        retry_after_s=min((w.breaker.cooldown_s for w in workers), default=1.0),
    )


class _Forward:
    """One passthrough request: pick, send, retry before the first byte, relay."""

    def __init__(
        self, gw: Gateway, request: web.Request, route: Route, picks: Picks, request_id: str
    ) -> None:
        self.gw, self.http, self.route, self.picks = gw, request, route, picks
        self.request_id = request_id
        self.retries = RetryPolicy(gw.settings.retry, gw.retry_budget, gw.metrics, request_id)

    def _failed(self, w: WorkerState, probe: bool, kind: str, err: RouterError) -> LegFailure:
        self.gw.metrics.upstream_errors.labels(side=w.spec.role, kind=kind).inc()
        w.breaker.on_failure(probe)
        return LegFailure(w.spec.role, w.spec.id, err, True)

    async def run(self, raw: bytes, model: str | None, stream: bool) -> web.StreamResponse:
        retries = self.retries
        retries.begin()
        while True:
            found = _candidates(self.gw, self.route, model, retries.tried)
            if not found:
                raise _none_in_rotation(self.gw, self.route, model)
            worker = self.picks.choose(found)
            retries.attempt()
            try:
                return await self._attempt(worker, raw, stream)
            except LegFailure as failure:
                if not failure.retryable:
                    raise failure.error from failure  # the worker's verdict on the request
                await retries.before_retry(failure)

    async def _attempt(self, w: WorkerState, raw: bytes, stream: bool) -> web.StreamResponse:
        gw, t = self.gw, self.gw.settings.timeouts
        spec = w.spec
        probe = w.breaker.on_dispatch()
        self.picks.inflight[spec.id] += 1
        # A whole answer within the whole-leg deadline; a stream's first byte within the TTFT
        # one, then no more than idle_s between bytes.
        deadline = t.ttft_s if stream else (t.total_s or t.prefill_s)
        timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=t.connect_s, sock_read=t.idle_s if stream else None
        )
        try:
            try:
                async with asyncio.timeout(deadline):
                    resp = await gw.session.post(
                        spec.url + self.route.path,
                        data=raw,
                        headers=upstream_headers(
                            gw.settings, self.http.headers, self.request_id, spec
                        ),
                        timeout=timeout,
                    )
                    if resp.status != 200 or not stream:
                        try:
                            data = await resp.read()
                        finally:
                            resp.release()
            except aiohttp.ClientError as exc:  # before TimeoutError: some are both
                err: RouterError = UpstreamError(f"{spec.role} worker {spec.id} failed: {exc!r}")
                raise self._failed(w, probe, "connection", err) from exc
            except TimeoutError as exc:
                err = DeadlineExceeded(f"worker {spec.id} did not answer within {deadline} s")
                raise self._failed(w, probe, "timeout", err) from exc
            if resp.status != 200:
                failure = upstream_failure(spec.role, spec.id, resp.status, data)
                gw.metrics.upstream_errors.labels(side=spec.role, kind=str(resp.status)).inc()
                if failure.retryable:
                    w.breaker.on_failure(probe)
                else:  # the worker is fine: the client's request was the problem
                    w.breaker.on_success(probe)
                raise failure
            if not stream and not _json_object(data):
                # A 200 that does not parse (a broken engine, a proxy's page): nothing reached
                # the client yet, so it is retried like a failed worker.
                err = UpstreamError(f"worker {spec.id} answered 200 with a body that is not JSON")
                raise self._failed(w, probe, "malformed", err)
            w.breaker.on_success(probe)
            if not stream:
                return web.Response(
                    body=data,
                    content_type=resp.content_type or "application/json",
                    headers={"X-Request-Id": self.request_id},
                )
            return await self._relay(w, resp)
        finally:
            self.picks.inflight[spec.id] -= 1

    async def _relay(self, w: WorkerState, resp: aiohttp.ClientResponse) -> web.StreamResponse:
        """Forward whole SSE events as they arrive; a break ends the stream with an error event."""
        client = web.StreamResponse(
            headers={
                "Content-Type": resp.headers.get("Content-Type", "text/event-stream"),
                "Cache-Control": "no-cache",
                "X-Request-Id": self.request_id,
            }
        )
        pending = b""
        try:
            await client.prepare(self.http)
            try:
                async for data in resp.content.iter_any():
                    data, pending = pending + data, b""
                    end = data.rfind(b"\n\n")
                    if end < 0:
                        pending = data
                        continue
                    data, pending = data[: end + 2], data[end + 2 :]
                    await client.write(data)
            except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError) as exc:
                self.gw.metrics.upstream_errors.labels(side=w.spec.role, kind="stream_cut").inc()
                w.breaker.on_failure()
                err = UpstreamError(f"worker {w.spec.id} ended the stream early: {exc!r}")
                await client.write(
                    stream_error_frame(err, responses_api=self.route.path == RESPONSES)
                )
            await client.write_eof()
        except (ConnectionError, RuntimeError):
            self.gw.metrics.client_disconnects.inc()  # the client left: closing aborts upstream
        finally:
            resp.close()
        return client


async def forward(
    gw: Gateway,
    request: web.Request,
    route: Route,
    raw: bytes,
    model: str | None,
    *,
    request_id: str,
    stream: bool = False,
) -> web.StreamResponse:
    """Serve `raw` (the body to send) by one worker of `route`'s roles; `request_id` is the
    front door's (router/edge/front_door.py)."""
    picks = request.app[_PICKS]
    return await _Forward(gw, request, route, picks, request_id).run(raw, model, stream)


def add_passthrough_routes(
    app: web.Application,
    gateway: Callable[[web.Application], Gateway],
    models: Callable[[Gateway], tuple[str, ...]],
    routes: tuple[Route, ...] = PASSTHROUGH_ROUTES,
) -> None:
    """Register `routes` on `app`; `gateway(app)` and `models(gw)` are the app's."""
    app[_PICKS] = Picks()

    def handler(route: Route) -> Callable[[web.Request], Any]:
        async def handle(request: web.Request) -> web.StreamResponse:
            gw = gateway(request.app)
            with RequestCount(gw.metrics, route.path) as count:
                entry = await enter(request, gw.settings)
                count.tenant = entry.tenant.name  # in its tenant's requests too
                raw, body = entry.raw, parse_json_object(entry.raw)
                model = _served_model(body, models(gw))
                stream = False
                if route.shape is not None:
                    sent, stream = route.shape(body)
                    if sent is not body:
                        raw = orjson.dumps(sent)
                resp = await forward(
                    gw, request, route, raw, model, request_id=entry.request_id, stream=stream
                )
                count.status = resp.status
                return resp

        return handle

    for route in routes:
        app.router.add_post(route.path, handler(route))


# The Responses API's whole-on-one-worker path (router/edge/app.py forwards to it a body
# router/openai/responses.py `stateless_body` checked).
RESPONSES_ROUTE = Route(RESPONSES, BOTH_PHASES)
