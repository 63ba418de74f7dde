"""The simulated GPU worker: vLLM's OpenAI HTTP API with the NIXL connector in pull mode.

    POST /v1/completions, /v1/chat/completions
        kv_transfer_params.do_remote_decode  -> prefill: queue, KV entry under lease, 1 token
        kv_transfer_params.do_remote_prefill -> decode: pull the KV from P, join the batch, stream
        neither                              -> local prefill, then decode
    GET  /health /v1/models /version /metrics
    POST /sim/kv/pull                          the decode side's KV read (the NIXL stand-in)
    GET|DELETE /sim/requests, GET /sim/state, GET|POST /sim/faults   test hooks

Answers come from `sim.textgen`, so tests can compute what must arrive; timing comes from the
shared cost model through `sim.decode_engine`. A closed connection aborts the request at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Mapping
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from policies.base import blocks_for
from policies.costmodel import perf_model

from . import textgen
from .decode_engine import BlockPool, DecodeEngine, KvLedger, PrefillQueue, Sequence
from .faults import FaultConfig, FaultState, error_body, error_response
from .openai_format import AnswerFormat, malformed_response
from .sim_metrics import SimMetrics
from .worker_config import WorkerConfig, add_worker_arguments, config_from_args

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

RECENT_REQUESTS = 256
DISCONNECT_POLL_S = 0.02
_MISMATCH_REASONS = ("engine_id", "block_ids", "prompt_state")


class _Refusal(Exception):
    """A request answered with an error before any body byte went out."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.response = error_response(status, message, param)


class Worker:
    """Everything one simulated worker holds; one per app, reached through `app[WORKER]`."""

    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        self.perf = perf_model(
            config.model, config.gpu, config.tp_size, block_size=config.block_size
        )
        self.max_model_len = config.max_model_len or self.perf.model.max_model_len
        self.faults = FaultState(config.faults)
        self.pool = BlockPool(config.kv_blocks or self.perf.kv_capacity_blocks)
        self.prefill = PrefillQueue(self.perf, self.time_factor)
        self.metrics = SimMetrics(
            config.model_name,
            running=lambda: self.engine.running + self.prefill.running,
            waiting=lambda: self.prefill.waiting + self.engine.preempted,
            kv_usage=lambda: self.pool.used / self.pool.capacity,
        )
        self.engine = DecodeEngine(
            self.perf, self.pool, self.metrics, self.time_factor, config.block_size
        )
        self.ledger = KvLedger(self.pool, config.engine_id, time.monotonic, self.metrics)
        self.recent: deque[dict[str, Any]] = deque(maxlen=RECENT_REQUESTS)
        self.inflight: dict[asyncio.Task[Any], web.Request] = {}
        self.inflight_changed = asyncio.Event()
        self.session: aiohttp.ClientSession | None = None

    def time_factor(self) -> float:
        """Real seconds per simulated second, including an injected slowdown."""
        return self.faults.slow_factor / self.config.time_scale

    @property
    def lease_s(self) -> float:
        return self.config.kv_lease_s / self.config.time_scale

    def state(self) -> dict[str, Any]:
        self.ledger.reap()
        return {
            "worker_id": self.config.name,
            "role": self.config.role,
            "engine_id": self.config.engine_id,
            "model": self.config.model_name,
            "block_size": self.config.block_size,
            "capacity_blocks": self.pool.capacity,
            "blocks_in_use": self.pool.used,
            "resident_sequences": self.engine.running,
            "preempted_sequences": self.engine.preempted,
            "waiting_prefills": self.prefill.waiting,
            "running_prefills": self.prefill.running,
            "queued_prefill_tokens": self.prefill.queued_tokens,
            "pending_kv": self.ledger.describe(),
            "inflight_requests": len(self.inflight),
            "counters": dict(self.metrics.counts),
            "faults": self.faults.snapshot(),
        }

    def __repr__(self) -> str:
        return f"Worker({self.config.name!r}, {self.pool}, {self.engine}, {self.ledger})"


WORKER = web.AppKey("sim_worker", Worker)


def create_worker_app(config: WorkerConfig) -> web.Application:
    app = web.Application(client_max_size=64 * 1024 * 1024)
    app[WORKER] = Worker(config)
    app.cleanup_ctx.append(_background)
    app.router.add_post("/v1/completions", _handle_generation)
    app.router.add_post("/v1/chat/completions", _handle_generation)
    app.router.add_get("/health", _handle_health)
    app.router.add_get("/v1/models", _handle_models)
    app.router.add_get("/version", _handle_version)
    app.router.add_get("/metrics", _handle_metrics)
    app.router.add_post("/sim/kv/pull", _handle_kv_pull)
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


@contextlib.contextmanager
def _tracked(worker: Worker, request: web.Request) -> Any:
    task = asyncio.current_task()
    assert task is not None
    worker.inflight[task] = request
    worker.inflight_changed.set()
    try:
        yield
    finally:
        worker.inflight.pop(task, None)


# --- generation ----------------------------------------------------------------------------


async def _handle_generation(request: web.Request) -> web.StreamResponse:
    worker = request.app[WORKER]
    with _tracked(worker, request):
        try:
            return await _generation(worker, request)
        except _Refusal as refusal:
            if refusal.response.status == 400:
                worker.metrics.inc("bad_requests")
            return refusal.response


async def _read_json(request: web.Request) -> Any:
    raw = await request.read()
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise _Refusal(400, f"invalid JSON body: {exc}") from exc


async def _generation(worker: Worker, request: web.Request) -> web.StreamResponse:
    path = request.path
    body = await _read_json(request)
    worker.recent.append({"path": path, "headers": dict(request.headers), "body": body})
    if not isinstance(body, dict):
        raise _Refusal(400, "the request body must be a JSON object")
    stream = body.get("stream") is True
    if worker.faults.fire("hang"):
        worker.metrics.inc("faults", label="hang")
        await asyncio.Event().wait()  # until the client goes away and we are cancelled
    injected = worker.faults.roll_error()
    if injected is not None:
        worker.metrics.inc("faults", label=f"error_{injected}")
        if injected == "malformed":
            return malformed_response(stream)
        assert isinstance(injected, int)
        raise _Refusal(injected, f"injected fault: error {injected}")
    mode, kv_params = _mode(worker, body)
    model = body.get("model")
    if model is not None and model != worker.config.model_name:
        raise _Refusal(404, f"The model `{model}` does not exist.", "model")
    try:
        spec = textgen.answer_spec(
            path, body, request.headers, worker.config.mean_output_tokens, worker.max_model_len
        )
    except ValueError as exc:
        raise _Refusal(400, str(exc)) from exc
    request_id = request.headers.get("X-Request-Id") or uuid.uuid4().hex
    fmt = AnswerFormat(path, request_id, worker.config.model_name, spec.prompt_tokens, body)
    worker.metrics.inc("requests", label=mode)
    if mode == "prefill":
        return await _prefill(worker, request, spec, fmt, request_id)
    return await _decode(worker, request, spec, fmt, request_id, kv_params)


def _mode(worker: Worker, body: Mapping[str, Any]) -> tuple[str, dict[str, Any] | None]:
    params = body.get("kv_transfer_params")
    if params is not None and not isinstance(params, dict):
        raise _Refusal(400, "kv_transfer_params must be an object", "kv_transfer_params")
    role = worker.config.role
    if params and params.get("do_remote_decode"):
        if role == "decode":
            raise _Refusal(400, "this is a decode worker: it does not serve remote prefills")
        return "prefill", params
    if role == "prefill":
        raise _Refusal(400, "this is a prefill worker: send kv_transfer_params.do_remote_decode")
    if params and params.get("do_remote_prefill"):
        return "remote_decode", params
    return "local", None


def _take_blocks(worker: Worker, n: int) -> list[int]:
    blocks = worker.pool.take(n)
    if blocks is None:
        worker.metrics.inc("capacity_refusals")
        raise _Refusal(
            503,
            f"KV cache cannot hold this request: needs {n} blocks, "
            f"{worker.pool.free} of {worker.pool.capacity} free",
        )
    return blocks


async def _prefill(
    worker: Worker, request: web.Request, spec: textgen.AnswerSpec, fmt: AnswerFormat, rid: str
) -> web.StreamResponse:
    blocks = _take_blocks(worker, blocks_for(spec.prompt_tokens, worker.config.block_size))
    try:
        if worker.faults.fire("prefill_fail"):
            worker.metrics.inc("faults", label="prefill_fail")
            raise _Refusal(500, "injected fault: prefill failed")
        await worker.prefill.run(spec.prompt_tokens)
        worker.metrics.inc("prompt_tokens", spec.prompt_tokens)
        worker.metrics.inc("prompt_by_source", spec.prompt_tokens, label="local_compute")
        worker.metrics.inc("generation_tokens")
        entry = worker.ledger.add(rid, spec.state, spec.prompt_tokens, blocks, worker.lease_s)
        blocks = []  # the ledger owns them now: freed by a pull or by the lease
    finally:
        worker.pool.give(blocks)
    if worker.faults.fire("prefill_die_after_kv"):
        worker.metrics.inc("faults", label="prefill_die_after_kv")
        return _drop_connection(request)
    tok, finish = next(spec.tokens())
    sockname = request.transport.get_extra_info("sockname") if request.transport else None
    host, port = (
        (sockname[0], sockname[1]) if sockname else (worker.config.host, worker.config.port)
    )
    params = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": worker.config.engine_id,
        "remote_block_ids": list(entry.blocks),
        "remote_request_id": entry.request_id,
        "remote_host": host,
        "remote_port": port,
        "tp_size": worker.perf.tp_size,
    }
    worker.metrics.inc("request_success", label=finish or "length")
    return _json(fmt.full(tok, finish or "length", 1, kv_transfer_params=params))


async def _decode(
    worker: Worker,
    request: web.Request,
    spec: textgen.AnswerSpec,
    fmt: AnswerFormat,
    rid: str,
    kv_params: dict[str, Any] | None,
) -> web.StreamResponse:
    blocks = _take_blocks(worker, worker.engine.admission_blocks(spec.prompt_tokens))
    seq: Sequence | None = None
    try:
        if worker.faults.fire("decode_fail_before_first"):
            worker.metrics.inc("faults", label="decode_fail_before_first")
            raise _Refusal(500, "injected fault: decode failed before the first token")
        if kv_params is not None:
            await _pull_kv(worker, kv_params, spec)
            source = "external_kv_transfer"
        else:
            if worker.faults.fire("prefill_fail"):
                worker.metrics.inc("faults", label="prefill_fail")
                raise _Refusal(500, "injected fault: prefill failed")
            await worker.prefill.run(spec.prompt_tokens)
            source = "local_compute"
        worker.metrics.inc("prompt_tokens", spec.prompt_tokens)
        worker.metrics.inc("prompt_by_source", spec.prompt_tokens, label=source)
        die_after = worker.faults.die_after_tokens()
        seq = Sequence(rid, blocks, spec.prompt_tokens, spec.tokens())
        blocks = []
        worker.engine.join(seq)
        if fmt.stream:
            return await _stream(worker, request, seq, fmt, die_after)
        return await _collect(worker, request, seq, fmt, die_after)
    except asyncio.CancelledError:
        worker.metrics.inc("aborted")
        raise
    finally:
        worker.pool.give(blocks)
        if seq is not None:
            worker.engine.abort(seq)  # no-op once finished; frees the blocks of an aborted one


async def _pull_kv(worker: Worker, params: Mapping[str, Any], spec: textgen.AnswerSpec) -> None:
    host, port = params.get("remote_host"), params.get("remote_port")
    if not isinstance(host, str) or not isinstance(port, int) or isinstance(port, bool):
        raise _Refusal(
            400, "kv_transfer_params needs remote_host and remote_port", "kv_transfer_params"
        )
    payload = {
        "remote_request_id": params.get("remote_request_id"),
        "remote_engine_id": params.get("remote_engine_id"),
        "remote_block_ids": params.get("remote_block_ids"),
        "prompt_state": spec.state,
    }
    assert worker.session is not None
    try:
        async with worker.session.post(
            f"http://{host}:{port}/sim/kv/pull",
            data=orjson.dumps(payload),
            headers={"Content-Type": "application/json"},
        ) as resp:
            status, raw = resp.status, await resp.read()
    except (aiohttp.ClientError, TimeoutError) as exc:
        worker.metrics.inc("kv_pull_failures", label="unreachable")
        raise _Refusal(500, f"KV transfer from {host}:{port} failed: {exc!r}") from exc
    if status == 200:
        worker.metrics.inc("kv_pulled")
        return
    try:
        reason = str(orjson.loads(raw).get("reason", "unknown"))
    except (orjson.JSONDecodeError, AttributeError):
        reason = "unknown"
    if reason in _MISMATCH_REASONS:
        worker.metrics.inc("kv_params_mismatch")
        raise _Refusal(
            400,
            f"kv_transfer_params do not match this request ({reason} differs): crossed or "
            "stale params; real vLLM would decode from the wrong KV",
            "kv_transfer_params",
        )
    worker.metrics.inc("kv_pull_failures", label=reason)
    raise _Refusal(
        400,
        f"KV of remote_request_id {payload['remote_request_id']!r} is not held by "
        f"{host}:{port} ({reason}: expired, already pulled or never prefilled)",
        "kv_transfer_params",
    )


async def _stream(
    worker: Worker, request: web.Request, seq: Sequence, fmt: AnswerFormat, die_after: int | None
) -> web.StreamResponse:
    resp = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    sent = 0
    try:
        while True:
            tok, finish = await seq.out.get()
            if die_after is not None and sent >= die_after:
                worker.metrics.inc("faults", label="decode_die_after_tokens")
                return _drop_connection(request, resp)
            if not resp.prepared:
                # Headers go out with the first token, so errors before it stay plain HTTP errors.
                await resp.prepare(request)
                await resp.write(fmt.role_event())
            sent += 1 if tok else 0
            await resp.write(fmt.events(tok, finish, sent))
            if finish is not None:
                await resp.write_eof()
                return resp
    except ConnectionError:
        # The client went away mid-write: the caller's finally aborts the sequence and frees its
        # blocks; nothing more is written (never an error after body bytes have gone out).
        worker.metrics.inc("aborted")
        return resp


async def _collect(
    worker: Worker, request: web.Request, seq: Sequence, fmt: AnswerFormat, die_after: int | None
) -> web.StreamResponse:
    pieces: list[str] = []
    while True:
        tok, finish = await seq.out.get()
        if die_after is not None and len(pieces) >= die_after:
            worker.metrics.inc("faults", label="decode_die_after_tokens")
            return _drop_connection(request)
        if tok:
            pieces.append(tok)
        if finish is not None:
            return _json(fmt.full("".join(pieces), finish, len(pieces)))


def _drop_connection(
    request: web.Request, resp: web.StreamResponse | None = None
) -> web.StreamResponse:
    """Close the connection without a (complete) response, as a dying GPU process would."""
    if request.transport is not None:
        request.transport.abort()
    # aiohttp's attempt to finish this response meets the closed transport and is dropped.
    return resp if resp is not None else web.Response()


def _json(obj: Any, status: int = 200) -> web.Response:
    return web.Response(status=status, body=orjson.dumps(obj), content_type="application/json")


# --- the KV handoff (prefill side) -------------------------------------------------------------


async def _handle_kv_pull(request: web.Request) -> web.Response:
    """A decode worker reads a prefilled KV: check it is the KV it thinks, then free it."""
    worker = request.app[WORKER]
    try:
        body = orjson.loads(await request.read())
    except orjson.JSONDecodeError:
        return error_response(400, "invalid JSON body")
    if not isinstance(body, dict):
        return error_response(400, "the request body must be a JSON object")
    entry, reason = worker.ledger.claim(
        body.get("remote_request_id"),
        body.get("remote_engine_id"),
        body.get("remote_block_ids"),
        body.get("prompt_state"),
    )
    if entry is None:
        worker.metrics.inc("kv_pull_failures", label=str(reason))
        return _json({**error_body(400, f"KV pull refused: {reason}"), "reason": reason}, 400)
    try:
        # The read holds the prefill's blocks for as long as the bytes take on the wire.
        await asyncio.sleep(worker.perf.transfer_s(entry.prompt_tokens) * worker.time_factor())
    finally:
        worker.pool.give(entry.blocks)
    worker.metrics.inc("kv_pulled")
    return _json({"prompt_tokens": entry.prompt_tokens})


# --- plain endpoints and test hooks --------------------------------------------------------


async def _handle_health(request: web.Request) -> web.Response:
    return web.Response(status=200)


async def _handle_models(request: web.Request) -> web.Response:
    worker = request.app[WORKER]
    card = {
        "id": worker.config.model_name,
        "object": "model",
        "created": int(time.time()),
        "owned_by": "vllm",
        "root": worker.config.model,
        "parent": None,
        "max_model_len": worker.max_model_len,
        "permission": [],
    }
    return _json({"object": "list", "data": [card]})


async def _handle_version(request: web.Request) -> web.Response:
    return _json({"version": "0.0.0-sim"})


async def _handle_metrics(request: web.Request) -> web.Response:
    worker = request.app[WORKER]
    worker.ledger.reap()
    return web.Response(
        body=worker.metrics.render(),
        headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"},
    )


async def _handle_get_requests(request: web.Request) -> web.Response:
    return _json(list(request.app[WORKER].recent))


async def _handle_clear_requests(request: web.Request) -> web.Response:
    request.app[WORKER].recent.clear()
    return web.Response(status=204)


async def _handle_state(request: web.Request) -> web.Response:
    return _json(request.app[WORKER].state())


async def _handle_get_faults(request: web.Request) -> web.Response:
    return _json(request.app[WORKER].faults.snapshot())


async def _handle_set_faults(request: web.Request) -> web.Response:
    worker = request.app[WORKER]
    try:
        config = FaultConfig.from_mapping(orjson.loads(await request.read()))
    except (orjson.JSONDecodeError, ValueError) as exc:
        return error_response(400, f"bad fault config: {exc}")
    worker.faults.replace(config)
    return _json(worker.faults.snapshot())


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
    try:
        import uvloop
    except ImportError:
        loop_factory = None
    else:
        loop_factory = uvloop.new_event_loop
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        runner.run(_serve(config))
