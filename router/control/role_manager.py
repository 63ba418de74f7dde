"""The role manager: moves `both` (kv_both) workers between the prefill and the decode pool.

Every `roles.interval_s` each replica reads the roles from the store (so all replicas place
alike) and tries to hold the `roles` lease; the one holding it decides for all:

1. **Finish drains.** A worker switching is first `draining-to-<role>`: in neither pool, so it
   takes no new work of either kind while what it holds finishes. Leaving decode, it is done
   when no replica holds a reservation on it (the store's count, exact across replicas);
   leaving prefill, when no stranded KV is left on it (pulled by its decode, or reaped). Either
   way not before `settle_s`, so every replica has seen the drain (a placement decided before
   it did is then visible in the store). Done: it becomes `<role>` and enters that pool. An
   SGLang engine is switched first (`POST /pd_role_switch`, router/workers/engine_role.py,
   in the background: the rebuild takes seconds), out of both pools meanwhile — the live
   reconfiguration pause; the other replicas read its new role from its /server_info before
   they place on it. An engine that does not serve its recorded role (restarted in its
   start-up role) is switched back the same way. An engine whose switch fails ("restart
   required") gets a `broken` mark in its role record, left draining: out of both pools on every
   replica, and no guard rail or waiting request counts on it (router/workers/rotation.py). An
   operator may switch it back; it stays out until its engine answers a switch to the role
   with SGLang's "ok" (router/workers/engine_role.py: a broken one refuses), which clears the
   mark as it enters that pool.
2. **Decide.** The role policy (the object the simulator runs, policies/role_policies.py) gets a
   `RoleSnapshot` of the live signals (router/workers/role_signals.py) and names the switches to
   start; hysteresis, time in role and the switch cap are the policy's.

Past `drain_deadline_s`, every replica cuts its own decode streams still running on a worker
leaving decode: each resumes on another decode worker with the exact tokens sent so far (the
resume path of a broken stream, router/request/lifecycle.py). A worker leaving prefill has its
stranded KV reaped then. Each change is a compare-and-set on the role's version, so two
replicas (or an operator's `POST /admin/workers/{id}/role` racing the leader) never flip one
worker twice.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web

from policies.base import RolePlan, RolePolicy
from policies.registry import load_role_policy
from router.config import Settings
from router.control.scaling import DemandMeter
from router.metrics import RouterMetrics
from router.workers.accounting import LocalAccounting
from router.workers.engine_role import EngineRoles
from router.workers.membership import Membership
from router.workers.role_signals import (
    QueuePeak,
    ReplicaDemand,
    role_of,
    role_snapshot,
    summed,
)
from router.workers.worker_state import WorkerState
from state.base import ROLE_STATES, StateStore, StoreError, WorkerRole

__all__ = ["ROLES", "RoleChangeRefused", "RoleEvent", "RoleManager"]

log = logging.getLogger(__name__)

LEASE = "roles"


class RoleChangeRefused(Exception):
    """A forced role change that cannot be made (not a `both` worker, or it lost a race)."""


@dataclass(frozen=True, slots=True)
class RoleEvent:
    at_s: float  # unix seconds
    worker_id: str
    from_role: str
    to_role: str
    trigger: str  # policy | operator | drained | deadline | broken
    reason: str

    def as_json(self) -> dict[str, object]:
        return {
            "at": self.at_s,
            "worker": self.worker_id,
            "from": self.from_role,
            "to": self.to_role,
            "trigger": self.trigger,
            "reason": self.reason,
        }


class RoleManager:
    def __init__(
        self,
        settings: Settings,
        store: StateStore,
        session: aiohttp.ClientSession,
        metrics: RouterMetrics,
        demand: DemandMeter,
        members: Membership,
        accounting: LocalAccounting,
        policy: RolePolicy | None = None,
    ) -> None:
        """`settings`: the role snapshot reads the scaling SLOs besides `settings.roles`;
        `demand`: this replica's arrivals (router/control/scaling.py), published for the leader;
        `session`: SGLang engines' role switches go through it."""
        self._snapshot_settings = settings
        self.store = store
        self.metrics = metrics
        self.demand = demand
        self.members = members
        self._accounting = accounting
        s = settings.roles
        self.settings = s
        self.policy: RolePolicy = policy or load_role_policy(s.policy, dict(s.policy_args))
        self.holder = uuid.uuid4().hex  # this replica, as the lease knows it
        self.leader = False
        self.last_plan: RolePlan | None = None
        self.last_decided_s: float | None = None
        self.events: collections.deque[RoleEvent] = collections.deque(maxlen=100)
        self._switch_starts: collections.deque[float] = collections.deque(maxlen=64)
        self._peak = QueuePeak(s.window_s)
        self.replicas_seen = 1  # replicas whose demand the last decision summed
        # Drained workers waiting out their engine kind's reconfiguration pause: id -> when
        # their drain was found complete (this leader's clock; a new leader starts it again).
        self._pausing: dict[str, float] = {}
        self.engines = EngineRoles(session, metrics, s)  # SGLang engines' switches

    def __repr__(self) -> str:
        return f"RoleManager(policy={self.policy.name}, leader={self.leader})"

    # -- the loop -----------------------------------------------------------------------------
    async def run(self) -> None:
        joined = asyncio.Event()
        self.members.on_join(lambda spec: joined.set() if spec.role == "both" else None)
        try:
            while True:
                if not any(True for _ in self.members.both_workers):
                    # Nothing to re-role: no timer at all (an idle replica's wake-ups,
                    # docs/benchmarks-overhead.md "Idle") until a `both` worker joins, however
                    # it joins (configuration, admin API, the registry sync, discovery).
                    joined.clear()
                    await joined.wait()
                    continue
                try:
                    await self.tick()
                except asyncio.CancelledError:
                    raise
                except StoreError as exc:  # the refresher reports the outage
                    log.debug("role manager: store call failed: %s", exc)
                except Exception as exc:  # a bug must not end the loop
                    log.warning("role manager tick failed: %r", exc)
                # With work, its own cadence: `interval_s` after each tick, well within the
                # lease's 3 x `interval_s`, and not in step with the prober's beat (a tick reads
                # an engine switch's answer before a probe reads the role it switched to).
                await asyncio.sleep(self.settings.interval_s)
        finally:
            self.engines.cancel()
            if self.leader:
                await asyncio.shield(self._release_lease())

    async def _release_lease(self) -> None:
        try:
            await self.store.release_lease(LEASE, self.holder)
        except StoreError:
            pass  # it lapses by itself

    async def tick(self) -> None:
        roles = await self.store.worker_roles()
        self.members.apply_roles(roles)
        self._export_roles()
        self._cut_overdue_streams()
        ttl = max(3 * self.settings.interval_s, 1.0)
        own = await self._publish_demand(ttl)
        self.leader = await self.store.hold_lease(LEASE, self.holder, ttl)
        self.metrics.role_leader.set(1 if self.leader else 0)
        if not self.leader:
            return
        await self._finish_drains()
        now = time.time()
        demand = await self._cluster_demand(own, ttl)
        recent = tuple(t for t in self._switch_starts if now - t < 60.0)
        snapshot = role_snapshot(
            self.members.workers.values(), self._snapshot_settings,
            arriving_tokens_per_s=demand.arriving_tokens_per_s, peak=self._peak,
            recent_switches_s=recent, now_s=now, queued_prompt_tokens=demand.queued_prompt_tokens,
        )  # fmt: skip
        plan = self.policy.decide(snapshot)
        self.last_plan, self.last_decided_s = plan, now
        self.metrics.role_pressure.labels(phase="prefill").set(_finite(plan.prefill_pressure))
        self.metrics.role_pressure.labels(phase="decode").set(_finite(plan.decode_pressure))
        self.metrics.role_decisions.labels(note=_note_kind(plan)).inc()
        for switch in plan.switches:
            w = self.members.workers.get(switch.worker_id)
            if w is None or w.spec.role != "both":
                continue
            await self._start(w, switch.to_role, "policy", switch.reason)

    async def _publish_demand(self, max_age_s: float) -> ReplicaDemand:
        """This replica's own demand, written to the store for the leader (every replica, every
        tick: one write). A failed write is not fatal: the leader sums what it has."""
        demand = self.demand
        arriving = sum(demand.arriving_tokens_per_s(m) for m in demand.models())
        own = ReplicaDemand.of(self.members.workers.values(), arriving)
        try:
            await self.store.publish_demand(self.holder, own.encode(), max_age_s)
        except StoreError as exc:
            log.debug("role manager: demand not published: %s", exc)
        return own

    async def _cluster_demand(self, own: ReplicaDemand, max_age_s: float) -> ReplicaDemand:
        """Every replica's demand published within `max_age_s`, summed (this replica's as it is
        now); this replica's own alone when the store cannot be read."""
        try:
            published = await self.store.replica_demands(max_age_s)
        except StoreError as exc:
            log.debug("role manager: deciding on this replica's demand alone: %s", exc)
            published = {}
        others = [
            d
            for replica, payload in published.items()
            if replica != self.holder and (d := ReplicaDemand.decode(payload)) is not None
        ]
        self.replicas_seen = 1 + len(others)
        return summed([own, *others])

    def _export_roles(self) -> None:
        gauge = self.metrics.worker_role
        for w in self.members.both_workers:
            current = w.current_role
            for role in ("both", *ROLE_STATES):
                gauge.labels(worker=w.spec.id, role=role).set(1 if role == current else 0)

    # -- switching ----------------------------------------------------------------------------
    async def force(self, worker_id: str, role: str) -> WorkerRole:
        """An operator's switch of `worker_id` to `role` (prefill | decode): it drains first,
        like the policy's; the lease holder completes it."""
        w = self.members.workers.get(worker_id)
        if w is None:
            raise KeyError(worker_id)
        if w.spec.role != "both":
            raise RoleChangeRefused(
                f"worker {worker_id} was registered as {w.spec.role}; only a `both` "
                "(kv_both) worker can change roles"
            )
        if w.spec.switches_engine_role and not w.engine_can_switch:
            if w.engine_role is None:
                why = "it has not told its role yet (is it up?)"
            elif w.engine_role == "both":
                why = "it is not in PD mode (started without --disaggregation-mode)"
            else:
                why = f"it serves {w.engine_role}, started without --enable-pd-role-switch"
            raise RoleChangeRefused(f"worker {worker_id}'s SGLang engine cannot switch: {why}")
        store = self.store
        known, roles = w.role_state, await store.worker_roles()
        self.members.apply_roles(roles)
        if known is not None and worker_id not in roles:
            # The store has no role for it though this replica knows one: it lost its data
            # and no registry sync has put it back yet. Put it back first, so the operator's
            # change continues the worker's versions instead of starting over at 1 (which a
            # replica's later put-back of a higher version would silently undo).
            await store.restore_registry({}, {worker_id: known})
            self.members.apply_roles(await store.worker_roles())
        current = w.role_state
        if current is not None and current.target == role:
            return current  # already there, or on its way
        record = await self._start(w, role, "operator", f"forced to {role} through the admin API")
        if record is None:
            raise RoleChangeRefused(f"worker {worker_id}'s role changed meanwhile; try again")
        return record

    async def _start(
        self, w: WorkerState, to_role: str, trigger: str, reason: str
    ) -> WorkerRole | None:
        before = w.current_role
        record = await self._set(w, f"draining-to-{to_role}")
        if record is None:
            return None
        self._switch_starts.append(record.since_s)
        self._note(w, before, record.role, trigger, reason)
        switches = self.metrics.role_switches
        switches.labels(worker=w.spec.id, to_role=to_role, trigger=trigger).inc()
        return record

    async def _set(self, w: WorkerState, role: str, broken: str | None = None) -> WorkerRole | None:
        """Compare-and-set `w`'s role; `broken`: its new mark (None: the one it has, kept
        across an operator's or the policy's switch: a broken engine stays out until it has
        proved itself)."""
        current = w.role_state
        expect = current.version if current is not None else 0
        if broken is None:
            broken = current.broken if current is not None else ""
        record = await self.store.set_role(w.spec.id, role, expect, broken)
        if record is None:  # another replica (or the operator) came first: take theirs
            # (or the store lost its roles: ours is kept until the registry sync puts it back)
            self.members.apply_roles(await self.store.worker_roles())
            return None
        w.role_state = record
        return record

    def _note(self, w: WorkerState, before: str, after: str, trigger: str, reason: str) -> None:
        event = RoleEvent(time.time(), w.spec.id, before, after, trigger, reason)
        self.events.append(event)
        log.info("worker %s: %s -> %s (%s: %s)", w.spec.id, before, after, trigger, reason)

    async def _finish_drains(self) -> None:
        now = time.time()
        for w in list(self.members.both_workers):
            record = w.role_state
            if record is None:
                continue
            if not record.draining:  # an engine back in its start-up role is switched again
                self._pausing.pop(w.spec.id, None)
                # (Also once a probe saw the new role while the switch's answer is unread.)
                if (w.engine_behind or self.engines.asking(w)) and w.available:
                    self.engines.serves(w, record.role, self.members.workers.values())
                    await self._note_broken(w)
                continue
            age = now - record.since_s
            if age < self.settings.settle_s:
                continue
            if record.target == "decode":  # leaving prefill: its KV must be gone first
                if age >= self.settings.drain_deadline_s and w.stranded_bytes > 0:
                    await self._reap(w)
                held = w.stranded_bytes > 0 or w.queued_prompt_tokens > 0
            else:  # leaving decode: every replica's reservations on it released
                held = w.reservations > 0 or w.reserved_blocks > 0 or w.resident_seqs > 0
            if held:
                self._pausing.pop(w.spec.id, None)
                continue
            # Drained: out of both pools for its engine kind's reconfiguration pause (timed
            # from here, the policy told the same number), and, for an SGLang engine, until it
            # serves the new role (its switch runs meanwhile).
            emptied = self._pausing.setdefault(w.spec.id, now)
            pause = self.settings.pause_for(w.spec.adapter)
            peers = self.members.workers.values()
            serves = self.engines.serves(w, record.target, peers, broken=bool(record.broken))
            if not serves:
                await self._note_broken(w)
            if not serves or now - emptied < pause:
                continue
            self._pausing.pop(w.spec.id, None)
            before = record.role
            # It serves its role: a broken mark is cleared with the change (it proved itself).
            if await self._set(w, record.target, broken="") is not None:
                self.engines.forget_proof(w)
                why = f"drained after {age:.1f} s"
                why += f", then paused {now - emptied:.1f} s" if pause else ""
                why += f"; its engine proved it serves {record.target}" if record.broken else ""
                self._note(w, before, record.target, "drained", why)

    async def _note_broken(self, w: WorkerState) -> None:
        """An engine switch of `w` came back broken: the mark goes into its role record, for
        every replica, and the record is left draining to the role it was heading for (in
        neither pool, also on a replica that does not read the mark). Written once: the first
        failure's message is the cause; later refusals only repeat "restart required"."""
        message = self.engines.take_broken(w)
        record = w.role_state
        if message is None or record is None or record.broken:
            return
        draining = f"draining-to-{record.target}"
        if await self._set(w, draining, broken=message) is not None:
            self._note(w, record.role, draining, "broken", message)

    async def _reap(self, w: WorkerState) -> None:
        for entry in await self.store.reap_stranded(w.spec.id, 0.0):
            self._accounting.note_stranded(w.spec.id, -entry.nbytes)
            self.metrics.stranded_expired.labels(worker=w.spec.id).inc()
            log.warning(
                "worker %s leaves prefill: stranded KV of %s reaped past the drain deadline",
                w.spec.id,
                entry.request_id,
            )

    def _cut_overdue_streams(self) -> None:
        """This replica's decode streams on a worker still leaving decode past the deadline:
        closed, so each resumes elsewhere with the tokens sent (the draining worker is in no
        pool, so the resume cannot land on it again)."""
        now = time.time()
        for w in self.members.both_workers:
            record = w.role_state
            if record is None or record.role != "draining-to-prefill" or not w.open_streams:
                continue
            if now - record.since_s < self.settings.drain_deadline_s:
                continue
            log.info("worker %s: %d streams past the drain deadline, resuming them elsewhere",
                     w.spec.id, len(w.open_streams))  # fmt: skip
            for resp in list(w.open_streams):
                self.metrics.role_migrations.labels(worker=w.spec.id).inc()
                resp.close()
            w.open_streams.clear()

    # -- the admin view -----------------------------------------------------------------------
    def report(self) -> dict[str, Any]:
        plan = self.last_plan
        workers = []
        for w in self.members.both_workers:
            record = w.role_state
            workers.append(
                {
                    "id": w.spec.id,
                    "role": w.current_role,
                    "serves": role_of(w),
                    # Its engine's failed switch, as the store has it (every replica alike):
                    # out of both pools until it proves it serves its role.
                    "broken": record.broken or None if record else None,
                    "version": record.version if record else 0,
                    "since": record.since_s if record else None,
                    "resident_seqs": w.resident_seqs,
                    "reservations": w.reservations,
                    "stranded_bytes": w.stranded_bytes,
                    **self.engines.report(w),
                }
            )
        return {
            "policy": self.policy.name,
            "leader": self.leader,
            "decided_at": self.last_decided_s,
            "replicas_summed": self.replicas_seen,
            "prefill_pressure": None if plan is None else _finite(plan.prefill_pressure),
            "decode_pressure": None if plan is None else _finite(plan.decode_pressure),
            "note": None if plan is None else plan.note,
            "workers": workers,
            "events": [e.as_json() for e in self.events],
        }


def _finite(x: float) -> float:
    return x if x < 1e9 else 1e9  # an empty pool's pressure is infinite; JSON has no inf


def _note_kind(plan: RolePlan) -> str:
    """A bounded label for the decision: the policy's note with its numbers taken out."""
    if plan.switches:
        return "switch"
    note = plan.note.split(":")[0]
    return "".join(c for c in note if not c.isdigit()).strip()[:60] or "none"


ROLES = web.AppKey("roles", RoleManager)
