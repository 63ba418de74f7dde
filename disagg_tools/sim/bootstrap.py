"""SGLang PD's KV handoff in the simulated worker: bootstrap rooms and the bootstrap listener.

SGLang sends the same body to the prefill (P) and the decode (D) worker at the same time, each
carrying `bootstrap_host`/`bootstrap_port` (P's bootstrap server) and a `bootstrap_room` id. D
connects to P's bootstrap server and the two meet in that room; P's KV moves to D; only then does
P's own request finish. The sim models exactly that rendezvous:

    P  /generate|/v1/*  prefill -> room.kv := (state, tokens, blocks) -> wait room.taken -> answer
    D  /generate|/v1/*  blocks -> POST P:bootstrap/sim/kv/room {room, prompt_state}
    P:bootstrap         wait room.kv (either side may come first) -> check state -> transfer time
                        -> free P's blocks -> room.taken := done

A mismatched prompt (crossed rooms) is refused with reason "prompt_state" and the room stays, as
the NIXL ledger does; a room nobody pulls within the lease is freed and P answers an error.
The bootstrap server is its own listener (SGLang's is a separate port too), started with the app.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from .faults import error_body
from .rooms import RoomKv, RoomTable
from .worker_state import WORKER, Worker

__all__ = [
    "RoomKv",
    "RoomTable",
    "KvRoomError",
    "bootstrap_params",
    "hold_room",
    "pull_room",
    "bootstrap_listener",
    "wants_listener",
]

ROOM_PATH = "/sim/kv/room"
_BOOTSTRAP_KEYS = ("bootstrap_host", "bootstrap_port", "bootstrap_room")


class KvRoomError(Exception):
    """A room handoff failed; `status` and `counter` (key, label) say how to answer and count it."""

    def __init__(self, status: int, message: str, counter: tuple[str, str | None]) -> None:
        super().__init__(message)
        self.status = status
        self.counter = counter


def bootstrap_params(body: Mapping[str, Any]) -> dict[str, Any] | None:
    """The bootstrap fields of a request, validated; None when it carries no `bootstrap_room`.

    A batch carries arrays; the sim generates one answer per request, so it takes a batch of one.
    Raises ValueError for malformed fields (answered 400).
    """
    if body.get("bootstrap_room") is None:
        return None
    params = {k: body.get(k) for k in _BOOTSTRAP_KEYS}
    for key in _BOOTSTRAP_KEYS:
        value = params[key]
        if isinstance(value, list):
            if len(value) != 1:
                raise ValueError(f"{key}: the simulated worker serves batches of one")
            params[key] = value[0]
    room, host, port = params["bootstrap_room"], params["bootstrap_host"], params["bootstrap_port"]
    if not isinstance(room, int) or isinstance(room, bool) or not 0 <= room < 2**64:
        raise ValueError("bootstrap_room must be a non-negative 64-bit integer")
    if not isinstance(host, str) or not host:
        raise ValueError("bootstrap_host must be a host name")
    if port is not None and (not isinstance(port, int) or isinstance(port, bool)):
        raise ValueError("bootstrap_port must be an integer or null")
    return params


async def hold_room(worker: Worker, room_id: int, kv: RoomKv) -> None:
    """Prefill side: publish the room's KV and wait until a decode worker has taken it.

    The room owns `kv.blocks` from here on: freed by the pull, by the lease, or on cancellation.
    Raises KvRoomError when no decode came within the lease.
    """
    room = worker.rooms.get(room_id)
    if room.kv.done():
        raise KvRoomError(
            400, f"bootstrap_room {room_id} is already in use", ("bad_requests", None)
        )
    room.kv.set_result(kv)
    try:
        await asyncio.wait_for(asyncio.shield(room.taken), worker.lease_s)
    except TimeoutError:
        worker.metrics.inc("kv_expired")
        raise KvRoomError(
            500,
            f"KV transfer of bootstrap_room {room_id} timed out: no decode worker came",
            ("kv_pull_failures", "timeout"),
        ) from None
    finally:
        if not room.taken.done():  # expired or cancelled: the blocks come back here
            worker.pool.give(kv.blocks)
            room.taken.cancel()
        worker.rooms.drop(room_id, room)


async def pull_room(worker: Worker, params: Mapping[str, Any], prompt_state: int) -> None:
    """Decode side: take the room's KV from the prefill's bootstrap server (raises KvRoomError)."""
    host, port, room = params["bootstrap_host"], params["bootstrap_port"], params["bootstrap_room"]
    if port is None:
        raise KvRoomError(
            400,
            "bootstrap_port is null: this decode cannot reach the prefill's bootstrap server",
            ("kv_pull_failures", "no_bootstrap_port"),
        )
    assert worker.session is not None
    payload = orjson.dumps({"bootstrap_room": room, "prompt_state": prompt_state})
    try:
        async with worker.session.post(
            f"http://{host}:{port}{ROOM_PATH}",
            data=payload,
            headers={"Content-Type": "application/json"},
        ) as resp:
            status, raw = resp.status, await resp.read()
    except (aiohttp.ClientError, TimeoutError) as exc:
        raise KvRoomError(
            500,
            f"KV transfer from bootstrap {host}:{port} failed: {exc!r}",
            ("kv_pull_failures", "unreachable"),
        ) from exc
    if status == 200:
        worker.metrics.inc("kv_pulled")
        return
    try:
        reason = str(orjson.loads(raw).get("reason", "unknown"))
    except (orjson.JSONDecodeError, AttributeError):
        reason = "unknown"
    if reason == "prompt_state":
        raise KvRoomError(
            400,
            f"bootstrap_room {room} holds the KV of another prompt: crossed rooms; real SGLang "
            "would decode from the wrong KV",
            ("kv_params_mismatch", None),
        )
    raise KvRoomError(
        400,
        f"bootstrap_room {room} is not served by {host}:{port} ({reason})",
        ("kv_pull_failures", reason),
    )


# --- the bootstrap listener (prefill side) ------------------------------------------------------


async def _handle_room(request: web.Request) -> web.Response:
    worker = request.app[WORKER]
    try:
        body = orjson.loads(await request.read())
        room_id, state = body["bootstrap_room"], body["prompt_state"]
    except (orjson.JSONDecodeError, KeyError, TypeError):
        return _refuse(400, "a room pull needs bootstrap_room and prompt_state", "bad_request")
    room = worker.rooms.get(room_id)
    try:
        kv = await asyncio.wait_for(asyncio.shield(room.kv), worker.lease_s)
    except TimeoutError:
        worker.rooms.drop(room_id, room)
        worker.metrics.inc("kv_pull_failures", label="not_found")
        return _refuse(404, f"bootstrap_room {room_id} was never prefilled here", "not_found")
    if room.taken.done():
        return _refuse(409, f"bootstrap_room {room_id} was already taken", "not_found")
    if kv.prompt_state != state:
        worker.metrics.inc("kv_pull_failures", label="prompt_state")
        return _refuse(400, f"bootstrap_room {room_id} holds another prompt", "prompt_state")
    # Holds P's blocks for as long as the bytes take on the wire, as the NIXL read does.
    await asyncio.sleep(worker.perf.transfer_s(kv.prompt_tokens) * worker.time_factor())
    if room.taken.done():  # P gave up (lease, client gone) while the bytes were moving
        return _refuse(409, f"bootstrap_room {room_id} was abandoned", "not_found")
    worker.pool.give(kv.blocks)
    room.taken.set_result(None)
    return web.Response(
        body=orjson.dumps({"prompt_tokens": kv.prompt_tokens}), content_type="application/json"
    )


def _refuse(status: int, message: str, reason: str) -> web.Response:
    return web.Response(
        status=status,
        body=orjson.dumps({**error_body(status, message), "reason": reason}),
        content_type="application/json",
    )


def wants_listener(worker: Worker) -> bool:
    """Whether this worker serves a bootstrap port: a prefill that has one configured, or, with
    role switch on, any PD worker that has one, as SGLang starts it on every PD instance then so
    one flipped to prefill already has it (it is not rebuilt on a flip; sim.role_switch)."""
    cfg = worker.config
    return cfg.bootstrap_port is not None and (cfg.role_switch or worker.role != "decode")


async def bootstrap_listener(app: web.Application) -> AsyncIterator[None]:
    """cleanup_ctx: serve the bootstrap port of a worker that has one (see `wants_listener`)."""
    worker = app[WORKER]
    port = worker.config.bootstrap_port
    if port is None or not wants_listener(worker):
        yield
        return
    side = web.Application()
    side[WORKER] = worker
    side.router.add_post(ROOM_PATH, _handle_room)
    runner = web.AppRunner(side, handler_cancellation=True, access_log=None, shutdown_timeout=0.5)
    await runner.setup()
    try:
        await web.TCPSite(runner, worker.config.host, port).start()
        worker.bootstrap_port = int(runner.addresses[0][1])
        yield
    finally:
        worker.bootstrap_port = None
        await runner.cleanup()
