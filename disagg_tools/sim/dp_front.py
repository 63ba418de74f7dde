"""A simulated data-parallel server: `dp_size` independent simulated engines behind one URL.

    front (the URL)  ── rank r ──> rank r's own simulated worker (its own KV pool, decode
                                   engine, prefill queue, KV ledger, faults, KV events)

Which rank serves a request, as the real engines decide it:

    header `X-data-parallel-rank`            vLLM's OpenAI server (an unparsable value: none)
    body `data_parallel_rank`/`routed_dp_rank`  SGLang's
    body `bootstrap_room` (no rank given)    room % dp_size: SGLang's follow_bootstrap_room
    none of these                            round robin, as the engines' own DP balancer would
    a rank out of range                      400, as vLLM's input processor refuses it

Each rank answers from its own address where the handoff names one (a NIXL prefill's
`remote_host`/`remote_port`: the decode pulls from the rank that holds the KV). SGLang's
bootstrap port is the front's: a room pull goes to the rank `bootstrap_room % dp_size` names,
as SGLang's decode looks the prefill rank up. KV events: each rank publishes on the configured
ports + its rank, its batches saying `data_parallel_rank` (vLLM's layout).

What it reports: `/metrics` every rank's samples labelled `engine="<rank>"` (vLLM's per-engine
label), `/v1/loads` a record per rank with its `dp_rank` (SGLang's), `/server_info` rank 0's
with `dp_size`.

Test hooks: GET /sim/state has every rank's state under `ranks`; `?rank=R` sends /sim/faults,
/sim/requests and /sim/state to one rank (POST /sim/faults without it: every rank).
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from .bootstrap import ROOM_PATH
from .faults import error_response
from .worker import create_worker_app
from .worker_config import WorkerConfig
from .worker_state import WORKER, Worker

__all__ = ["DpRanks", "running_dp_worker", "offset_endpoint"]

RANK_HEADER = "X-data-parallel-rank"
_HOP_HEADERS = frozenset(("host", "content-length", "transfer-encoding", "connection"))


def offset_endpoint(endpoint: str | None, rank: int) -> str | None:
    """vLLM's per-rank publisher address: a tcp port + rank (rank 0: unchanged)."""
    if endpoint is None or rank == 0:
        return endpoint
    base, _, port = endpoint.rpartition(":")
    return f"{base}:{int(port) + rank}" if port.isdigit() else f"{endpoint}_dp{rank}"


@dataclass
class DpRanks:
    """The ranks behind one simulated URL."""

    workers: list[Worker]
    urls: list[str]
    session: aiohttp.ClientSession
    bootstrap_port: int | None = None  # the front's SGLang bootstrap port, once bound
    _turn: itertools.count[int] = field(default_factory=itertools.count)

    @property
    def size(self) -> int:
        return len(self.urls)

    def choose(self, headers: Any, body: Any) -> int:
        """The rank that serves a request (module docstring); ValueError out of range."""
        rank: Any = None
        raw = headers.get(RANK_HEADER)
        if raw is not None:
            with contextlib.suppress(ValueError):
                rank = int(raw)
        if rank is None and isinstance(body, dict):
            rank = body.get("routed_dp_rank", body.get("data_parallel_rank"))
            room = body.get("bootstrap_room")
            if rank is None and isinstance(room, int) and not isinstance(room, bool):
                rank = room % self.size
        if rank is None:
            return next(self._turn) % self.size
        if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < self.size:
            raise ValueError(f"data_parallel_rank {rank!r} is out of range [0, {self.size})")
        return rank


DP_RANKS = web.AppKey("sim_dp_ranks", DpRanks)


async def _forward(request: web.Request) -> web.StreamResponse:
    ranks = request.app[DP_RANKS]
    raw = await request.read()
    body: Any = None
    if raw:
        with contextlib.suppress(orjson.JSONDecodeError):
            body = orjson.loads(raw)
    try:
        rank = _hook_rank(request, ranks) if request.path.startswith("/sim/") else None
        if rank is None:
            rank = ranks.choose(request.headers, body)
    except ValueError as exc:
        return error_response(400, str(exc), "data_parallel_rank")
    return await _relay(request, ranks, rank, raw)


def _hook_rank(request: web.Request, ranks: DpRanks) -> int | None:
    raw = request.query.get("rank")
    if raw is None:
        return None
    rank = int(raw)
    if not 0 <= rank < ranks.size:
        raise ValueError(f"rank {rank} is out of range [0, {ranks.size})")
    return rank


async def _relay(request: web.Request, ranks: DpRanks, rank: int, raw: bytes) -> web.StreamResponse:
    headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_HEADERS}
    url = ranks.urls[rank] + request.path_qs
    async with ranks.session.request(request.method, url, data=raw, headers=headers) as up:
        out = web.StreamResponse(
            status=up.status,
            headers={k: v for k, v in up.headers.items() if k.lower() not in _HOP_HEADERS},
        )
        await out.prepare(request)
        try:
            async for chunk in up.content.iter_any():
                await out.write(chunk)
        except aiohttp.ClientPayloadError:  # the rank cut its answer: so does the front
            if request.transport is not None:
                request.transport.close()
            return out
        await out.write_eof()
        return out


async def _every_rank(request: web.Request) -> web.Response:
    """The hooks that speak for all ranks: /sim/state (each under `ranks`), POST /sim/faults
    and DELETE /sim/requests (to each), GET /sim/requests (each tagged with its rank)."""
    ranks = request.app[DP_RANKS]
    if "rank" in request.query:
        return await _forward(request)  # type: ignore[return-value]
    raw = await request.read()
    answers = []
    for url in ranks.urls:
        async with ranks.session.request(request.method, url + request.path, data=raw) as up:
            answers.append((up.status, await up.read()))
    bad = [(s, b) for s, b in answers if s >= 400]
    if bad:
        return web.Response(status=bad[0][0], body=bad[0][1], content_type="application/json")
    if request.method == "DELETE":
        return web.Response(status=204)
    parsed = [orjson.loads(b) for _, b in answers]
    if request.path == "/sim/state":
        out: Any = {"dp_size": ranks.size, "ranks": parsed}
    elif request.path == "/sim/requests":
        out = [{**r, "dp_rank": i} for i, rs in enumerate(parsed) for r in rs]
    else:
        out = parsed
    return web.Response(body=orjson.dumps(out), content_type="application/json")


async def _health(request: web.Request) -> web.Response:
    return web.Response(status=200)


async def _metrics(request: web.Request) -> web.Response:
    """vLLM's /metrics of a DP server: every rank's samples, labelled `engine="<rank>"`."""
    ranks = request.app[DP_RANKS]
    out: list[str] = []
    for rank, worker in enumerate(ranks.workers):
        worker.ledger.reap()
        for line in worker.metrics.render().decode().splitlines():
            if line.startswith("#"):
                if rank == 0:
                    out.append(line)
            elif "{" in line:
                out.append(line.replace("{", f'{{engine="{rank}",', 1))
    return web.Response(text="\n".join(out) + "\n", content_type="text/plain")


async def _loads(request: web.Request) -> web.Response:
    """SGLang's /v1/loads of a DP server: one record per rank."""
    records = []
    for rank, w in enumerate(request.app[DP_RANKS].workers):
        block = w.config.block_size
        records.append(
            {
                "dp_rank": rank,
                "num_running_reqs": w.engine.running + w.prefill.running,
                "num_waiting_reqs": w.prefill.waiting + w.engine.preempted,
                "num_used_tokens": w.pool.used * block,
                "max_total_num_tokens": w.pool.capacity * block,
            }
        )
    return web.Response(body=orjson.dumps({"loads": records}), content_type="application/json")


async def _server_info(request: web.Request) -> web.StreamResponse:
    """SGLang's /server_info of a DP server: rank 0's, with its `dp_size` and the front's
    bootstrap port (the one the decode is sent to: it finds the rank by the room)."""
    ranks = request.app[DP_RANKS]
    async with ranks.session.get(ranks.urls[0] + request.path) as up:
        if up.status != 200:
            return web.Response(status=up.status, body=await up.read())
        info = await up.json(content_type=None)
    info["dp_size"] = ranks.size
    if ranks.bootstrap_port is not None:  # one bootstrap server for the URL: the front's
        info["disaggregation_bootstrap_port"] = ranks.bootstrap_port
    return web.Response(body=orjson.dumps(info), content_type="application/json")


def _front_app(ranks: DpRanks) -> web.Application:
    app = web.Application(client_max_size=64 * 1024 * 1024)
    app[DP_RANKS] = ranks
    app.router.add_get("/health", _health)
    app.router.add_get("/metrics", _metrics)
    app.router.add_get("/metrics/", _metrics)  # as vLLM (router/workers/discovery.py)
    app.router.add_get("/v1/loads", _loads)
    app.router.add_get("/server_info", _server_info)
    app.router.add_get("/get_server_info", _server_info)
    app.router.add_get("/sim/state", _every_rank)
    app.router.add_route("*", "/sim/faults", _every_rank)
    app.router.add_route("*", "/sim/requests", _every_rank)
    app.router.add_route("*", "/{tail:.*}", _forward)
    return app


async def _room(request: web.Request) -> web.StreamResponse:
    """The front's SGLang bootstrap port: a room pull to the rank its room falls on."""
    ranks = request.app[DP_RANKS]
    raw = await request.read()
    try:
        room = orjson.loads(raw)["bootstrap_room"]
        rank = int(room) % ranks.size
    except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
        return error_response(400, "a room pull needs bootstrap_room")
    port = ranks.workers[rank].bootstrap_port
    host = ranks.workers[rank].config.host
    async with ranks.session.post(f"http://{host}:{port}{request.path}", data=raw) as up:
        return web.Response(status=up.status, body=await up.read(), content_type="application/json")


@contextlib.asynccontextmanager
async def _serve(app: web.Application, host: str, port: int) -> AsyncIterator[str]:
    runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=1.0, access_log=None)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port).start()
        bound_host, bound_port = runner.addresses[0][:2]
        yield f"http://{bound_host}:{bound_port}"
    finally:
        await runner.cleanup()


def rank_config(config: WorkerConfig, rank: int) -> WorkerConfig:
    """Rank `rank`'s own simulated engine: its id `<name>@<rank>`, its own ephemeral ports
    (its bootstrap listener too: the front's forwards to it), its KV events on ports + rank."""
    return replace(
        config,
        port=0,
        worker_id=f"{config.name}@{rank}",
        engine_id=f"{config.engine_id}-dp{rank}",
        bootstrap_port=None if config.bootstrap_port is None else 0,
        kv_events_endpoint=offset_endpoint(config.kv_events_endpoint, rank),
        kv_events_replay_endpoint=offset_endpoint(config.kv_events_replay_endpoint, rank),
    )


@contextlib.asynccontextmanager
async def running_dp_worker(config: WorkerConfig, dp_size: int) -> AsyncIterator[str]:
    """Serve `dp_size` simulated engines behind one URL (config.port; 0 = ephemeral); yield it."""
    if not 1 <= dp_size <= 1024:
        raise ValueError("dp_size must be within [1, 1024]")
    async with contextlib.AsyncExitStack() as stack:
        workers, urls = [], []
        for rank in range(dp_size):
            app = create_worker_app(rank_config(config, rank))
            urls.append(await stack.enter_async_context(_serve(app, config.host, 0)))
            worker = app[WORKER]
            if worker.kv_events is not None:
                worker.kv_events.publisher.rank = rank  # its batches say which rank they are
            workers.append(worker)
        session = await stack.enter_async_context(
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None))
        )
        ranks = DpRanks(workers, urls, session)
        if config.bootstrap_port is not None:
            side = web.Application()
            side[DP_RANKS] = ranks
            side.router.add_post(ROOM_PATH, _room)
            side_url = await stack.enter_async_context(
                _serve(side, config.host, config.bootstrap_port)
            )
            ranks.bootstrap_port = int(side_url.rsplit(":", 1)[1])
        yield await stack.enter_async_context(_serve(_front_app(ranks), config.host, config.port))
