"""Endpoints passed through to one worker of the model: no disaggregation, no decode reservation.

    POST /v1/embeddings, /tokenize, /detokenize   any worker of the model (every role has the
                                                  model's tokenizer and weights)
    POST /v1/responses                            a worker that runs both phases
                                                  (router/openai/responses.py)

Behind the same front door as chat (router/edge/front_door.py: the shutdown check, the API keys,
the body limit and read timeout, the request id), with the same OpenAI error shapes; an unknown
model is a 404 `model_not_found`. The worker is the least busy one in rotation (healthy, breaker
closed, not drained) that serves the model, the least recently picked among equals, and is sent
the headers every leg is (router/upstream_headers.py). No worker in rotation: 503
`no_worker_in_rotation` with Retry-After.

The leg to that worker is the main path's (router/request/one_worker.py on router/request/legs.py
`leg_errors`): one error mapping and one breaker verdict, settled exactly once whichever way the
request ends (a client that leaves mid-probe gives the probe's place back). A failure before the
client got a byte (a connection error, a timeout, a 5xx, a 429/503, a 200 that is not an answer)
is charged to the worker's breaker and retried on another worker by the retry policy chat's legs
have (router/request/retry_policy.py: the attempts cap, the cluster-wide budget, jittered
backoff); a worker's own 4xx passes through unchanged.

Streams (a Responses request with `stream: true`) go through the main path's relay and SSE cutter
(router/relay/sse_cut.py): whole events only; a stream the worker breaks before its first event
reached the client is retried, one it breaks after ends with the route's error frame
(router/errors.py `stream_error_frame`; it cannot be resumed: these endpoints carry no KV handle
to resume from).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from router.adapters.dp_rank import rank_headers
from router.config import Settings
from router.edge.front_door import RequestCount, enter
from router.errors import InvalidRequest, ModelNotFound, NotInRotation
from router.metrics import RouterMetrics
from router.openai.api import RESPONSES, parse_json_object
from router.request.attempt import LegFailure
from router.request.one_worker import OneWorker
from router.request.retry_policy import RetryPolicy
from router.retry_budget import RetryBudget
from router.upstream_headers import upstream_headers
from router.workers.pools import Pools, WorkerState

__all__ = [
    "ANY_ROLE",
    "BOTH_PHASES",
    "PASSTHROUGH_ROUTES",
    "Passthrough",
    "Route",
    "add_passthrough_routes",
    "forward",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Passthrough:
    """What the passthrough routes use of the replica, handed to them by the app
    (router/edge/app.py) once its services are up: the settings (retries, timeouts, forwarded
    headers, the front door's), the upstream client, the pools to pick a worker from, the
    metrics and the cluster-wide retry budget."""

    settings: Settings
    session: aiohttp.ClientSession
    pools: Pools
    metrics: RouterMetrics
    retry_budget: RetryBudget
    clock: Callable[[], float] = time.monotonic
    leg: OneWorker = field(init=False)  # the one-worker leg on these (router/request/)

    def __post_init__(self) -> None:
        leg = OneWorker(self.session, self.metrics, self.settings.timeouts, self.clock)
        object.__setattr__(self, "leg", leg)  # frozen: set once, here

    def __repr__(self) -> str:
        return f"Passthrough(workers={len(self.pools.workers)})"


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


def _candidates(
    deps: Passthrough, route: Route, model: str | None, tried: set[str]
) -> list[WorkerState]:
    """The most preferred tier's workers in rotation for `model`, untried ones first."""
    for fresh_only in (True, False):
        for roles in route.tiers:
            found = [
                w
                for w in deps.pools.workers.values()
                if w.spec.role in roles
                and w.available
                and w.spec.serves(model)
                and not (fresh_only and w.spec.id in tried)
            ]
            if found:
                return found
    return []


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


def _none_in_rotation(deps: Passthrough, route: Route, model: str | None) -> NotInRotation:
    workers = deps.pools.workers.values()
    known = any(
        w.spec.serves(model) and any(w.spec.role in r for r in route.tiers) for w in workers
    )
    return NotInRotation(
        f"worker for {route.path} of model {model or '(any)'}",
        "health probes failing, circuit breakers open or drained" if known else "",
        retry_after_s=min((w.breaker.cooldown_s for w in workers), default=1.0),
    )


class _Forward:
    """One passthrough request: pick a worker, send it the one-worker leg
    (router/request/one_worker.py), retry before the first byte."""

    def __init__(
        self, deps: Passthrough, request: web.Request, route: Route, picks: Picks, request_id: str
    ) -> None:
        self.deps, self.http, self.route, self.picks = deps, request, route, picks
        self.request_id = request_id
        self.retries = RetryPolicy(deps.settings.retry, deps.retry_budget, deps.metrics, request_id)

    async def run(self, raw: bytes, model: str | None, stream: bool) -> web.StreamResponse:
        retries = self.retries
        retries.begin()
        while True:
            found = _candidates(self.deps, self.route, model, retries.tried)
            if not found:
                raise _none_in_rotation(self.deps, self.route, model)
            worker = self.picks.choose(found)
            retries.attempt()
            try:
                return await self._attempt(worker, raw, stream)
            except LegFailure as failure:
                if not failure.retryable:
                    raise failure.error from failure  # the worker's verdict on the request
                await retries.before_retry(failure)

    async def _attempt(self, w: WorkerState, raw: bytes, stream: bool) -> web.StreamResponse:
        spec, leg = w.spec, self.deps.leg
        headers = upstream_headers(self.deps.settings, self.http.headers, self.request_id, spec)
        headers.update(rank_headers(spec.adapter, spec.dp_rank))  # a vLLM DP rank target's
        self.picks.inflight[spec.id] += 1
        try:
            if not stream:
                whole = await leg.whole(w, self.route.path, raw, headers)
                return web.Response(
                    body=whole.body,
                    content_type=whole.content_type,
                    headers={"X-Request-Id": self.request_id},
                )
            started: list[web.StreamResponse] = []

            async def start_stream(stream_headers: dict[str, str]) -> web.StreamResponse:
                client = web.StreamResponse(
                    headers={**stream_headers, "X-Request-Id": self.request_id}
                )
                started.append(client)
                await client.prepare(self.http)
                return client

            await leg.stream(
                w,
                self.route.path,
                raw,
                headers,
                start_stream,
                responses=self.route.path == RESPONSES,
            )
            return started[0]  # the stream reached the client (else the leg raised)
        finally:
            self.picks.inflight[spec.id] -= 1


async def forward(
    deps: Passthrough,
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
    return await _Forward(deps, request, route, picks, request_id).run(raw, model, stream)


def add_passthrough_routes(
    app: web.Application,
    passthrough: Callable[[web.Application], Passthrough],
    models: Callable[[Passthrough], tuple[str, ...]],
    routes: tuple[Route, ...] = PASSTHROUGH_ROUTES,
) -> None:
    """Register `routes` on `app`; `passthrough(app)` is what the app hands them (once its
    services are up), `models(deps)` the model names it serves now."""
    app[_PICKS] = Picks()

    def handler(route: Route) -> Callable[[web.Request], Any]:
        async def handle(request: web.Request) -> web.StreamResponse:
            deps = passthrough(request.app)
            with RequestCount(deps.metrics, route.path) as count:
                entry = await enter(request, deps.settings)
                count.tenant = entry.tenant.name  # in its tenant's requests too
                raw, body = entry.raw, parse_json_object(entry.raw)
                model = _served_model(body, models(deps))
                stream = False
                if route.shape is not None:
                    sent, stream = route.shape(body)
                    if sent is not body:
                        raw = orjson.dumps(sent)
                resp = await forward(
                    deps, request, route, raw, model, request_id=entry.request_id, stream=stream
                )
                count.status = resp.status
                return resp

        return handle

    for route in routes:
        app.router.add_post(route.path, handler(route))


# The Responses API's whole-on-one-worker path (router/edge/app.py forwards to it a body
# router/openai/responses.py `stateless_body` checked).
RESPONSES_ROUTE = Route(RESPONSES, BOTH_PHASES)
