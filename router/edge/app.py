"""The aiohttp application: one factory, typed app state, every resource one cleanup context."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from importlib.resources import files
from typing import Any, Protocol, TypeVar

import orjson
from aiohttp import web

from policies.base import FairnessPolicy, OutputLengthEstimator, PlacementPolicy, RolePolicy
from policies.registry import load_estimator, load_fairness, load_policy, load_role_policy
from router.config import Settings
from router.control.role_manager import ROLES, RoleManager
from router.control.scaling import DemandMeter, export_scaling, scaling_report
from router.edge.admin import ADMIN, AdminView, add_admin_routes
from router.edge.auth import check_scrape
from router.edge.front_door import Entry, RequestCount, enter
from router.edge.lean_door import LeanRoutes
from router.edge.passthrough import (
    PASSTHROUGH_ROUTES,
    RESPONSES_ROUTE,
    Passthrough,
    add_passthrough_routes,
    forward,
)
from router.edge.ready_probe import STORE_PROBE, StoreProbe
from router.edge.request_stages import build_stages
from router.edge.server import LEAN_ROUTES
from router.edge.shutdown import SHUTDOWN, Shutdown
from router.edge.wiring import (
    Core,
    WorkerLoops,
    build_worker_loops,
    close,
    open_core,
    start_loops,
    warm_up,
)
from router.errors import STORE_RETRY_AFTER_S, RouterError, as_router_error, error_response
from router.histograms import HistogramCache
from router.leases import LeaseKeeper
from router.logs import bind_request_id
from router.metrics import RouterMetrics
from router.openai.api import CHAT, COMPLETIONS, ParsedRequest
from router.openai.prompt_tokens import parse_generation
from router.openai.responses_pd import RESPONSES, serves_split
from router.request.lifecycle import ClientSide, RequestFlow, RequestStages
from router.tenants import KEYRING, Keyring
from router.tracing import Tracing
from router.workers.pools import Pools
from router.workers.refresher import StateRefresher
from state import StoreError

__all__ = ["create_app", "METRICS", "SERVING", "SETTINGS", "Serving", "served_models"]

log = logging.getLogger(__name__)

SETTINGS = web.AppKey("settings", Settings)
METRICS = web.AppKey("metrics", RouterMetrics)
_OPENAPI = files("router").joinpath("openapi.json")


def _json(data: object, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(data), status=status, content_type="application/json")


@web.middleware
async def error_middleware(request: web.Request, handler):  # type: ignore[no-untyped-def]
    """The one place a handler's errors become answers, built as every error answer is
    (router/errors.py); anything unexpected is still an OpenAI body."""
    try:
        return await handler(request)
    except ConnectionResetError:
        raise  # the client is gone: nobody to answer
    except Exception as exc:
        if isinstance(exc, web.HTTPException) and exc.status < 400:
            raise  # a redirect is an answer, not an error
        return error_response(handler_error(exc, request))


def handler_error(exc: BaseException, request: Any) -> RouterError:
    """The answer for what a handler raised (the middleware's, and the lean door's)."""
    if isinstance(exc, web.HTTPException):
        return as_router_error(exc, body_limit=request.app[SETTINGS].server.max_body_bytes)
    if isinstance(exc, (RouterError, StoreError)):
        if isinstance(exc, StoreError):
            log.debug("%s %s: %s", request.method, request.path, exc)
        return as_router_error(exc)
    log.exception("unhandled error serving %s %s", request.method, request.path, exc_info=exc)
    return as_router_error(exc)


_A = TypeVar("_A", covariant=True)


class _Client(Protocol[_A]):
    """The door's side of a `ClientSide`: aiohttp's (`_AiohttpClient`) or the lean door's
    (router/edge/lean_door.py `LeanClient`)."""

    async def start_stream(self, headers: dict[str, str]) -> Any: ...

    def answer(self, body: bytes | None, headers: dict[str, str]) -> _A: ...


class _AiohttpClient:
    """aiohttp's side of a `ClientSide`: starts the streamed response on the request, and turns
    the flow's outcome into the handler's answer."""

    __slots__ = ("request", "stream")

    def __init__(self, request: web.Request) -> None:
        self.request = request
        self.stream: web.StreamResponse | None = None

    async def start_stream(self, headers: dict[str, str]) -> web.StreamResponse:
        self.stream = web.StreamResponse(headers=headers)
        await self.stream.prepare(self.request)
        return self.stream

    def answer(self, body: bytes | None, headers: dict[str, str]) -> web.StreamResponse:
        if body is not None:
            return web.Response(body=body, content_type="application/json", headers=headers)
        if self.stream is None:  # pragma: no cover - run() streams whenever it returns no body
            raise RuntimeError("the request ended with neither a body nor a stream")
        return self.stream


async def _generate(request: web.Request, path: str) -> web.StreamResponse:
    """Chat and completions: always the prefill/decode path."""
    return await generate(request, path, _AiohttpClient(request))


async def generate(request: Any, path: str, client: _Client[_A]) -> _A:
    """Chat and completions on either door: `request` is aiohttp's, or the lean door's
    (router/edge/lean_door.py `LeanRequest`: the attributes of aiohttp's read here)."""
    s, metrics, served = request.app[SETTINGS], request.app[METRICS], _served(request)
    with RequestCount(metrics, path) as count:
        entry = await enter(request, s)  # shutdown, API key, body, id (router/edge/front_door.py)
        count.tenant = entry.tenant.name
        # Exact prompt tokens where the model has a tokenizer (router/openai/prompt_tokens.py).
        parsed = await parse_generation(path, entry.raw, s, served, metrics)
        return await _serve(request, entry, parsed, count, client)


def lean_routes(app: web.Application) -> LeanRoutes:
    """What the lean front door serves (router/edge/lean_door.py): chat and completions."""
    return LeanRoutes(
        paths={CHAT.encode(): CHAT, COMPLETIONS.encode(): COMPLETIONS},
        serve=generate,
        error_for=_lean_error,
        app=app,
        max_body_bytes=app[SETTINGS].server.max_body_bytes,
    )


def _lean_error(exc: BaseException, request: Any) -> RouterError | None:
    """The lean door's answer for what the flow raised; None: the client is gone."""
    return None if isinstance(exc, ConnectionResetError) else handler_error(exc, request)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, CHAT)


async def completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, COMPLETIONS)


async def responses(request: web.Request) -> web.StreamResponse:
    """Stateless Responses requests: the prefill/decode path (router/openai/responses_pd.py), else
    whole on one worker (router/openai/responses.py)."""
    s, metrics, served = request.app[SETTINGS], request.app[METRICS], _served(request)
    with RequestCount(metrics, RESPONSES) as count:
        entry = await enter(request, s)
        count.tenant = entry.tenant.name
        parsed = await parse_generation(RESPONSES, entry.raw, s, served, metrics)
        if serves_split(s, request.app[SERVING].pools, parsed.body):
            return await _serve(request, entry, parsed, count, _AiohttpClient(request))
        # No NIXL-pull prefill worker in rotation (or built-in tools): whole on one worker.
        resp = await forward(
            request.app[_PASSTHROUGH],
            request,
            RESPONSES_ROUTE,
            orjson.dumps(parsed.body),
            parsed.model,
            request_id=entry.request_id,
            stream=parsed.stream,
        )
        count.status = resp.status
        return resp


def _served(request: web.Request) -> tuple[str, ...]:
    """The names a generation request may name: the models and the LoRA adapters known."""
    pools = request.app[SERVING].pools
    return served_models(request.app[SETTINGS], pools) + tuple(pools.placement.loras.adapters())


async def _serve(
    request: Any, entry: Entry, parsed: ParsedRequest, count: RequestCount, client: _Client[_A]
) -> _A:
    """One request's flow through the prefill/decode path (router/request/lifecycle.py)."""
    serving = request.app[SERVING]
    client_side = ClientSide(parsed, request.headers, client.start_stream)
    flow = RequestFlow(serving.stages, client_side, entry.request_id, entry.tenant)
    bind_request_id(flow.request_id)  # on every log line of this request (router/logs.py)
    model = parsed.model or request.app[SETTINGS].models[0]
    serving.demand.note_arrival(model, parsed.prompt_tokens)  # router/control/scaling.py
    with request.app[SHUTDOWN].track(flow):
        try:
            body = await flow.run()
            count.status = flow.status
            return client.answer(body, flow.answer_headers)
        finally:
            if flow.settled:  # a stream settles as its decode ends: nothing left to await
                flow.close()
            else:
                await asyncio.shield(flow.cleanup())
            serving.demand.note_output(model, flow.output_tokens or 0)


def served_models(settings: Settings, pools: Pools) -> tuple[str, ...]:
    """The configured model names plus those of every worker in the pools (registered ones too)."""
    names = dict.fromkeys(settings.models)
    for w in pools.workers.values():
        if w.spec.layout.model:
            names.setdefault(w.spec.layout.model)
    return tuple(names)


async def models(request: web.Request) -> web.Response:
    s = request.app[SETTINGS]
    now = int(time.time())
    data = [
        {
            "id": m,
            "object": "model",
            "created": now,
            "owned_by": "disagg-router",
            "max_model_len": s.max_model_len,
        }
        for m in served_models(s, request.app[SERVING].pools)
    ]
    # LoRA adapters, with their base model as vLLM lists them (docs/lora.md).
    adapters = request.app[SERVING].pools.placement.loras.adapters()
    data += [
        {"id": a, "object": "model", "created": now, "owned_by": "disagg-router", "parent": base}
        for a, base in adapters.items()
    ]
    return _json({"object": "list", "data": data})


def _pools_usable(pools: Pools) -> tuple[bool, bool, bool]:
    prefill = any(w.healthy for w in pools.prefill_workers)
    decode = any(w.healthy for w in pools.decode_workers)
    ok = decode and (prefill or any(w.spec.role == "both" for w in pools.decode_workers))
    return ok, prefill, decode


async def health(request: web.Request) -> web.Response:
    serving = request.app[SERVING]
    ok, prefill, decode = _pools_usable(serving.pools)
    return _json(
        {
            "status": "ok" if ok else "degraded",
            "prefill": prefill,
            "decode": decode,
            "store": serving.refresher.store_ok,
        },
        status=200 if ok else 503,
    )


async def ready(request: web.Request) -> web.Response:
    """Ready to serve: a worker in rotation on each side and the shared store answering: a
    refresh of the shared state (its loss marker checked: a store restarted empty is ready once
    this replica has put back what it holds) ends within `READY_STORE_TIMEOUT_S`
    (router/edge/ready_probe.py: a frozen store hangs a read for its socket timeout, 10 s, without
    failing it). A load balancer takes a replica out while this says 503, with a Retry-After."""
    serving = request.app[SERVING]
    refresher = serving.refresher
    pools_ok, prefill, decode = _pools_usable(serving.pools)
    answered = await request.app[STORE_PROBE].answers(refresher.refresh)
    store_ok = answered and refresher.store_ok
    stopping = request.app[SHUTDOWN].stopping
    ok = pools_ok and store_ok and not stopping
    body: dict[str, object] = {
        "status": "ready" if ok else "not_ready",
        "prefill": prefill,
        "decode": decode,
        "store": store_ok,
        "shutting_down": stopping,
    }
    if not store_ok:
        body["store_error"] = "the shared state store does not answer"
    resp = _json(body, status=200 if ok else 503)
    if not ok:  # a dependency down: when to look again
        resp.headers["Retry-After"] = str(math.ceil(STORE_RETRY_AFTER_S))
    return resp


async def openapi(request: web.Request) -> web.Response:
    """The hand-written API description shipped with the package (router/openapi.json);
    a credential needed when `public_openapi` is false (router/edge/auth.py)."""
    settings = request.app[SETTINGS]
    check_scrape(settings, request, settings.auth.public_openapi)
    return web.Response(body=_OPENAPI.read_bytes(), content_type="application/json")


async def metrics(request: web.Request) -> web.Response:
    settings, serving = request.app[SETTINGS], request.app[SERVING]
    check_scrape(settings, request, settings.auth.public_metrics)  # router/edge/auth.py
    m, pools, leases = request.app[METRICS], serving.pools, serving.leases
    for w in pools.workers.values():
        m.worker_healthy.labels(worker=w.spec.id, role=w.spec.role).set(1 if w.healthy else 0)
        m.worker_drained.labels(worker=w.spec.id, role=w.spec.role).set(1 if w.drained else 0)
        m.breaker_state.labels(worker=w.spec.id).set(0 if w.breaker.allows() else 1)
        if w.spec.is_decode:
            m.reserved_blocks.labels(worker=w.spec.id).set(w.reserved_blocks)
            m.capacity_blocks.labels(worker=w.spec.id).set(w.capacity_blocks)
        else:
            m.stranded_bytes.labels(worker=w.spec.id).set(w.stranded_bytes)
    m.active_reservations.set(len(leases.live))
    m.store_up.set(1 if serving.refresher.store_ok else 0)
    m.owed_store_steps.set(leases.owed)
    m.unpaired_workers.set(len(pools.members.unpaired()))
    m.stranded_byte_seconds.set(serving.refresher.stranded_byte_seconds)
    export_scaling(scaling_report(settings, serving.demand, pools.workers.values()), m)
    return web.Response(body=m.render(), headers={"Content-Type": "text/plain; version=0.0.4"})


@dataclass(frozen=True, slots=True)
class Serving:
    """What the routes of this module read of the replica, besides its settings and metrics:
    the request stages, the pools, the demand meter, the refresher (the store's health) and the
    leases (the metrics' live reservations)."""

    stages: RequestStages
    pools: Pools
    demand: DemandMeter  # autoscaling signals (router/control/scaling.py)
    refresher: StateRefresher
    leases: LeaseKeeper

    def __repr__(self) -> str:
        return f"Serving({self.stages!r})"


SERVING = web.AppKey("serving", Serving)
_PASSTHROUGH = web.AppKey("passthrough", Passthrough)


def _hand_out(app: web.Application, core: Core, loops: WorkerLoops, demand: DemandMeter) -> None:
    """Each surface gets what it uses: the request stages and this module's routes, the admin
    routes, the passthrough routes."""
    settings, clock = core.settings, time.monotonic
    histograms = HistogramCache(core.store, settings.loops.histogram_refresh_s, core.tasks)
    tracing = Tracing(settings.tracing, app[_TRACER_PROVIDER])
    stages = build_stages(
        core,
        loops.pools,
        policy=app[_POLICY],
        estimator=app[_ESTIMATOR],
        histograms=histograms,
        tracing=tracing,
        clock=clock,
    )
    # A miss on a view left from a quiet spell reads the store before it refuses or queues.
    stages.reserve.fresh_usage = loops.refresher.read_if_stale
    app[SERVING] = Serving(stages, loops.pools, demand, loops.refresher, core.leases)
    app[ADMIN] = AdminView(
        settings=settings,
        store=core.store,
        session=core.session,
        members=loops.members,
        placement=loops.pools.placement,
        registry=loops.registry,
        prober=loops.prober,
        policy=app[_POLICY],
        estimator=app[_ESTIMATOR],
        leases=core.leases,
        admission=core.admission,
        demand=demand,
    )
    app[_PASSTHROUGH] = Passthrough(
        settings, core.session, loops.pools, core.metrics, core.retry_budget, clock
    )


def _services_context(settings: Settings):  # type: ignore[no-untyped-def]
    """The replica's services for the app's life, in this order: built, handed out, warmed up
    (before serving), their loops started (the role manager's last); on the way out every loop
    stopped, what is owed settled, the clients closed, the store last (router/edge/wiring.py)."""

    async def ctx(app: web.Application) -> AsyncIterator[None]:
        core = await open_core(settings, app[METRICS], app[_FAIRNESS])
        loops = build_worker_loops(core, app[KEYRING])
        # Autoscaling signals: noted by the generation routes, read by the role manager, the
        # admin API and the metrics (router/control/scaling.py).
        demand = DemandMeter(settings.scaling.window_s, time.monotonic)
        _hand_out(app, core, loops, demand)
        await warm_up(core, loops)
        start_loops(core, loops)
        share = app[SERVING].stages.reserve.share
        if share is not None:  # room another replica left for this one's waiters: read it now

            async def read_room_now() -> None:
                with contextlib.suppress(StoreError):
                    await loops.refresher.refresh(check_marker=False)
                core.admission.notify()

            share.listen(read_room_now)
        app[ROLES] = RoleManager(
            settings, core.store, core.session, core.metrics, demand,
            loops.members, loops.accounting, app[_ROLE_POLICY],
        )  # fmt: skip
        core.tasks.loop(app[ROLES].run(), "role-manager")
        try:
            yield
        finally:
            await close(core, loops)

    return ctx


_POLICY = web.AppKey("policy", PlacementPolicy)
_TRACER_PROVIDER = web.AppKey("tracer_provider", object)
_ESTIMATOR = web.AppKey("estimator", OutputLengthEstimator)
_ROLE_POLICY = web.AppKey("role_policy", RolePolicy)
_FAIRNESS = web.AppKey("fairness", FairnessPolicy)


def create_app(settings: Settings, *, tracer_provider: object = None) -> web.Application:
    """Build the router. Policies load (and are smoke-tested) here, so a bad plugin fails now.
    `tracer_provider`: OpenTelemetry's, when `settings.tracing` (default: the global one)."""
    app = web.Application(
        middlewares=[error_middleware], client_max_size=settings.server.max_body_bytes
    )
    app[SETTINGS] = settings
    app[METRICS] = RouterMetrics()
    app[SHUTDOWN] = Shutdown(settings.server.shutdown_grace_s)
    app[_TRACER_PROVIDER] = tracer_provider
    app[_POLICY] = load_policy(settings.policy, settings.policy_args)
    app[_ESTIMATOR] = load_estimator(
        settings.estimates.estimator, settings.estimates.estimator_args
    )
    app[_ROLE_POLICY] = load_role_policy(settings.roles.policy, dict(settings.roles.policy_args))
    app[_FAIRNESS] = load_fairness(settings.admission.fairness, settings.admission.fairness_args)
    # Tenants and their hashed keys; the admin API changes them, shared by every replica through
    # the store (router/tenants.py).
    app[KEYRING] = Keyring(settings.tenants, settings.tenant_keys, settings.auth.api_keys)
    if settings.server.front_door == "lean":
        app[LEAN_ROUTES] = lean_routes(app)
    app.cleanup_ctx.append(_services_context(settings))
    app.router.add_post(CHAT, chat_completions)
    app.router.add_post(COMPLETIONS, completions)
    app.router.add_post(RESPONSES, responses)
    app.router.add_get("/v1/models", models)
    # Embeddings, (de)tokenize: served whole by one worker (router/edge/passthrough.py)
    add_passthrough_routes(
        app,
        lambda a: a[_PASSTHROUGH],
        lambda gw: served_models(gw.settings, gw.pools),
        PASSTHROUGH_ROUTES,
    )
    app.router.add_get("/health", health)
    app.router.add_get("/ready", ready)
    app[STORE_PROBE] = StoreProbe()
    app.on_cleanup.append(lambda a: a[STORE_PROBE].close())
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/openapi.json", openapi)
    add_admin_routes(app)
    return app
