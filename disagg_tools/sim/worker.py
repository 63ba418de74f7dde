"""The simulated GPU worker: vLLM's OpenAI HTTP API with the NIXL connector in pull mode.

    POST /v1/completions, /v1/chat/completions
        kv_transfer_params.do_remote_decode  -> prefill: queue, KV entry under lease, 1 token
        kv_transfer_params.do_remote_prefill -> decode: pull the KV from P, join the batch, stream
        neither                              -> local prefill, then decode
    GET  /health /v1/models /version /metrics
    POST /sim/kv/pull                          the decode side's KV read (the NIXL stand-in)
    POST /v1/load_lora_adapter ...             vLLM's LoRA adapters (sim.lora)
    POST /generate, GET /server_info ...       SGLang's API and PD bootstrap rooms
                                               (sim.sglang_protocol, sim.bootstrap)
    POST /pd_role_switch                       SGLang's runtime prefill <-> decode flip, with
                                               --enable-pd-role-switch (sim.role_switch)
    POST /tokenize /detokenize /v1/embeddings  vLLM's tokenizer, embeddings and Responses endpoints
         /v1/responses                         (sim.extra_endpoints)
    GET|DELETE /sim/requests, GET /sim/state, GET|POST /sim/faults   test hooks

Answers come from `disagg_tools.sim.textgen`, so tests can compute what must arrive; timing comes
from the
shared cost model through `disagg_tools.sim.decode_engine`. A closed connection aborts the request
at once.
This module builds the app and runs it; `disagg_tools.sim.generation` serves the generation
requests.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys
import time
from collections.abc import AsyncIterator, Sequence

import aiohttp
import orjson
from aiohttp import web

from disagg_tools import uvrun

from .bootstrap import bootstrap_listener
from .extra_endpoints import add_extra_routes
from .faults import FaultConfig, error_response
from .generation import handle_generation, handle_kv_pull, json_response
from .kv_event_routes import add_kv_event_routes, kv_events_context
from .lora import add_lora_routes
from .role_switch import ROLE_SWITCH_PATH, handle_role_switch
from .sglang_protocol import add_sglang_routes
from .worker_config import WorkerConfig, add_worker_arguments, config_from_args
from .worker_state import WORKER, Worker

__all__ = [
    "WORKER",
    "Worker",
    "WorkerConfig",
    "FaultConfig",
    "create_worker_app",
    "running_worker",
    "run_worker",
    "add_worker_arguments",
    "config_from_args",
]

DISCONNECT_POLL_S = 0.02


def create_worker_app(config: WorkerConfig) -> web.Application:
    app = web.Application(client_max_size=64 * 1024 * 1024)
    app[WORKER] = Worker(config)
    app.cleanup_ctx.append(_background)
    app.cleanup_ctx.append(bootstrap_listener)
    app.cleanup_ctx.append(kv_events_context)
    add_kv_event_routes(app)  # its prefix cache's KV events (sim.kv_events)
    app.router.add_post("/v1/completions", handle_generation)
    app.router.add_post("/v1/chat/completions", handle_generation)
    app.router.add_post("/generate", handle_generation)  # SGLang native
    add_sglang_routes(app)
    app.router.add_post(ROLE_SWITCH_PATH, handle_role_switch)
    add_extra_routes(app)  # /v1/embeddings, /detokenize, /v1/responses (sim.extra_endpoints)
    app.router.add_get("/health", _handle_health)
    app.router.add_get("/v1/models", _handle_models)
    app.router.add_get("/version", _handle_version)
    app.router.add_get("/metrics", _handle_metrics)
    # vLLM serves /metrics/ too (prometheus_client's own app, which the load poll asks by name).
    app.router.add_get("/metrics/", _handle_metrics)
    app.router.add_post("/sim/kv/pull", handle_kv_pull)
    add_lora_routes(app, lambda a: a[WORKER].loras)  # /v1/load_lora_adapter ... (sim.lora)
    app.router.add_get("/sim/requests", _handle_get_requests)
    app.router.add_delete("/sim/requests", _handle_clear_requests)
    app.router.add_get("/sim/state", _handle_state)
    app.router.add_get("/sim/faults", _handle_get_faults)
    app.router.add_post("/sim/faults", _handle_set_faults)
    return app


async def _background(app: web.Application) -> AsyncIterator[None]:
    """The engine loop, the lease reaper, the disconnect watcher and the pull client."""
    worker = app[WORKER]
    worker.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60))
    tasks = [
        asyncio.create_task(worker.engine.run(), name=f"sim-engine-{worker.config.name}"),
        asyncio.create_task(_reap_leases(worker), name=f"sim-reaper-{worker.config.name}"),
        asyncio.create_task(_watch_disconnects(worker), name=f"sim-watch-{worker.config.name}"),
    ]
    try:
        yield
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await worker.session.close()


async def _reap_leases(worker: Worker) -> None:
    ledger = worker.ledger
    while True:
        expiry = ledger.next_expiry()
        if expiry is None:
            ledger.added.clear()
            await ledger.added.wait()
            continue
        await asyncio.sleep(max(0.0, expiry - ledger.clock()))
        ledger.reap()


async def _watch_disconnects(worker: Worker) -> None:
    # aiohttp cancels handlers on disconnect only with handler_cancellation=True, which belongs to
    # whoever runs the app; polling the transports makes "closing the connection aborts" hold
    # under any runner. Only while requests are in flight, so an idle worker costs nothing.
    while True:
        if not worker.inflight:
            worker.inflight_changed.clear()
            await worker.inflight_changed.wait()
            continue
        await asyncio.sleep(DISCONNECT_POLL_S)
        for task, request in list(worker.inflight.items()):
            transport = request.transport
            if transport is None or transport.is_closing():
                worker.inflight.pop(task, None)
                task.cancel()


# --- plain endpoints and test hooks --------------------------------------------------------


async def _handle_health(request: web.Request) -> web.Response:
    # 200 even after a failed role switch left the instance unhealthy (sim.role_switch): SGLang's
    # /health does not look at that flag, so a router must remember the failed switch itself.
    return web.Response(status=200)


async def _handle_models(request: web.Request) -> web.Response:
    worker = request.app[WORKER]
    created = int(time.time())
    card = {
        "id": worker.config.model_name,
        "object": "model",
        "created": created,
        "owned_by": "vllm",
        "root": worker.config.model,
        "parent": None,
        "max_model_len": worker.max_model_len,
        "permission": [],
    }
    adapters = worker.loras.model_cards(created)  # with `parent` (sim.lora)
    return json_response({"object": "list", "data": [card, *adapters]})


async def _handle_version(request: web.Request) -> web.Response:
    return json_response({"version": "0.0.0-sim"})


async def _handle_metrics(request: web.Request) -> web.Response:
    worker = request.app[WORKER]
    worker.ledger.reap()
    return web.Response(
        body=worker.metrics.render(),
        headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"},
    )


async def _handle_get_requests(request: web.Request) -> web.Response:
    return json_response(list(request.app[WORKER].recent))


async def _handle_clear_requests(request: web.Request) -> web.Response:
    request.app[WORKER].recent.clear()
    return web.Response(status=204)


async def _handle_state(request: web.Request) -> web.Response:
    return json_response(request.app[WORKER].state())


async def _handle_get_faults(request: web.Request) -> web.Response:
    return json_response(request.app[WORKER].faults.snapshot())


async def _handle_set_faults(request: web.Request) -> web.Response:
    worker = request.app[WORKER]
    try:
        config = FaultConfig.from_mapping(orjson.loads(await request.read()))
    except (orjson.JSONDecodeError, ValueError) as exc:
        return error_response(400, f"bad fault config: {exc}")
    worker.faults.replace(config)
    return json_response(worker.faults.snapshot())


# --- running it --------------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def running_worker(
    config: WorkerConfig, *, shutdown_timeout: float = 1.0
) -> AsyncIterator[str]:
    """Serve a worker (on an ephemeral port if config.port is 0); yield its base URL."""
    runner = web.AppRunner(
        create_worker_app(config),
        handler_cancellation=True,
        shutdown_timeout=shutdown_timeout,
        access_log=None,
    )
    await runner.setup()
    try:
        site = web.TCPSite(runner, config.host, config.port)
        await site.start()
        host, port = runner.addresses[0][:2]
        yield f"http://{host}:{port}"
    finally:
        await runner.cleanup()


async def _serve(config: WorkerConfig) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    # Drain in-flight streams for a few seconds on SIGTERM, then cut what is left.
    async with running_worker(config, shutdown_timeout=5.0) as url:
        print(f"sim worker {config.name} ({config.role}) listening on {url}", flush=True)
        await stop.wait()


def run_worker(config: WorkerConfig) -> None:
    """Process entry: serve until SIGTERM/SIGINT, on uvloop when it is installed."""
    uvrun.run(_serve(config))


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m disagg_tools.sim.worker [--log-level L] --role ...`: the worker's own entry, the
    same flags
    as the umbrella's `disagg-router worker`, for the tools below the launcher that spawn
    workers (disagg_tools/loadgen/, disagg_tools/launcher/localcluster.py)."""
    parser = argparse.ArgumentParser(prog="python -m disagg_tools.sim.worker", description=__doc__)
    parser.add_argument("--log-level", default=os.environ.get("DISAGG_ROUTER_LOG_LEVEL", "INFO"))
    add_worker_arguments(parser)
    ns = parser.parse_args(argv)
    logging.basicConfig(
        level=ns.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    run_worker(config_from_args(ns))
    return 0


if __name__ == "__main__":
    sys.exit(main())
