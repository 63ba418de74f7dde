"""SGLang 0.5.23's runtime PD role switch on the simulated worker: `POST /pd_role_switch`.

    POST /pd_role_switch  {"new_role": "prefill"|"decode", "prepare_only": false,
                           "decode_cuda_graph_bs": ..., "decode_cuda_graph_memory_gb": ...}
                          -> {"success", "message", "old_role", "new_role", "safe_to_restore"}
                             200 when success, else 400

It answers as SGLang's tokenizer manager and scheduler do together (`pd_role_switch`,
`handle_pd_role_switch`), first match wins:

    --enable-pd-role-switch off         400 "... is not set on this server"        safe true
    left unhealthy by a failed switch   400 "instance is unhealthy ..."             safe false
    a switch already running            400 "another role switch is ..."            safe false
    new_role not prefill/decode         400 "invalid new_role='...'"                safe true
    role "both" (SGLang's "null")       400 "instance is not running in PD ..."     safe true
    new_role is the current role        200 "ok" (SGLang's tokenizer manager turns the
                                            scheduler's "already in target role" into "ok")
    anything in flight or held          400 "instance is not idle; drain ..."       safe true
    prepare_only                        200 "ready", nothing changed                safe true
    the flip                            prefix cache cleared, `role_switch_s` simulated
                                        seconds, then `worker.role` is the new role: 200 "ok"
                                        after `role_switch_reply_s` more
    the `role_switch_fail` fault        400 "role switch failed; instance unhealthy, restart
                                        required: injected fault", safe false, no rollback

The CUDA-graph fields are accepted and ignored: the sim has no graphs to capture. SGLang drains
nothing itself (the caller must), which is why "not idle" is a refusal, not a wait.

While a flip runs, and for good after a failed one, generation requests are refused 503
(`serving_refusal`, called by sim.generation). That is the sim's simplification: real SGLang's
scheduler is busy in the rebuild and a request that arrives then waits in its queue; after a
failed rebuild what it does with a request is undefined. Refusing makes a router that sends to
a switching or broken instance visible in tests.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

import orjson
from aiohttp import web

from .faults import error_response
from .sglang_protocol import disaggregation_mode
from .worker_state import WORKER, Worker

__all__ = ["ROLE_SWITCH_PATH", "handle_role_switch", "idle_blockers", "serving_refusal"]

ROLE_SWITCH_PATH = "/pd_role_switch"
PD_ROLES = ("prefill", "decode")

NOT_ENABLED = "--enable-pd-role-switch is not set on this server"
UNHEALTHY = "instance is unhealthy after a failed role switch; restart required"
IN_PROGRESS = "another role switch is already in progress"
NOT_PD = "instance is not running in PD disaggregation mode"
NOT_IDLE = "instance is not idle; drain all requests before switching"
FAILED = "role switch failed; instance unhealthy, restart required: injected fault"

# Flips keep running when the client that asked goes away (SGLang's scheduler finishes what it
# began); holding them here keeps a flip nobody awaits any more from being collected.
_FLIPS: set[asyncio.Task[None]] = set()


@dataclass(frozen=True, slots=True)
class _Answer:
    success: bool
    message: str
    old_role: str
    new_role: str
    safe_to_restore: bool

    def response(self) -> web.Response:
        return web.Response(
            status=200 if self.success else 400,
            body=orjson.dumps(asdict(self)),
            content_type="application/json",
        )


def serving_refusal(worker: Worker) -> str | None:
    """Why a generation request is refused now (answered 503), or None to serve it."""
    if worker.role_switch_unhealthy:
        return f"{UNHEALTHY}: it refuses requests"
    if worker.role_switching:
        return (
            "a PD role switch is in progress; retry when it is done (the sim refuses, where "
            "SGLang would queue the request)"
        )
    return None


def idle_blockers(worker: Worker) -> list[str]:
    """What keeps the worker from being fully idle (SGLang's `is_fully_idle`); empty = idle."""
    worker.ledger.reap()  # expired KV is free, as its lease says
    held = {
        "inflight_requests": len(worker.inflight),
        "resident_sequences": worker.engine.running,
        "preempted_sequences": worker.engine.preempted,
        "waiting_prefills": worker.prefill.waiting,
        "running_prefills": worker.prefill.running,
        "bootstrap_rooms": len(worker.rooms),
        "pending_kv": len(worker.ledger),
        # A KV read in flight (/sim/kv/pull) holds blocks after its ledger entry is gone.
        "blocks_in_use": worker.pool.used,
    }
    return [f"{name}={n}" for name, n in held.items() if n]


async def handle_role_switch(request: web.Request) -> web.Response:
    worker = request.app[WORKER]
    try:
        body = orjson.loads(await request.read())
    except orjson.JSONDecodeError as exc:
        return error_response(400, f"invalid JSON body: {exc}")
    if not isinstance(body, dict):
        return error_response(400, "the request body must be a JSON object")
    answer, outcome = await _switch(worker, body)
    worker.metrics.inc("role_switches", label=outcome)
    return answer.response()


async def _switch(worker: Worker, body: Mapping[str, Any]) -> tuple[_Answer, str]:
    """The answer and its outcome label for `sim:role_switches`."""
    asked = body.get("new_role", "")
    shown = asked if isinstance(asked, str) else str(asked)
    new_role = shown.lower()
    old_role = disaggregation_mode(worker)

    def refuse(message: str, safe: bool, outcome: str) -> tuple[_Answer, str]:
        return _Answer(False, message, old_role, shown, safe), outcome

    if not worker.config.role_switch:
        return refuse(NOT_ENABLED, True, "not_enabled")
    rejection = _rejection(worker, new_role)
    if rejection is not None:
        return refuse(*rejection, "rejected")
    if new_role == old_role:
        # The scheduler says "already in target role"; SGLang's tokenizer manager answers every
        # success that is not a preflight with "ok" (and the scheduler's default safe false).
        return _Answer(True, "ok", old_role, shown, False), "already"
    blockers = idle_blockers(worker)
    if blockers:
        return refuse(NOT_IDLE, True, "not_idle")
    if body.get("prepare_only") is True:
        return _Answer(True, "ready", old_role, shown, True), "ready"
    # From here to the flip there is no await between the idle check and the flag going up, so
    # no request can slip in between: any that arrives later is refused by `serving_refusal`.
    worker.role_switching = True
    flip = asyncio.ensure_future(_flip(worker, new_role))
    _FLIPS.add(flip)
    flip.add_done_callback(_FLIPS.discard)
    await asyncio.shield(flip)
    if worker.role_switch_unhealthy:
        return refuse(FAILED, False, "failed")
    # The new role is already what /server_info reports; the answer may come back later.
    await asyncio.sleep(worker.config.role_switch_reply_s * worker.time_factor())
    return _Answer(True, "ok", old_role, shown, False), "ok"


def _rejection(worker: Worker, new_role: str) -> tuple[str, bool] | None:
    """SGLang's `_reject_reason`, in its order: (message, safe_to_restore), or None."""
    if worker.role_switch_unhealthy:
        return UNHEALTHY, False
    if worker.role_switching:
        return IN_PROGRESS, False
    if new_role not in PD_ROLES:
        return f"invalid new_role={new_role!r}", True
    if worker.role not in PD_ROLES:
        return NOT_PD, True
    return None


async def _flip(worker: Worker, new_role: str) -> None:
    """Teardown, reconfiguration time, rebuild: the role changes only if the rebuild works."""
    try:
        # SGLang resets its radix tree on a flip: the prefix cache (and its KV-event index,
        # told by AllBlocksCleared) starts empty in the new role.
        if worker.kv_events is not None:
            worker.kv_events.clear()
        await asyncio.sleep(worker.config.role_switch_s * worker.time_factor())
        if worker.faults.roll_role_switch_fail():
            # No rollback, as SGLang: the old role is torn down, the new one never came up.
            worker.metrics.inc("faults", label="role_switch_fail")
            worker.role_switch_unhealthy = True
            return
        worker.role = new_role
    finally:
        worker.role_switching = False
