"""Endpoints passed through to one worker of the model: no disaggregation, no decode reservation.

    POST /v1/embeddings, /tokenize, /detokenize   any worker of the model (every role has the
                                                  model's tokenizer and weights)
    POST /v1/responses                            a worker that runs both phases
                                                  (router/responses.py)

Behind the same front door as chat: the API keys, the body limit and read timeout, the OpenAI
error shapes, the shutdown check; an unknown model is a 404 `model_not_found`. The worker is
the least busy one in rotation (healthy, breaker closed, not drained) that serves the model, the
least recently picked among equals. A failure before the client got a byte — connection error,
timeout, 5xx, 429/503 — is charged to that worker's breaker and retried on another worker,
within `retry.max_attempts` and the cluster-wide retry budget, with jittered backoff; a worker's
own 4xx passes through unchanged. No worker in rotation: 503 with Retry-After.

Streams (a Responses request with `stream: true`) are forwarded event by event; a stream the
worker breaks after the first byte ends with the route's own error event (it cannot be resumed:
these endpoints carry no KV handle to resume from).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import random
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from router.api import parse_json_object
from router.auth import bearer_token, token_matches
from router.errors import (
    BodyTooLarge,
    DeadlineExceeded,
    InvalidRequest,
    ModelNotFound,
    RouterError,
    Unauthorized,
    Unavailable,
    UpstreamError,
    as_router_error,
)
from router.gateway import Gateway
from router.request.attempt import LegFailure, upstream_failure
from router.server import read_body
from router.shutdown import SHUTDOWN
from router.workers.pools import WorkerState
from state import StoreError

__all__ = [
    "ANY_ROLE",
    "BOTH_PHASES",
    "PASSTHROUGH_ROUTES",
    "Route",
    "add_passthrough_routes",
    "forward",
    "read_json_request",
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
    error_event: Callable[[RouterError], bytes] | None = None  # ends a broken stream
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


def _serves(w: WorkerState, model: str | None) -> bool:
    return model is None or not w.spec.layout.model or w.spec.layout.model == model


def _candidates(gw: Gateway, route: Route, model: str | None, tried: set[str]) -> list[WorkerState]:
    """The most preferred tier's workers in rotation for `model`, untried ones first."""
    for fresh_only in (True, False):
        for roles in route.tiers:
            found = [
                w
                for w in gw.pools.workers.values()
                if w.spec.role in roles
                and w.available
                and _serves(w, model)
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


def _request_id(value: str | None) -> str:
    """The client's X-Request-Id when it is a sane header token, else one of ours (as chat)."""
    if value and len(value) <= 128 and value.isascii() and value.isprintable() and " " not in value:
        return value
    return f"dr-{uuid.uuid4().hex}"


def _check_auth(gw: Gateway, request: web.Request) -> None:
    keys = gw.settings.api_keys
    if keys and not token_matches(bearer_token(request), keys):
        raise Unauthorized("a valid API key is required (Authorization: Bearer ...)")


async def read_json_request(
    gw: Gateway, request: web.Request, models: tuple[str, ...]
) -> tuple[bytes, dict[str, Any], str | None]:
    """The front door: shutdown, auth, body limit and timeout, a JSON object, a served model.
    Returns (raw body, parsed body, model or None when the body names none)."""
    s = gw.settings
    request.app[SHUTDOWN].check()
    _check_auth(gw, request)
    if request.content_length is not None and request.content_length > s.max_body_bytes:
        raise BodyTooLarge(f"the request body is larger than {s.max_body_bytes} bytes")
    raw = await read_body(request, s.timeouts.body_s)
    body = parse_json_object(raw)
    model = body.get("model")
    if model is not None and (not isinstance(model, str) or not model):
        raise InvalidRequest("'model' must be a non-empty string", param="model")
    if model is not None and model not in models:
        raise ModelNotFound(f"The model `{model}` does not exist.", param="model")
    return raw, body, model


class _Forward:
    """One passthrough request: pick, send, retry before the first byte, relay."""

    def __init__(self, gw: Gateway, request: web.Request, route: Route, picks: Picks) -> None:
        self.gw, self.http, self.route, self.picks = gw, request, route, picks
        self.request_id = _request_id(request.headers.get("X-Request-Id"))
        self._rng = random.Random(self.request_id)

    def _headers(self, w: WorkerState) -> dict[str, str]:
        s = self.gw.settings
        headers = {"Content-Type": "application/json", "X-Request-Id": self.request_id}
        for name in s.forward_headers:
            value = self.http.headers.get(name)
            if value is not None:
                headers[name] = value
        if w.spec.api_key:
            headers["Authorization"] = "Bearer " + w.spec.api_key.reveal()
        elif s.forward_client_auth and "Authorization" in self.http.headers:
            headers["Authorization"] = self.http.headers["Authorization"]
        return headers

    def _failed(self, w: WorkerState, probe: bool, kind: str, err: RouterError) -> LegFailure:
        self.gw.metrics.upstream_errors.labels(side=w.spec.role, kind=kind).inc()
        w.breaker.on_failure(probe)
        return LegFailure(w.spec.role, w.spec.id, err, True)

    async def run(self, raw: bytes, model: str | None, stream: bool) -> web.StreamResponse:
        gw, r = self.gw, self.gw.settings.retry
        gw.retry_budget.note_request()
        tried: set[str] = set()
        attempts = 0
        while True:
            found = _candidates(gw, self.route, model, tried)
            if not found:
                cooldowns = [w.breaker.cooldown_s for w in gw.pools.workers.values()]
                raise Unavailable(
                    f"no worker for {self.route.path} of model {model or '(any)'} is in "
                    "rotation (health probes failing or circuit breakers open)",
                    retry_after_s=min(cooldowns, default=1.0),
                )
            worker = self.picks.choose(found)
            attempts += 1
            try:
                return await self._attempt(worker, raw, stream)
            except LegFailure as failure:
                tried.add(worker.spec.id)
                if not failure.retryable:
                    raise failure.error from failure
                if attempts >= r.max_attempts:
                    raise Unavailable(
                        f"gave up after {attempts} attempts; last: {failure.error.message}",
                        retry_after_s=1.0,
                    ) from failure
                if not await gw.retry_budget.try_retry():
                    gw.metrics.retry_budget_exhausted.inc()
                    raise Unavailable(
                        "the cluster-wide retry budget is spent; not retrying: "
                        + failure.error.message,
                        retry_after_s=1.0,
                    ) from failure
                gw.metrics.retries.labels(side=failure.side).inc()
                backoff = min(r.backoff_max_s, r.backoff_base_s * 2 ** (attempts - 1))
                await asyncio.sleep(self._rng.uniform(0, backoff))

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
                        headers=self._headers(w),
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
                if self.route.error_event is not None:
                    await client.write(self.route.error_event(err))
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
    stream: bool = False,
) -> web.StreamResponse:
    """Serve `raw` (the client's body, unchanged) by one worker of `route`'s roles."""
    return await _Forward(gw, request, route, request.app[_PICKS]).run(raw, model, stream)


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
            status = 500
            try:
                raw, body, model = await read_json_request(gw, request, models(gw))
                stream = False
                if route.shape is not None:
                    sent, stream = route.shape(body)
                    if sent is not body:
                        raw = orjson.dumps(sent)
                resp = await forward(gw, request, route, raw, model, stream=stream)
                status = resp.status
                return resp
            except (RouterError, StoreError) as exc:
                status = as_router_error(exc).status
                raise
            except asyncio.CancelledError:
                status = 499
                raise
            finally:
                gw.metrics.requests.labels(route=route.path, status=str(status)).inc()

        return handle

    for route in routes:
        app.router.add_post(route.path, handler(route))
