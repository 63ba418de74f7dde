"""Generation requests: prefill (NIXL producer), remote decode (consumer), local; the KV pull.

    do_remote_decode  -> _prefill: blocks, FIFO prefill, KV entry under lease, one token + params
    do_remote_prefill -> _decode: blocks for prompt+1, POST P/sim/kv/pull, join batch, stream
    neither           -> _decode with a local prefill (conditional disaggregation)
    a `Dialect`       -> the same, for an endpoint whose body and answer differ (the Responses
                         API: sim.extra_endpoints), translated to a request `textgen` reads
    bootstrap_room    -> SGLang PD (sim.bootstrap): the prefill holds its KV in the room until
                         the decode takes it, then answers; the decode takes it, then streams

Every refusal happens before a body byte goes out, as an OpenAI-style error; once streaming, a
failure only ends the stream. A cancelled handler (client gone) frees its blocks in `finally`.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import Iterator, Mapping
from typing import Any, Protocol

import aiohttp
import orjson
from aiohttp import web

from policies.base import blocks_for

from . import textgen
from .answer_shapes import AnswerShapes, AnswerShapesClass
from .bootstrap import KvRoomError, RoomKv, bootstrap_params, hold_room, pull_room
from .choices import serve_choices
from .decode_engine import Sequence
from .faults import error_body, error_response
from .garbage import garbage_response, silent_after_tokens
from .openai_format import AnswerFormat, malformed_response
from .role_switch import serving_refusal
from .sglang_protocol import SglangFormat
from .worker_state import WORKER, Worker

__all__ = ["Dialect", "handle_generation", "handle_kv_pull", "json_response"]

_MISMATCH_REASONS = ("engine_id", "block_ids", "prompt_state")


class _Refusal(Exception):
    """A request answered with an error before any body byte went out."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.response = error_response(status, message, param)


@contextlib.contextmanager
def _tracked(worker: Worker, request: web.Request) -> Iterator[None]:
    task = asyncio.current_task()
    assert task is not None
    worker.inflight[task] = request
    worker.inflight_changed.set()
    try:
        yield
    finally:
        worker.inflight.pop(task, None)


class Dialect(Protocol):
    """An endpoint generated like chat but spoken in its own shapes (the Responses API): the
    PD protocol (kv_transfer_params in the body, at the top of the answer) is the same."""

    path: str  # the textgen path its requests translate to

    @property
    def format(self) -> AnswerShapesClass:
        """The class of its answer shapes."""
        ...

    def as_request(self, body: dict[str, Any]) -> dict[str, Any]:
        """The body as a request of `path` (ValueError: a 400 with its message)."""
        ...


async def handle_generation(
    request: web.Request, dialect: Dialect | None = None
) -> web.StreamResponse:
    worker = request.app[WORKER]
    with _tracked(worker, request):
        try:
            return await _generation(worker, request, dialect)
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


async def _generation(
    worker: Worker, request: web.Request, dialect: Dialect | None = None
) -> web.StreamResponse:
    path = request.path
    body = await _read_json(request)
    headers = {str(k): v for k, v in request.headers.items()}
    worker.recent.append({"path": path, "headers": headers, "body": body})
    if not isinstance(body, dict):
        raise _Refusal(400, "the request body must be a JSON object")
    stream = body.get("stream") is True
    busy = serving_refusal(worker)
    if busy is not None:  # a role switch running, or one that failed (sim.role_switch)
        raise _Refusal(503, busy)
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
    lora = model if isinstance(model, str) and worker.loras.serves(model) else None
    if model is not None and model != worker.config.model_name and lora is None:
        raise _Refusal(404, f"The model `{model}` does not exist.", "model")
    try:
        spec_path, spec_body = (
            (path, body) if dialect is None else (dialect.path, dialect.as_request(body))
        )
        spec = textgen.answer_spec(
            spec_path,
            spec_body,
            request.headers,
            worker.config.mean_output_tokens,
            worker.max_model_len,
        )
    except ValueError as exc:
        raise _Refusal(400, str(exc)) from exc
    request_id = request.headers.get("X-Request-Id") or uuid.uuid4().hex
    fmt_class: AnswerShapesClass = (
        dialect.format
        if dialect is not None
        else SglangFormat
        if path == textgen.SGLANG_PATH
        else AnswerFormat
    )
    fmt = fmt_class(path, request_id, lora or worker.config.model_name, spec.prompt_tokens, body)
    if type(fmt) is AnswerFormat:  # garbage in OpenAI shapes only (not SGLang's, Responses')
        broken = await _broken_answer(worker, request, mode, fmt, spec)
        if broken is not None:
            return broken
    worker.metrics.inc("requests", label=mode)
    if lora is not None:
        await worker.loras.activate(lora)  # its swap-in, when not resident (sim.lora)
    # The prompt's blocks enter the prefix cache once computed or pulled (sim.kv_events).
    cache = worker.kv_events
    ids = cache.prompt_ids(spec_path, spec_body) if cache is not None else None
    if mode == "prefill":
        room = kv_params.get("bootstrap_room") if kv_params else None
        return await _prefill(worker, request, spec, fmt, request_id, room, ids, lora)
    return await _decode(worker, request, spec, fmt, request_id, kv_params, ids, lora)


async def _broken_answer(
    worker: Worker,
    request: web.Request,
    mode: str,
    fmt: AnswerFormat,
    spec: textgen.AnswerSpec,
) -> web.StreamResponse | None:
    """An injected garbage answer (disagg_tools/sim/garbage.py), or a decode that goes silent after
    some
    tokens; None when neither fires for this request."""
    leg = "prefill" if mode == "prefill" else "decode"
    shape = worker.faults.garbage_for(leg, request.path)
    if shape is not None:
        worker.metrics.inc("faults", label=f"garbage_{shape}")
        after = worker.faults.config.garbage_after_tokens
        return await garbage_response(request, shape, fmt, spec, after)
    after_tokens = worker.faults.hang_after() if leg == "decode" else None
    if after_tokens is not None:
        worker.metrics.inc("faults", label="hang_after_tokens")
        return await silent_after_tokens(request, fmt, spec, after_tokens)
    return None


def _mode(worker: Worker, body: Mapping[str, Any]) -> tuple[str, dict[str, Any] | None]:
    role = worker.role  # the role served now, which a role switch may have flipped
    try:
        bootstrap = bootstrap_params(body)
    except ValueError as exc:
        raise _Refusal(400, str(exc), "bootstrap_room") from exc
    if bootstrap is not None and role != "both":  # a worker not in PD mode ignores them, as SGLang
        return ("prefill" if role == "prefill" else "remote_decode"), bootstrap
    params = body.get("kv_transfer_params")
    if params is not None and not isinstance(params, dict):
        raise _Refusal(400, "kv_transfer_params must be an object", "kv_transfer_params")
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
    worker: Worker,
    request: web.Request,
    spec: textgen.AnswerSpec,
    fmt: AnswerShapes,
    rid: str,
    room: int | None = None,
    prompt_ids: list[int] | None = None,
    lora: str | None = None,
) -> web.StreamResponse:
    blocks = _take_blocks(worker, blocks_for(spec.prompt_tokens, worker.config.block_size))
    try:
        if worker.faults.fire("prefill_fail"):
            worker.metrics.inc("faults", label="prefill_fail")
            raise _Refusal(500, "injected fault: prefill failed")
        await worker.prefill.run(spec.prompt_tokens)
        if worker.kv_events is not None and prompt_ids is not None:
            worker.kv_events.store(prompt_ids, worker.loras.event_key(lora))
        worker.metrics.inc("prompt_tokens", spec.prompt_tokens)
        worker.metrics.inc("prompt_by_source", spec.prompt_tokens, label="local_compute")
        worker.metrics.inc("generation_tokens")
        if room is not None:
            kv, blocks = RoomKv(spec.state, spec.prompt_tokens, blocks), []  # the room owns them
            await _hold_room(worker, room, kv)
            return await _one_token(worker, request, spec, fmt)
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
    return json_response(fmt.full(tok, finish or "length", 1, kv_transfer_params=params))


async def _hold_room(worker: Worker, room: int, kv: RoomKv) -> None:
    try:
        await hold_room(worker, room, kv)
    except KvRoomError as exc:
        worker.metrics.inc(exc.counter[0], label=exc.counter[1])
        raise _Refusal(exc.status, str(exc), "bootstrap_room") from exc


async def _one_token(
    worker: Worker, request: web.Request, spec: textgen.AnswerSpec, fmt: AnswerShapes
) -> web.StreamResponse:
    """SGLang's prefill answer (read and dropped by the router): its first token, as asked."""
    tok, finish = next(spec.tokens())
    worker.metrics.inc("request_success", label=finish or "length")
    if not fmt.stream:
        return json_response(fmt.full(tok, finish or "length", 1))
    resp = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    await resp.prepare(request)
    await resp.write(fmt.role_event() + fmt.events(tok, finish or "length", 1))
    await resp.write_eof()
    return resp


async def _decode(
    worker: Worker,
    request: web.Request,
    spec: textgen.AnswerSpec,
    fmt: AnswerShapes,
    rid: str,
    kv_params: dict[str, Any] | None,
    prompt_ids: list[int] | None = None,
    lora: str | None = None,
) -> web.StreamResponse:
    blocks = _take_blocks(worker, worker.engine.admission_blocks(spec.prompt_tokens))
    seq: Sequence | None = None
    others: list[Sequence] = []  # choices 1..n-1 (disagg_tools/sim/choices.py)
    try:
        if fmt.stream and worker.faults.fire("decode_stall_after_headers"):
            worker.metrics.inc("faults", label="decode_stall_after_headers")
            return await _stall_after_headers(request)
        if worker.faults.fire("decode_fail_before_first"):
            worker.metrics.inc("faults", label="decode_fail_before_first")
            raise _Refusal(500, "injected fault: decode failed before the first token")
        if kv_params is not None and "bootstrap_room" in kv_params:
            try:
                await pull_room(worker, kv_params, spec.state)
            except KvRoomError as exc:
                worker.metrics.inc(exc.counter[0], label=exc.counter[1])
                raise _Refusal(exc.status, str(exc), "bootstrap_room") from exc
            source = "external_kv_transfer"
        elif kv_params is not None:
            await _pull_kv(worker, kv_params, spec)
            source = "external_kv_transfer"
        else:
            if worker.faults.fire("prefill_fail"):
                worker.metrics.inc("faults", label="prefill_fail")
                raise _Refusal(500, "injected fault: prefill failed")
            await worker.prefill.run(spec.prompt_tokens)
            source = "local_compute"
        if worker.kv_events is not None and prompt_ids is not None:
            # pulled or computed, the decode side caches it (under its adapter: sim.lora)
            worker.kv_events.store(prompt_ids, worker.loras.event_key(lora))
        worker.metrics.inc("prompt_tokens", spec.prompt_tokens)
        worker.metrics.inc("prompt_by_source", spec.prompt_tokens, label=source)
        die_after = worker.faults.die_after_tokens()
        seq = Sequence(rid, blocks, spec.prompt_tokens, spec.tokens())
        blocks = []
        if spec.n > 1 and isinstance(fmt, AnswerFormat):
            _other_choices(worker, rid, spec, others)
            for s in (seq, *others):
                worker.engine.join(s)
            return await serve_choices(worker, request, [seq, *others], fmt, die_after)
        worker.engine.join(seq)
        if fmt.stream:
            error_after = worker.faults.error_event_after_tokens()
            die_at_end = worker.faults.die_after_last_token()
            return await _stream(worker, request, seq, fmt, die_after, error_after, die_at_end)
        return await _collect(worker, request, seq, fmt, die_after)
    except asyncio.CancelledError:
        worker.metrics.inc("aborted")
        raise
    finally:
        worker.pool.give(blocks)
        for s in [] if seq is None else [seq, *others]:
            worker.engine.abort(s)  # no-op once finished; frees the blocks of an aborted one


def _other_choices(
    worker: Worker, rid: str, spec: textgen.AnswerSpec, into: list[Sequence]
) -> None:
    """Choices 1..n-1, appended to `into` as their blocks are taken (the caller frees them):
    each shares the prompt's full blocks with choice 0 (prefix caching) and holds its own
    copy of the prompt's partial last block."""
    tail = spec.prompt_tokens % worker.config.block_size
    for i in range(1, spec.n):
        blocks = _take_blocks(worker, blocks_for(tail + 1, worker.config.block_size))
        into.append(Sequence(f"{i}_{rid}", blocks, tail, spec.tokens(i)))


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
    worker: Worker,
    request: web.Request,
    seq: Sequence,
    fmt: AnswerShapes,
    die_after: int | None,
    error_after: int | None = None,
    die_at_end: bool = False,
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
                if error_after != 0:
                    await resp.write(fmt.role_event())
            if error_after is not None and sent >= error_after:
                # vLLM's generation error after streaming began: an error event, then [DONE].
                worker.metrics.inc("faults", label="decode_error_event_after_tokens")
                await resp.write(_STREAM_ERROR + b"data: [DONE]\n\n")
                await resp.write_eof()
                return resp
            sent += 1 if tok else 0
            if finish is not None and die_at_end:
                worker.metrics.inc("faults", label="decode_die_after_last_token")
                await resp.write(fmt.events(tok, None, sent))
                return _drop_connection(request, resp)
            await resp.write(fmt.events(tok, finish, sent))
            if finish is not None:
                await resp.write_eof()
                return resp
    except ConnectionError:
        # The client went away mid-write: the caller's finally aborts the sequence and frees its
        # blocks; nothing more is written (never an error after body bytes have gone out).
        worker.metrics.inc("aborted")
        return resp


# vLLM's generation error in a stream (GenerationError: "Internal server error", code 500).
_STREAM_ERROR = b"data: " + orjson.dumps(error_body(500, "Internal server error")) + b"\n\n"


async def _stall_after_headers(request: web.Request) -> web.StreamResponse:
    """Headers out, then silence until the client goes away (vLLM waiting on a lost KV pull)."""
    resp = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    await resp.prepare(request)
    await asyncio.Event().wait()  # cancelled when the client disconnects
    return resp  # pragma: no cover - never reached


async def _collect(
    worker: Worker,
    request: web.Request,
    seq: Sequence,
    fmt: AnswerShapes,
    die_after: int | None,
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
            return json_response(fmt.full("".join(pieces), finish, len(pieces)))


def _drop_connection(
    request: web.Request, resp: web.StreamResponse | None = None
) -> web.StreamResponse:
    """Close the connection without a (complete) response, as a dying GPU process would."""
    if request.transport is not None:
        request.transport.abort()
    # aiohttp's attempt to finish this response meets the closed transport and is dropped.
    return resp if resp is not None else web.Response()


def json_response(obj: Any, status: int = 200) -> web.Response:
    return web.Response(status=status, body=orjson.dumps(obj), content_type="application/json")


# --- the KV handoff (prefill side) -------------------------------------------------------------


async def handle_kv_pull(request: web.Request) -> web.Response:
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
        return json_response(
            {**error_body(400, f"KV pull refused: {reason}"), "reason": reason}, 400
        )
    try:
        # The read holds the prefill's blocks for as long as the bytes take on the wire.
        await asyncio.sleep(worker.perf.transfer_s(entry.prompt_tokens) * worker.time_factor())
    finally:
        worker.pool.give(entry.blocks)
    worker.metrics.inc("kv_pulled")
    return json_response({"prompt_tokens": entry.prompt_tokens})
