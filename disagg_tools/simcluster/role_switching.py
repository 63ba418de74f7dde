"""Elastic roles in the cluster simulator: `kv_both` workers moved between the pools by a
`RolePolicy` (policies/role_policies.py), with drain and a reconfiguration pause
(docs/elastic-roles.md).

Every elastic worker is one GPU with two personas, a `PrefillWorker` and a `DecodeWorker`, of
which at most one is in its pool's view (the placement policy sees only workers serving its
side). A switch is

    active ─ decide ─> draining ─ empty ─> paused ─ reconfig_pause_s ─> active in the new role

Leaving **decode**: out of the decode view at once, so no new reservation lands on it.
Reservations of requests still in prefill (or refused handoffs waiting on P) move to the live
decode worker with most room, so they never arrive here. Resident sequences finish; past
`drain_deadline_s` those left are resumed elsewhere with the exact tokens (prompt + generated,
recomputed on the new decode worker, as the router's resume re-prefills them), one at a step
boundary, where room exists. Leaving **prefill**: out of the prefill view; prompts queued but
not started go to the live prefill worker with the shortest queue; the one in prefill finishes
and its KV stays stranded until its decode worker has pulled it.

A worker is drained only when its accounting is exactly empty: no reservation, no sequence, no
queue, zero held/used blocks and zero stranded bytes. Anything else at that point is a bug and
raises (`RoleAccountingError`), so the simulator checks itself on every switch.

Demand for the snapshot: prompt tokens arriving per second, smoothed over an exponential window
of `role_window_s` (bias-corrected at the start), less the prefix-cache hit ratio seen by recent
prefills; each prefill worker's tokens/s on the recent mix of prompt lengths (the cost model's
prefill seconds of recent prompts); decode blocks held, and blocks wanted by requests waiting
for room in the admission queue.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from typing import Protocol, TypeVar

from disagg_tools.simcluster.config import ClusterConfig
from disagg_tools.simcluster.metrics import RolesSummary, RoleSwitchLog
from disagg_tools.simcluster.workers import DecodeWorker, Job, PrefillWorker
from policies.base import (
    Role,
    RolePolicy,
    RoleSnapshot,
    RoleState,
    RoleWorkerView,
    blocks_for,
)

__all__ = ["EngineHooks", "RoleController", "RoleAccountingError", "Slot"]


class EngineHooks(Protocol):
    """What the role controller reads and calls of the engine that runs it
    (`disagg_tools.simcluster.engine._Engine`): a protocol, so this module does not import the
    engine that imports it."""

    cfg: ClusterConfig
    now: float
    p_live: list[PrefillWorker]
    d_live: list[DecodeWorker]
    queue: deque[Job]
    q_live: int
    n_done: int
    n_requests: int
    slo_ttft_s: float
    slo_tpot_s: float

    def push_call(self, t: float, fn: Callable[[], None]) -> None: ...

    def schedule_step(self, d: DecodeWorker) -> None: ...

    def start_prefill(self, p: PrefillWorker) -> None: ...

    def drain_queue(self) -> None: ...

    def handoff(self, job: Job) -> None: ...


W = TypeVar("W", PrefillWorker, DecodeWorker)


class RoleAccountingError(RuntimeError):
    """A drained worker still holds something: the simulator's own accounting is wrong."""


class Slot:
    """One kv_both GPU: its two personas and where it is in a switch."""

    __slots__ = ("idx", "wid", "p", "d", "role", "state", "since", "t_drain", "migrate", "n")

    def __init__(self, idx: int, p: PrefillWorker, d: DecodeWorker, role: Role) -> None:
        self.idx = idx
        self.wid = p.wid
        self.p = p
        self.d = d
        self.role: Role = role  # the role served, or the one a switch heads to
        self.state: RoleState = "active"
        self.since = -math.inf  # the initial split was chosen long ago
        self.t_drain = 0.0
        self.migrate = False  # drain deadline passed: resume resident sequences elsewhere
        self.n = 0  # switches started

    def __repr__(self) -> str:
        return f"Slot({self.wid}, {self.role}, {self.state})"


class _Decayed:
    """Exponentially decayed sum; `rate()` is the bias-corrected per-second rate."""

    __slots__ = ("tau", "s", "t")

    def __init__(self, tau: float) -> None:
        self.tau = tau
        self.s = 0.0
        self.t = 0.0

    def add(self, now: float, x: float) -> None:
        self._decay(now)
        self.s += x

    def value(self, now: float) -> float:
        self._decay(now)
        return self.s

    def rate(self, now: float) -> float:
        self._decay(now)
        span = self.tau * (1.0 - math.exp(-now / self.tau)) if now > 0 else 0.0
        return self.s / span if span > 0 else 0.0

    def _decay(self, now: float) -> None:
        if now > self.t:
            self.s *= math.exp(-(now - self.t) / self.tau)
            self.t = now


class RoleController:
    """Runs a role policy inside the engine (`EngineHooks`): ticks, drains, pauses,
    migrations."""

    def __init__(self, engine: EngineHooks, policy: RolePolicy, slots: list[Slot]) -> None:
        cfg = engine.cfg
        self.e = engine
        self.policy = policy
        self.slots = slots
        self.by_p = {id(s.p): s for s in slots}
        self.by_d = {id(s.d): s for s in slots}
        self.pause = cfg.pause_s
        self.deadline = cfg.drain_deadline_s
        self.interval = cfg.role_interval_s
        tau = cfg.role_window_s
        self.arrived = _Decayed(tau)  # prompt tokens arriving
        self.prompt_seen = _Decayed(tau)  # prompt tokens whose prefill started
        self.cached_seen = _Decayed(tau)  # of which prefix-cache hits
        self.ref_s = _Decayed(tau)  # reference prefill seconds of those (uncached) tokens
        self.blocks_in = _Decayed(tau)  # decode blocks reserved
        self.n_in = _Decayed(tau)  # reservations
        self.tokens_in = _Decayed(tau)  # their output estimates (tokens)
        self.n_out = _Decayed(tau)  # completions
        self.life_out = _Decayed(tau)  # their decode lifetimes, seconds
        self.peak_q = 0.0  # decayed peak of the prefill pool's queued prompt tokens
        self.peak_t = 0.0
        self.ref_perf = slots[0].p.perf
        self.ref_rate = self.ref_perf.prefill_tokens_per_s()
        self.starts: list[float] = []  # switch start times (the per-minute cap)
        self.log: list[RoleSwitchLog] = []  # one entry per switch
        self.timeline: list[tuple[float, int, int, float, float]] = []  # t, P, D, p/d pressure
        self.c_migrated = 0
        self.c_retargeted = 0
        self.c_redispatched = 0

    # -- demand ------------------------------------------------------------------------------
    def on_arrival(self, now: float, job: Job) -> None:
        self.arrived.add(now, job.prompt)

    def on_dispatch(self, now: float) -> None:
        q = float(sum(p.queued_tokens for p in self.e.p_live))
        peak = self.peak_q * math.exp(-(now - self.peak_t) / self.arrived.tau)
        self.peak_q, self.peak_t = max(peak, q), now

    def _peak(self, now: float) -> float:
        return self.peak_q * math.exp(-(now - self.peak_t) / self.arrived.tau)

    def on_reserve(self, now: float, job: Job, blocks: int) -> None:
        self.blocks_in.add(now, blocks)
        self.n_in.add(now, 1.0)
        self.tokens_in.add(now, job.est_tokens)

    def on_complete(self, now: float, job: Job) -> None:
        # How long a request holds its decode room when prefill keeps up: its decode time plus
        # its own prefill (not the prefill queue's wait, which is the other pool's problem).
        life = job.last_t - job.first_t + self.ref_perf.prefill_s(job.prompt)
        self.n_out.add(now, 1.0)
        self.life_out.add(now, life)

    def _hold_s(self, now: float) -> float:
        """Mean decode-room holding time of recent completions (0 until there are some)."""
        n = self.n_out.value(now)
        return self.life_out.value(now) / n if n >= 5.0 else 0.0

    def _decode_demand(self, now: float) -> float:
        """Little's law: blocks reserved per second × seconds a request holds them. Until the
        completions have caught up with the reservations of the window (the first to complete
        are the short ones), the lifetime is the output estimate × the current step."""
        rate = self.blocks_in.rate(now)
        if rate <= 0:
            return 0.0
        n = self.n_out.value(now)
        if n >= 5.0 and n >= 0.8 * self.n_in.value(now):
            life = self.life_out.value(now) / n
        else:
            live = self.e.d_live
            step = sum(d.step_estimate() for d in live) / len(live) if live else 0.0
            n_in = self.n_in.value(now)
            life = (self.tokens_in.value(now) / n_in if n_in > 0 else 0.0) * step
        return rate * life

    def on_prefill_start(self, now: float, job: Job, cached: int) -> None:
        self.prompt_seen.add(now, job.prompt)
        self.cached_seen.add(now, cached)
        self.ref_s.add(now, self.ref_perf.prefill_s(job.prompt, cached))

    def _mix_factor(self, now: float) -> float:
        """Recent prompts' tokens/s on the reference worker over its nominal rate (long
        prompts prefill slower per token: attention is quadratic)."""
        seconds = self.ref_s.value(now)
        if seconds <= 0:
            return 1.0
        tokens = self.prompt_seen.value(now) - self.cached_seen.value(now)
        return max(1e-3, tokens / seconds / self.ref_rate)

    def snapshot(self) -> RoleSnapshot:
        e = self.e
        now = e.now
        seen = self.prompt_seen.value(now)
        hit = self.cached_seen.value(now) / seen if seen > 0 else 0.0
        mix = self._mix_factor(now)
        workers = tuple(
            RoleWorkerView(
                worker_id=s.wid,
                role=s.role,
                state=s.state,
                since_s=s.since,
                queued_prompt_tokens=s.p.queued_tokens,
                prefill_tokens_per_s=s.p.rate * mix,
                capacity_blocks=s.d.capacity,
                held_blocks=s.d.held,
                pending_blocks=_pending(s.d),
                resident_seqs=len(s.d.seqs),
                step_base_s=s.d.step_base,
                step_s_per_block=s.d.step_per_block,
            )
            for s in self.slots
        )
        waiting = waiting_tokens = 0
        if e.q_live:
            bs = e.cfg.layout.block_size
            held_back = [j for j in e.queue if j.queued]
            waiting = sum(blocks_for(j.prompt + j.est_tokens, bs) for j in held_back)
            waiting_tokens = sum(j.prompt for j in held_back)
        return RoleSnapshot(
            now_s=now,
            workers=workers,
            prefill_demand_tokens_per_s=self.arrived.rate(now) * (1.0 - hit),
            peak_queued_prompt_tokens=self._peak(now),
            decode_waiting_blocks=waiting,
            decode_waiting_prompt_tokens=waiting_tokens,
            decode_demand_blocks=self._decode_demand(now),
            decode_hold_s=self._hold_s(now),
            slo_ttft_s=e.slo_ttft_s,
            slo_itl_s=e.slo_tpot_s,
            reconfig_pause_s=self.pause,
            recent_switches_s=tuple(t for t in self.starts if t > now - 60.0),
        )

    # -- the tick ----------------------------------------------------------------------------
    def start(self) -> None:
        self.e.push_call(self.interval, self.tick)

    def tick(self) -> None:
        e = self.e
        for slot in self.slots:  # a drain can also end by a cancellation: look every tick
            if slot.state == "draining":
                self.check(slot)
        plan = self.policy.decide(self.snapshot())
        for sw in plan.switches:
            found = next((s for s in self.slots if s.wid == sw.worker_id), None)
            if found is None or found.state != "active" or found.role == sw.to_role:
                continue  # a policy naming a worker it cannot move: ignored, as the router would
            self._begin(found, sw.to_role, sw.reason)
        n_p = sum(1 for s in self.slots if s.role == "prefill" and s.state == "active")
        n_d = sum(1 for s in self.slots if s.role == "decode" and s.state == "active")
        self.timeline.append((e.now, n_p, n_d, plan.prefill_pressure, plan.decode_pressure))
        if e.n_done < e.n_requests:
            e.push_call(e.now + self.interval, self.tick)

    # -- a switch ----------------------------------------------------------------------------
    def _begin(self, slot: Slot, to_role: Role, reason: str) -> None:
        e = self.e
        now = e.now
        leaving = slot.role
        slot.role = to_role
        slot.state = "draining"
        slot.since = now
        slot.t_drain = now
        slot.migrate = False
        slot.n += 1
        self.starts.append(now)
        self.log.append({"t": now, "worker": slot.wid, "from": leaving, "to": to_role,
                         "reason": reason, "drained_t": None, "active_t": None,
                         "migrated": 0})  # fmt: skip
        if leaving == "decode":
            e.d_live.remove(slot.d)
            self._retarget(slot.d)
            if self.deadline is not None:
                e.push_call(now + self.deadline, lambda: self._deadline(slot))
        else:
            e.p_live.remove(slot.p)
            self._redispatch(slot.p)
            slot.p.lru.clear()  # its memory goes to decode KV
        self.check(slot)

    def _deadline(self, slot: Slot) -> None:
        if slot.state == "draining" and slot.role == "prefill":  # still leaving decode
            slot.migrate = True
            self._retarget(slot.d)
            if not slot.d.stepping:
                self._move_waiting(slot.d)
                self.check(slot)

    def check(self, slot: Slot) -> None:
        """Drained? Then verify the accounting is exactly empty and start the pause."""
        if slot.state != "draining":
            return
        if slot.role == "prefill":  # leaving decode
            d = slot.d
            if d.reservations or d.seqs or d.joining or d.waiting or d.handoff_wait:
                return
            if d.held or d.used or d.kv_tokens or d.stepping:
                raise RoleAccountingError(
                    f"{d!r} drained with held={d.held} used={d.used} "
                    f"kv_tokens={d.kv_tokens} stepping={d.stepping}"
                )
        else:
            p = slot.p
            if p.busy is not None or p.queue or p.stranded:
                return
            if p.queued_tokens:
                raise RoleAccountingError(f"{p!r} drained with {p.queued_tokens} queued tokens")
        e = self.e
        slot.state = "paused"
        self.log_of(slot)["drained_t"] = e.now
        e.push_call(e.now + self.pause, lambda: self._ready(slot))

    def _ready(self, slot: Slot) -> None:
        e = self.e
        slot.state = "active"
        self.log_of(slot)["active_t"] = e.now
        if slot.role == "prefill":
            _insert(e.p_live, slot.p, lambda w: w.idx)
        else:
            _insert(e.d_live, slot.d, lambda w: w.idx)
            if e.q_live:
                e.drain_queue()

    def log_of(self, slot: Slot) -> RoleSwitchLog:
        return next(x for x in reversed(self.log) if x["worker"] == slot.wid)

    # -- moving work off a draining worker ----------------------------------------------------
    def _target(self, need: int) -> DecodeWorker | None:
        best: DecodeWorker | None = None
        for d in self.e.d_live:
            if d.free_held >= need and (best is None or d.free_held > best.free_held):
                best = d
        return best

    def _retarget(self, d: DecodeWorker) -> None:
        """Reservations of requests that have not reached `d` yet go to another decode worker."""
        e = self.e
        now = e.now
        for job in list(d.handoff_wait):
            t = self._target(job.res)
            if t is None:
                continue
            d.handoff_wait.remove(job)
            d.cancel(now, job)
            t.reserve(now, job, job.res)
            job.d = t
            self.c_retargeted += 1
            e.handoff(job)
        queued = set(id(j) for j in d.waiting)
        for job in list(d.reservations.values()):
            if job.alloc or job.idx in d.seqs or id(job) in queued:
                continue  # its KV is landing (or it is resident / waiting here)
            t = self._target(job.res)
            if t is None:
                continue
            d.cancel(now, job)
            t.reserve(now, job, job.res)
            job.d = t
            self.c_retargeted += 1
        d._view = None

    def _move_waiting(self, d: DecodeWorker) -> None:
        """Sequences waiting on `d` (preempted or local prefills) go to another decode worker."""
        e = self.e
        now = e.now
        for job in list(d.waiting):
            need = max(job.res, blocks_for(job.ctx0 + 1, d.bs))
            t = self._target(need)
            if t is None:
                continue
            d.waiting.remove(job)
            if job.idx in d.reservations:
                d.cancel(now, job)
            self._resume_on(t, job, need)

    def _resume_on(self, t: DecodeWorker, job: Job, need: int) -> None:
        e = self.e
        t.reserve(e.now, job, need)
        job.d = t
        job.local = True
        t.waiting.append(job)
        t._view = None
        if t.poll(e.now):
            e.schedule_step(t)

    def after_boundary(self, d: DecodeWorker) -> None:
        """A draining decode worker's step ended: past the deadline, resume what it can
        elsewhere (a step boundary is where a sequence can leave a batch), then check."""
        slot = self.by_d[id(d)]
        if slot.migrate:
            moved = 0
            for job in list(d.seqs.values()):
                ctx = job.ctx0 + d.step - job.s0
                need = max(job.res, blocks_for(ctx + 1, d.bs))
                t = self._target(need)
                if t is None:
                    break
                d.take(job, self.e.now)
                self._resume_on(t, job, need)
                moved += 1
            if moved:
                self.c_migrated += moved
                self.log_of(slot)["migrated"] += moved
            self._retarget(d)
            self._move_waiting(d)
        self.check(slot)

    def _redispatch(self, p: PrefillWorker) -> None:
        """Prompts queued on `p` but not started go to the live prefill worker with the
        shortest queue (their reservations on D are unaffected)."""
        e = self.e
        if not e.p_live:
            return
        moved: list[PrefillWorker] = []
        while p.queue:
            job = p.queue.popleft()
            p.queued_tokens -= job.prompt
            t = min(e.p_live, key=lambda w: (w.queued_tokens, w.idx))
            t.enqueue(job)
            job.p = t
            moved.append(t)
            self.c_redispatched += 1
        p._view = None
        for t in moved:
            e.start_prefill(t)

    def p_slot(self, p: PrefillWorker) -> Slot | None:
        return self.by_p.get(id(p))

    def d_slot(self, d: DecodeWorker) -> Slot | None:
        return self.by_d.get(id(d))

    # -- the record --------------------------------------------------------------------------
    def summary(self) -> RolesSummary:
        return {
            "switches": self.log,
            "timeline": self.timeline,
            "migrated": self.c_migrated,
            "retargeted": self.c_retargeted,
            "redispatched": self.c_redispatched,
        }


def _pending(d: DecodeWorker) -> int:
    """Blocks reserved on `d` for requests whose KV has not started to land (in prefill)."""
    n = 0
    seqs = d.seqs
    for j in d.reservations.values():
        if not j.alloc and j.idx not in seqs and not j.local:
            n += j.res
    return n


def _insert(live: list[W], w: W, key: Callable[[W], int]) -> None:
    """Put `w` back into a live list in worker order (views stay in a stable order)."""
    k = key(w)
    i = next((n for n, x in enumerate(live) if key(x) > k), len(live))
    live.insert(i, w)
