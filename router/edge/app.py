"""The aiohttp application: one factory, typed app state, every resource one cleanup context."""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from importlib.resources import files

import aiohttp
import orjson
from aiohttp import web

from policies.base import FairnessPolicy, OutputLengthEstimator, PlacementPolicy, RolePolicy
from policies.registry import load_estimator, load_fairness, load_policy, load_role_policy
from router.adapters import prefill_target, query_engine_ids
from router.adapters.mooncake import DEFAULT_BOOTSTRAP_PORT
from router.admission import Admission
from router.background import BackgroundTasks
from router.config import Settings
from router.control.role_manager import ROLES, RoleManager
from router.control.scaling import export_scaling, scaling_report
from router.edge.admin import add_admin_routes
from router.edge.appkeys import GATEWAY
from router.edge.auth import check_scrape
from router.edge.front_door import RequestCount, enter
from router.edge.gateway import Gateway
from router.edge.passthrough import (
    PASSTHROUGH_ROUTES,
    RESPONSES_ROUTE,
    add_passthrough_routes,
    forward,
)
from router.edge.ready_probe import STORE_PROBE, StoreProbe
from router.edge.shutdown import SHUTDOWN, Shutdown
from router.errors import STORE_RETRY_AFTER_S, RouterError, as_router_error, error_response
from router.histograms import HistogramCache
from router.leases import LeaseKeeper
from router.logs import bind_request_id
from router.loop_timing import LoopTiming
from router.metrics import RouterMetrics
from router.openai.api import CHAT, COMPLETIONS
from router.openai.prompt_tokens import parse_generation
from router.openai.responses_pd import RESPONSES, serves_split
from router.relay.upstream_pool import SplicePool
from router.request.lifecycle import ClientSide, RequestFlow
from router.retry_budget import RetryBudget
from router.tenants import KEYRING, Keyring
from router.tracing import Tracing
from router.workers.accounting import LocalAccounting
from router.workers.health_probe import HealthProber
from router.workers.kv_events import KvEventHub
from router.workers.load_poller import LoadPoller
from router.workers.membership import Membership
from router.workers.placement_view import PlacementView
from router.workers.pools import Pools
from router.workers.refresher import StateRefresher
from router.workers.registry import RegistrySync
from router.workers.store_loss import StoreLoss
from router.workers.stranded_reaper import StrandedReaper
from state import StoreError, open_store

__all__ = ["create_app", "GATEWAY", "SETTINGS"]

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
    except web.HTTPException as exc:
        if exc.status < 400:
            raise  # a redirect is an answer, not an error
        err = as_router_error(exc, body_limit=request.app[SETTINGS].server.max_body_bytes)
    except (RouterError, StoreError) as exc:
        if isinstance(exc, StoreError):
            log.debug("%s %s: %s", request.method, request.path, exc)
        err = as_router_error(exc)
    except Exception as exc:
        log.exception("unhandled error serving %s %s", request.method, request.path)
        err = as_router_error(exc)
    return error_response(err)


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

    def answer(self, body: bytes | None, request_id: str) -> web.StreamResponse:
        if body is not None:
            return web.Response(
                body=body, content_type="application/json", headers={"X-Request-Id": request_id}
            )
        if self.stream is None:  # pragma: no cover - run() streams whenever it returns no body
            raise RuntimeError("the request ended with neither a body nor a stream")
        return self.stream


async def _generate(request: web.Request, path: str) -> web.StreamResponse:
    gw = request.app[GATEWAY]
    s = gw.settings
    with RequestCount(gw.metrics, path) as count:
        entry = await enter(request, s)  # shutdown, API key, body, id (router/edge/front_door.py)
        count.tenant = entry.tenant.name
        raw = entry.raw
        # Exact prompt tokens where the model has a tokenizer (router/openai/prompt_tokens.py).
        parsed = await parse_generation(path, raw, s, served_models(gw), gw.metrics)
        if path == RESPONSES and not serves_split(gw.settings, gw.pools, parsed.body):
            # No NIXL-pull prefill worker in rotation (or built-in tools): whole on one worker.
            sent = orjson.dumps(parsed.body)
            resp = await forward(
                gw,
                request,
                RESPONSES_ROUTE,
                sent,
                parsed.model,
                request_id=entry.request_id,
                stream=parsed.stream,
            )
            count.status = resp.status
            return resp
        client = _AiohttpClient(request)
        client_side = ClientSide(parsed, request.headers, client.start_stream)
        flow = RequestFlow(gw.requests, client_side, entry.request_id, entry.tenant)
        bind_request_id(flow.request_id)  # on every log line of this request (router/logs.py)
        model = parsed.model or s.models[0]
        gw.demand.note_arrival(
            model, parsed.prompt_tokens
        )  # autoscaling (router/control/scaling.py)
        with request.app[SHUTDOWN].track(flow):
            try:
                body = await flow.run()
                count.status = flow.status
                return client.answer(body, flow.request_id)
            finally:
                await asyncio.shield(flow.cleanup())
                gw.demand.note_output(model, flow.output_tokens or 0)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, CHAT)


async def completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, COMPLETIONS)


async def responses(request: web.Request) -> web.StreamResponse:
    """Stateless Responses requests: the prefill/decode path (router/openai/responses_pd.py), else
    whole on one worker (router/openai/responses.py)."""
    return await _generate(request, RESPONSES)


def served_models(gw: Gateway) -> tuple[str, ...]:
    """The configured model names plus those of every worker in the pools (registered ones too)."""
    names = dict.fromkeys(gw.settings.models)
    for w in gw.pools.workers.values():
        if w.spec.layout.model:
            names.setdefault(w.spec.layout.model)
    return tuple(names)


async def models(request: web.Request) -> web.Response:
    s = request.app[SETTINGS]
    gw = request.app[GATEWAY]
    now = int(time.time())
    data = [
        {
            "id": m,
            "object": "model",
            "created": now,
            "owned_by": "disagg-router",
            "max_model_len": s.max_model_len,
        }
        for m in served_models(gw)
    ]
    return _json({"object": "list", "data": data})


def _pools_usable(gw: Gateway) -> tuple[bool, bool, bool]:
    prefill = any(w.healthy for w in gw.pools.prefill_workers)
    decode = any(w.healthy for w in gw.pools.decode_workers)
    ok = decode and (prefill or any(w.spec.role == "both" for w in gw.pools.decode_workers))
    return ok, prefill, decode


async def health(request: web.Request) -> web.Response:
    gw = request.app[GATEWAY]
    ok, prefill, decode = _pools_usable(gw)
    return _json(
        {
            "status": "ok" if ok else "degraded",
            "prefill": prefill,
            "decode": decode,
            "store": gw.refresher.store_ok,
        },
        status=200 if ok else 503,
    )


async def ready(request: web.Request) -> web.Response:
    """Ready to serve: a worker in rotation on each side and the shared store answering: a
    refresh of the shared state (its loss marker checked: a store restarted empty is ready once
    this replica has put back what it holds) ends within `READY_STORE_TIMEOUT_S`
    (router/edge/ready_probe.py: a frozen store hangs a read for its socket timeout, 10 s, without
    failing it). A load balancer takes a replica out while this says 503, with a Retry-After."""
    gw = request.app[GATEWAY]
    pools_ok, prefill, decode = _pools_usable(gw)
    answered = await request.app[STORE_PROBE].answers(gw.refresher.refresh)
    store_ok = answered and gw.refresher.store_ok
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
    gw = request.app[GATEWAY]
    check_scrape(gw.settings, request, gw.settings.auth.public_metrics)  # router/edge/auth.py
    m = gw.metrics
    for w in gw.pools.workers.values():
        m.worker_healthy.labels(worker=w.spec.id, role=w.spec.role).set(1 if w.healthy else 0)
        m.worker_drained.labels(worker=w.spec.id, role=w.spec.role).set(1 if w.drained else 0)
        m.breaker_state.labels(worker=w.spec.id).set(0 if w.breaker.allows() else 1)
        if w.spec.is_decode:
            m.reserved_blocks.labels(worker=w.spec.id).set(w.reserved_blocks)
            m.capacity_blocks.labels(worker=w.spec.id).set(w.capacity_blocks)
        else:
            m.stranded_bytes.labels(worker=w.spec.id).set(w.stranded_bytes)
    m.active_reservations.set(len(gw.leases.live))
    m.store_up.set(1 if gw.refresher.store_ok else 0)
    m.owed_store_steps.set(gw.leases.owed)
    m.unpaired_workers.set(len(gw.pools.members.unpaired()))
    m.stranded_byte_seconds.set(gw.refresher.stranded_byte_seconds)
    export_scaling(scaling_report(gw.settings, gw.demand, gw.pools.workers.values()), m)
    return web.Response(body=m.render(), headers={"Content-Type": "text/plain; version=0.0.4"})


async def _learn_mooncake_engines(members: Membership, session: aiohttp.ClientSession) -> None:
    """Mooncake prefill workers name their engine in `GET <bootstrap>/query`: read it once."""
    for w in list(members.prefill_workers):
        spec = w.spec
        if spec.adapter != "mooncake" or spec.engine_id:
            continue
        target = prefill_target(spec.url, spec.bootstrap_port or DEFAULT_BOOTSTRAP_PORT)
        try:
            ids = await query_engine_ids(session, target)
        except Exception as exc:
            log.error(
                "Mooncake prefill %s: no engine id from %s:%s/query (%s); its requests "
                "will fail until it is configured",
                spec.id,
                target.host,
                target.bootstrap_port,
                exc,
            )
            continue
        w.spec = replace(spec, engine_id=ids[min(ids)])


async def _tally_requests(gw: Gateway) -> None:
    """Add this replica's count of first attempts to the shared retry budget, a few times a
    second (router/retry_budget.py)."""
    while True:
        await gw.retry_budget.counted()  # idle: no wake-up until a request is counted
        await asyncio.sleep(0.25)
        try:
            await gw.retry_budget.flush()
        except StoreError:
            pass  # kept for the next flush; the refresher reports the outage


def _gateway_context(settings: Settings):  # type: ignore[no-untyped-def]
    async def ctx(app: web.Application) -> AsyncIterator[None]:
        store = await open_store(
            settings.store.url,
            settings.store.key_prefix,
            max_connections=settings.store.max_connections,
            pool_timeout_s=settings.store.pool_timeout_s,
        )
        metrics = app[METRICS]
        tasks = BackgroundTasks(
            on_failure=lambda name: metrics.background_task_failures.labels(task=name).inc()
        )
        connector = aiohttp.TCPConnector(
            limit=settings.upstream.connections, limit_per_host=0, enable_cleanup_closed=True
        )
        session = aiohttp.ClientSession(
            connector=connector, auto_decompress=False, timeout=aiohttp.ClientTimeout(total=None)
        )
        # The queue's order among tenants (policies/fairness.py), loaded in create_app.
        admission = Admission(settings.admission, app[_FAIRNESS])
        leases = LeaseKeeper(
            store, settings.leases.reservation_s, stranded_lease_s=settings.leases.kv_s
        )

        # The worker pools, each piece given what it uses (router/workers/).
        members = Membership(settings)
        # Quiet (nothing in flight or waiting here, no leg on a worker): the loops slow down.
        timing = LoopTiming(
            members.carrying_work, lambda: admission.inflight > 0 or admission.waiting > 0
        )
        accounting = LocalAccounting(members, timing)
        # Each worker's KV events into its index, read by placement (router/workers/kv_events.py).
        kv_hub = KvEventHub(members, metrics)
        pools = Pools(members, accounting, PlacementView(members, settings, kv_hub))

        async def on_store_reset() -> None:
            metrics.store_resets.inc()
            await leases.reassert()

        keyring = app[KEYRING]  # its shared keys follow the store (router/tenants.py)
        loss = StoreLoss(settings, store, members, on_store_reset, keyring)
        prober = HealthProber(members, timing, settings)
        registry = RegistrySync(settings, store, members, loss, prober, timing, keyring)
        # Each refresh may show room freed by other replicas: wake the admission queue.
        refresher = StateRefresher(
            settings,
            store,
            members,
            accounting,
            loss,
            timing,
            on_refresh=admission.notify,
            own_reservations=leases.reservations_by_worker,
            queue_waits=lambda: admission.waiting > 0,
        )
        reaper = StrandedReaper(
            settings,
            store,
            members,
            accounting,
            timing,
            on_expired=lambda wid: metrics.stranded_expired.labels(worker=wid).inc(),
        )

        gw = Gateway(
            settings=settings,
            store=store,
            session=session,
            policy=app[_POLICY],
            estimator=app[_ESTIMATOR],
            metrics=metrics,
            pools=pools,
            registry=registry,
            prober=prober,
            refresher=refresher,
            leases=leases,
            histograms=HistogramCache(store, settings.loops.histogram_refresh_s, tasks),
            admission=admission,
            tasks=tasks,
            retry_budget=RetryBudget(store, settings.retry),
            splice=SplicePool(settings.upstream.connections)
            if settings.upstream.relay == "splice"
            else None,
            tracing=Tracing(settings.tracing, app[_TRACER_PROVIDER]),
        )
        app[GATEWAY] = gw

        await loss.register_capacities()
        await _learn_mooncake_engines(members, session)
        await registry.sync(session)
        # Before serving: whatever does not answer yet is retried by the health prober.
        await asyncio.gather(
            *(
                prober.discover_layout(session, w)
                for w in members.workers.values()
                if not w.layout_known
            )
        )
        for wid in members.unpaired():
            log.warning(
                "worker %s has no partner with the same KV layout: it will not be "
                "used for a prefill/decode handoff",
                wid,
            )
        await refresher.refresh()

        tasks.loop(refresher.run(), "pools-refresh")
        tasks.loop(reaper.run(), "stranded-reaper")
        tasks.loop(prober.run(session), "health-probe")
        tasks.loop(registry.run(session), "registry-sync")
        tasks.loop(LoadPoller(settings, members, timing).run(session), "load-poller")
        tasks.loop(leases.run(), "lease-keeper")
        tasks.loop(kv_hub.run(), "kv-events")
        tasks.loop(_tally_requests(gw), "retry-tally")
        app[ROLES] = RoleManager(gw, members, accounting, app[_ROLE_POLICY])
        tasks.loop(app[ROLES].run(), "role-manager")
        try:
            yield
        finally:
            await tasks.close()
            await kv_hub.close()
            # What the lease keeper still owes gets one last try before the store closes.
            try:
                await gw.leases.settle_owed()
                await gw.retry_budget.flush()
            except StoreError:
                pass  # leases expire by themselves
            await session.close()
            if gw.splice is not None:
                await gw.splice.close()
            await store.close()

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
    app.cleanup_ctx.append(_gateway_context(settings))
    app.router.add_post(CHAT, chat_completions)
    app.router.add_post(COMPLETIONS, completions)
    app.router.add_post(RESPONSES, responses)
    app.router.add_get("/v1/models", models)
    # Embeddings, (de)tokenize: served whole by one worker (router/edge/passthrough.py)
    add_passthrough_routes(app, lambda a: a[GATEWAY], served_models, PASSTHROUGH_ROUTES)
    app.router.add_get("/health", health)
    app.router.add_get("/ready", ready)
    app[STORE_PROBE] = StoreProbe()
    app.on_cleanup.append(lambda a: a[STORE_PROBE].close())
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/openapi.json", openapi)
    add_admin_routes(app)
    return app
