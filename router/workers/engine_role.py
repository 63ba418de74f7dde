"""An SGLang engine's runtime role switch, as the role manager calls it
(router/control/role_manager.py).

SGLang 0.5.23 (sgl-project/sglang PR #28403) flips a PD instance between prefill and decode in
place when it was started with `--enable-pd-role-switch`:

    POST /pd_role_switch {"new_role": "prefill"|"decode"}
      -> 200 {"success": true,  "message": "ok", "old_role", "new_role", "safe_to_restore"}
      -> 400 {"success": false, "message": ..., "safe_to_restore": ...}

What its code does (docs/real-workers.md, "SGLang's runtime role switch"): it drains nothing —
a scheduler that holds any request, queued, running or waiting for KV, refuses with "not idle"
(`safe_to_restore` true: nothing changed) — so the caller drains first, which the role manager
does anyway. A switch to the role already served answers "ok" and changes nothing. While one
switch runs, another is refused. A rebuild that fails half-way leaves the scheduler unhealthy
(`safe_to_restore` false) with `/health` still answering 200: only a restart mends it, so the
router remembers the failure rather than reading it from the health probe. With the flag, the
engine runs its KV bootstrap server in both modes, so its bootstrap port is the same after a flip.

So a broken engine (the role manager writes the mark in its role record, for every replica)
is not believed when its `/server_info` names the role it should serve: it is asked to switch
to that role, and only SGLang's "ok" proves it healthy (a broken scheduler refuses every switch
with "unhealthy ... restart required" before it looks at the role; a healthy one answers a
switch to the role it serves with "ok" and changes nothing).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import aiohttp
import orjson

from router.config import RoleSettings
from router.metrics import RouterMetrics
from router.worker_spec import WorkerSpec
from router.workers.worker_state import WorkerState

__all__ = ["ROLE_SWITCH_PATH", "EngineRoles", "EngineSwitch", "switch_engine_role"]

log = logging.getLogger(__name__)

ROLE_SWITCH_PATH = "/pd_role_switch"

Outcome = Literal["ok", "busy", "broken", "refused", "unreachable"]


@dataclass(frozen=True, slots=True)
class EngineSwitch:
    """What one call came to.

    ok           the engine serves `role` now
    busy         not now, nothing changed (not idle; another switch running): try again later
    broken       the engine says it is unhealthy after a failed rebuild: it needs a restart
    refused      it never will as it runs (flag not set, not in PD mode, role unknown)
    unreachable  no answer (connection, timeout, not SGLang's body): nothing is known
    """

    outcome: Outcome
    message: str

    @property
    def ok(self) -> bool:
        return self.outcome == "ok"


async def switch_engine_role(
    session: aiohttp.ClientSession,
    spec: WorkerSpec,
    role: str,
    timeout_s: float,
    decode_graphs: Mapping[str, Any] | None = None,
) -> EngineSwitch:
    """Ask `spec`'s engine to serve `role`; the answer within `timeout_s` (a rebuild takes
    seconds on a GPU: the weights stay, the KV pools and CUDA graphs are made again). To
    decode, `decode_graphs` are the CUDA-graph fields a decode engine reported (SGLang refuses
    to capture graphs without a memory budget; it checks that budget against free memory)."""
    body: dict[str, Any] = {"new_role": role}
    if role == "decode" and decode_graphs:
        body.update(decode_graphs)
    headers = {"Content-Type": "application/json"}
    if spec.api_key:  # SGLang checks its --api-key (or --admin-api-key) on this route too
        headers["Authorization"] = "Bearer " + spec.api_key.reveal()
    try:
        async with session.post(
            spec.url.rstrip("/") + ROLE_SWITCH_PATH,
            data=orjson.dumps(body),
            headers=headers,
            timeout=aiohttp.ClientTimeout(total=timeout_s),
        ) as resp:
            status, raw = resp.status, await resp.read()
    except (aiohttp.ClientError, TimeoutError) as exc:
        return EngineSwitch("unreachable", f"no answer to {ROLE_SWITCH_PATH}: {exc!r}")
    return read_answer(status, raw)


def read_answer(status: int, raw: bytes) -> EngineSwitch:
    """SGLang's answer as an outcome. Its refusals carry `safe_to_restore`: true means the
    instance is as it was; false means it is broken (a failed rebuild) or another switch is
    under way (both say so in the message)."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        body = None
    if not isinstance(body, dict) or "success" not in body:
        if status == 404:
            return EngineSwitch("refused", f"{ROLE_SWITCH_PATH} not found: not SGLang >= 0.5.23")
        return EngineSwitch("unreachable", f"HTTP {status}: {raw[:200]!r}")
    message = str(body.get("message") or "")
    if status == 200 and body.get("success") is True:
        return EngineSwitch("ok", message or "ok")
    lowered = message.lower()
    if "in progress" in lowered or "not idle" in lowered:
        return EngineSwitch("busy", message)
    if body.get("safe_to_restore") is False or "unhealthy" in lowered:
        return EngineSwitch("broken", message)
    return EngineSwitch("refused", message)


class EngineRoles:
    """The SGLang engines' side of the role manager's switches: one call at a time per
    engine, in the background (a rebuild takes seconds; the manager's tick goes on and reads
    the answer at a later one), asked again after a refusal with a backoff."""

    def __init__(
        self, session: aiohttp.ClientSession, metrics: RouterMetrics, settings: RoleSettings
    ) -> None:
        self._session, self._metrics, self._settings = session, metrics, settings
        # Switches under way (worker id -> the role asked, the call), and when a worker whose
        # last one failed may be asked again (monotonic s, failures so far).
        self._calls: dict[str, tuple[str, asyncio.Task[EngineSwitch]]] = {}
        self._backoff: dict[str, tuple[float, int]] = {}
        # What the engines answered since the manager last looked: a switch that left one
        # broken (worker id -> SGLang's message), and the role a broken one proved it serves.
        self._broken_news: dict[str, str] = {}
        self._proven: dict[str, str] = {}

    def __repr__(self) -> str:
        return f"EngineRoles({len(self._calls)} under way)"

    def serves(
        self, w: WorkerState, role: str, peers: Iterable[WorkerState] = (), broken: bool = False
    ) -> bool:
        """Whether `w`'s engine serves `role` (always, but for an SGLang engine). Else a switch
        is asked for in the background, unless one is under way or the last failed recently;
        its answer is read at a later tick. `peers`: the other workers, whose decode CUDA graphs
        an engine that never served decode is given (the same layout's). `broken`: its record
        carries a failed switch's mark: only an "ok" to a switch to `role` proves it serves
        that role, whatever it reports."""
        if not w.spec.switches_engine_role:
            return True
        wid = w.spec.id
        asked = self._calls.get(wid)
        if asked is not None:
            # Its answer first, even when a probe already read the new role: the scheduler
            # reports it before its event loop is re-dispatched for that role.
            asked_role, call = asked
            if not call.done():
                return False
            del self._calls[wid]
            self._answered(w, asked_role, call.result())
        if w.engine_role == role and (not broken or self._proven.get(wid) == role):
            return True
        retry_at, _ = self._backoff.get(wid, (0.0, 0))
        if broken and w.engine_broken is None:
            # Not seen broken by this replica since it came back from failed probes (a new
            # process: health_probe.py clears the local mark) or since this replica leads:
            # the check need not wait out the backoff of the old process's failures.
            retry_at = 0.0
        if time.monotonic() >= retry_at and w.healthy:
            timeout_s = self._settings.engine_switch_timeout_s
            graphs = _graphs_for(w, peers)
            asking = switch_engine_role(self._session, w.spec, role, timeout_s, graphs)
            self._calls[wid] = (role, asyncio.create_task(asking))
            log.info("worker %s: asking its SGLang engine to serve %s", wid, role)
        return False

    def asking(self, w: WorkerState) -> bool:
        """Whether a switch of `w` was asked for and its answer not read yet (done or not). The
        manager must keep calling `serves` until it is read, also once a probe already saw the
        new role: the engine reports it before its answer comes back, and an answer never read
        is a switch never counted and a backoff never cleared."""
        return w.spec.id in self._calls

    def _answered(self, w: WorkerState, role: str, result: EngineSwitch) -> None:
        wid = w.spec.id
        self._metrics.role_engine_switches.labels(
            worker=wid, to_role=role, outcome=result.outcome
        ).inc()
        if result.ok:
            w.engine_role, w.engine_broken = role, None
            # Its facts are read again before it serves (here as on the other replicas): the
            # role it says it serves, and the bootstrap port of an engine restarted meanwhile.
            w.layout_known = False
            self._backoff.pop(wid, None)
            self._broken_news.pop(wid, None)
            self._proven[wid] = role
            log.info("worker %s: its SGLang engine serves %s", wid, role)
            return
        self._proven.pop(wid, None)
        _, failures = self._backoff.get(wid, (0.0, 0))
        if result.outcome == "busy":  # something left to finish on it: the next tick
            delay = self._settings.interval_s
        else:  # broken until restarted, or refusing as it runs: ask again, slowly
            delay = min(60.0, self._settings.interval_s * 2 ** min(failures, 6))
            failures += 1
        if result.outcome == "broken":
            w.engine_broken = result.message
            self._broken_news[wid] = result.message
        self._backoff[wid] = (time.monotonic() + delay, failures)
        level = logging.INFO if result.outcome == "busy" else logging.WARNING
        log.log(level, "worker %s: its SGLang engine did not switch to %s (%s: %s); asking "
                "again in %.1f s", wid, role, result.outcome, result.message, delay)  # fmt: skip

    def take_broken(self, w: WorkerState) -> str | None:
        """SGLang's message if a switch of `w` came back broken since the last call (the
        manager writes it into the role record), else None."""
        return self._broken_news.pop(w.spec.id, None)

    def forget_proof(self, w: WorkerState) -> None:
        """The proof that a broken `w` serves its role is spent (its mark is cleared): a later
        mark needs a new one."""
        self._proven.pop(w.spec.id, None)

    def report(self, w: WorkerState) -> dict[str, Any]:
        if not w.spec.switches_engine_role:
            return {}
        asked = self._calls.get(w.spec.id)
        mark = w.role_state.broken if w.role_state is not None else ""
        return {
            "engine": {
                "serves": w.engine_role,
                "can_switch": w.engine_switchable,
                "switching_to": asked[0] if asked is not None and not asked[1].done() else None,
                # The record's mark (every replica's), else this leader's news not written yet.
                "broken": mark or w.engine_broken or None,
            }
        }

    def cancel(self) -> None:
        """Stop waiting for the answers (the engines finish their switches anyway; whoever
        leads next reads the roles they serve)."""
        for _, call in self._calls.values():
            call.cancel()
        self._calls.clear()


def _graphs_for(w: WorkerState, peers: Iterable[WorkerState]) -> Mapping[str, Any]:
    """The decode CUDA graphs `w` reported when it served decode, else a decode peer's of the
    same layout (the same model on the same hardware captures the same graphs), else none."""
    if w.decode_graphs:
        return w.decode_graphs
    key = w.spec.layout.key
    return next(
        (p.decode_graphs for p in peers if p.decode_graphs and p.spec.layout.key == key), {}
    )
