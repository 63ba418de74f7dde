"""Discrete-event simulator of a disaggregated cluster behind the router
(docs/design.md §2, §6, §7).

It runs the same `PlacementPolicy` and `OutputLengthEstimator` objects as the live router, on
`ClusterView` snapshots built from its own accounting, and times work with the same `PerfModel`
as the simulated GPU workers, so a policy's ranking here says something about the product.

One request's life in the simulator:

    ARRIVAL ─ estimate ─ place ─ reserve on D ─┬─ prefill FIFO on P ─ KV stranded on P ─ handoff
            └─ rejected: admission queue (FIFO, bounded) ─ room / TTFT deadline ─> 429
    (with a `fairness` policy the queue is in its order, as the router's: fair_queue.py)
    handoff ─ D has room (or on_full="preempt") ─ transfer over the P→D link ─ join D's batch
            └─ on_full="refuse": KV waits stranded on P until D frees blocks
    decode: one event per step per worker advances its whole batch; a sequence that outgrows its
    reservation grows it; where D has no room for the growth the router preempts one of the
    tenant's streams there, which resumes through admission with its tokens re-prefilled
    (`ClusterConfig.preemption`, disagg_tools.simcluster.preemption), or, preemption off, it
    grows past capacity (runs on unreserved blocks); when blocks run out the newest sequence is
    preempted by the engine and later recomputed locally on D, as vLLM does.
    With one fair share for the cluster under vtc, a request starved of room takes it back: the
    router's take-back preempts streams of the tenant most over its share (fair_takeback.py).

Two router modes: `reserve=True` (ours) holds `Candidate.reserve_blocks` on D before prefill;
`reserve=False` (the peers) reserves nothing and gives the policy no output-length estimate, so a
policy's room check covers the prompt only ("place and hope").

Each event carries its handler (`disagg_tools.simcluster.events`): what happens at a time is
pushed as the call that does it, so the run loop pops and calls, in time order.

With `ClusterConfig.elastic` every worker is `kv_both`: a `RolePolicy` moves workers between the
pools, with drain and a reconfiguration pause (`disagg_tools.simcluster.role_switching`).
"""

from __future__ import annotations

import random
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from functools import partial
from typing import Protocol

from disagg_tools.simcluster.config import ClusterConfig, SimWorkerSpec
from disagg_tools.simcluster.events import EventQueue
from disagg_tools.simcluster.fair_queue import FairQueue, actual_cost
from disagg_tools.simcluster.fair_takeback import FAIR_SHARE, FairTakeBack
from disagg_tools.simcluster.feedback import Feedback
from disagg_tools.simcluster.loras import LoraSimConfig, SimLoras
from disagg_tools.simcluster.metrics import GapHistogram, Outcome, RequestRecord, SimResult
from disagg_tools.simcluster.preemption import RouterPreemption
from disagg_tools.simcluster.prefix_facts import PrefixFacts
from disagg_tools.simcluster.replica_queues import ReplicaQueues, Replicas
from disagg_tools.simcluster.role_switching import RoleController, Slot
from disagg_tools.simcluster.workers import DecodeWorker, Job, PrefillWorker, quantize
from policies.base import (
    ClusterView,
    DecodeView,
    FairnessPolicy,
    OutputEstimate,
    OutputLengthEstimator,
    Placement,
    PlacementPolicy,
    RequestInfo,
    RolePolicy,
    Tenant,
    blocks_for,
)
from policies.fairness import VTCFairness, estimate_cost
from policies.tenant_classes import record_keys_of

__all__ = ["TraceLike", "simulate"]


class TraceLike(Protocol):
    """Any request record with these four attributes (e.g.
    `disagg_tools.traces.TraceRequest`)."""

    @property
    def arrival_s(self) -> float: ...
    @property
    def prompt_tokens(self) -> int: ...
    @property
    def output_tokens(self) -> int: ...
    @property
    def prefix_hash_ids(self) -> Sequence[int]: ...


class _Engine:
    def __init__(
        self,
        requests: Sequence[TraceLike],
        config: ClusterConfig,
        policy: PlacementPolicy,
        estimator: OutputLengthEstimator | None,
        seed: int,
        slo_ttft_s: float,
        slo_tpot_s: float,
        rate_scale: float,
        send_hints: bool | None,
        role_policy: RolePolicy | None = None,
        fairness: FairnessPolicy | None = None,
        tenants: Mapping[str, Tenant] | None = None,
        replicas: Replicas | None = None,
        loras: LoraSimConfig | None = None,
    ) -> None:
        if rate_scale <= 0:
            raise ValueError(f"rate_scale must be > 0, got {rate_scale}")
        if fairness is not None and config.elastic:
            raise ValueError("a fairness policy is not simulated on an elastic cluster (yet)")
        self.fair: FairQueue | ReplicaQueues | None = None
        if fairness is not None and replicas is not None and not replicas.shared:
            # Today's router: a queue and counters per replica (replica_queues.py).
            self.fair = ReplicaQueues(
                fairness, tenants or {}, slo_tpot_s, slo_ttft_s, replicas,
                self.push_call, self.drain_queue,
            )  # fmt: skip
        elif fairness is not None:
            self.fair = FairQueue(fairness, tenants or {}, slo_tpot_s, slo_ttft_s)
        self.cfg = config
        self.policy = policy
        self.estimator = estimator if config.reserve else None
        # The true length goes out as `hint_output_tokens` only when asked (a perfect client
        # hint) or for the oracle, which reads it as the truth: online_quantile classes requests
        # by hint bucket, and a truthful hint would quietly turn it into an oracle.
        if send_hints is None:
            send_hints = getattr(estimator, "name", None) == "oracle"
        self.send_hints = send_hints
        self.rng = random.Random(seed)
        self.slo_ttft_s = slo_ttft_s
        self.slo_tpot_s = slo_tpot_s
        cap, lru = config.stranded_cap_bytes, config.prefix_cache_blocks
        if config.affinity is not None:
            lru = 0  # the exact caches of `PrefixFacts` replace the prefill-only LRU
        self.quantum = config.timer_quantum_s

        def prefill_worker(i: int, s: SimWorkerSpec) -> PrefillWorker:
            return PrefillWorker(i, s, config.layout_of(s), cap, lru, config.prefix_block_tokens)

        def decode_worker(i: int, s: SimWorkerSpec) -> DecodeWorker:
            return DecodeWorker(i, s, config.layout_of(s), quantum=self.quantum,
                                step_extra_s=config.step_overhead_s,
                                join_mid_step=config.join_mid_step,
                                can_prefill=config.local_prefill)  # fmt: skip

        self.roles: RoleController | None = None
        if config.elastic:
            # Each worker is one GPU with both personas; only the one of its role is live.
            specs = (*config.prefill, *config.decode)
            self.prefills = [prefill_worker(i, s) for i, s in enumerate(specs)]
            self.decodes = [decode_worker(i, s) for i, s in enumerate(specs)]
            n_p = len(config.prefill)
            self.p_live = self.prefills[:n_p]
            self.d_live = self.decodes[n_p:]
            slots = [
                Slot(i, p, d, "prefill" if i < n_p else "decode")
                for i, (p, d) in enumerate(zip(self.prefills, self.decodes, strict=True))
            ]
            if role_policy is None:
                from policies.role_policies import StaticRoles

                role_policy = StaticRoles()
            self.roles = RoleController(self, role_policy, slots)
        else:
            if role_policy is not None:
                raise ValueError("a role policy needs ClusterConfig(elastic=True)")
            self.prefills = [prefill_worker(i, s) for i, s in enumerate(config.prefill)]
            self.decodes = [decode_worker(i, s) for i, s in enumerate(config.decode)]
            self.p_live = self.prefills
            self.d_live = self.decodes
        self.pmap = {p.wid: p for p in self.prefills}
        self.dmap = {d.wid: d for d in self.decodes}
        # Four events in five are a decode step: each worker's step event is made once, not
        # once per step (the same bound handler and payload every time).
        self.step_event: dict[DecodeWorker, Callable[[], None]] = {
            d: partial(self._step, d) for d in self.decodes
        }
        self.kvbpt = config.kv_bytes_per_token
        self.now = 0.0
        self.events = EventQueue()
        # Exact prefix caches on both pools and the router's knowledge of them (issue 22).
        self.facts: PrefixFacts | None = None
        if config.affinity is not None:
            wids = [p.wid for p in self.prefills] + [d.wid for d in self.decodes]
            self.facts = PrefixFacts(config, wids, self.push_call, lambda: self.now)
            for d in self.decodes:
                d.local_hit = partial(self.facts.local_hit, d.wid)
        # LoRA adapters: one per request, loads before the prefill (simcluster/loras.py).
        self.loras = SimLoras(loras, len(requests)) if loras is not None else None
        self.queue: deque[Job] = deque()
        self.q_live = 0
        self.hist: dict[str, dict[int, int]] = {}
        self.gaps = GapHistogram()
        self.records: list[RequestRecord | None] = [None] * len(requests)
        self.c_forecast = 0
        self.n_learned = 0  # completions recorded in the output-length histograms
        self.feedback: Feedback | None = None
        if self.estimator is not None:
            self.feedback = Feedback(
                self.estimator,
                self.push_call,
                lambda: self.now,
                inflight=config.inflight_feedback,
                margin=config.overrun_margin,
                half_life_s=config.margin_half_life_s,
                max_share=config.margin_max_share,
            )
        # The router's preemption with exact resume (issue 31): only where room is reserved.
        self.preemption: RouterPreemption | None = None
        if config.preemption and config.reserve:
            self.preemption = RouterPreemption(config.preemption_max_per_stream, self._resume)
            for d in self.decodes:
                d.make_room = self.preemption.make_room
        # The cluster's fair share takes room back (issue 33): with one share for the cluster,
        # vtc and the router's preemption, as the router has it (fair_takeback.py).
        self.take_back: FairTakeBack | None = None
        if (
            replicas is not None
            and replicas.shared
            and replicas.take_back is not None
            and isinstance(self.fair, FairQueue)
            and isinstance(self.fair.policy, VTCFairness)
            and self.preemption is not None
        ):
            self.take_back = FairTakeBack(
                replicas.take_back, replicas.count, replicas.place, self.fair, self.decodes,
                config.preemption_max_per_stream, self.push_call, self._take_back,
            )  # fmt: skip
        self.t_last = 0.0  # last request outcome (a stale deadline event may come later)
        self.c_queued = 0
        self.n_done = 0
        self.n_requests = len(requests)
        self.jobs: list[Job] = []
        t0 = min((r.arrival_s for r in requests), default=0.0)
        for i, r in enumerate(requests):
            cap = getattr(r, "max_tokens", None) or config.max_tokens
            out = max(1, min(int(r.output_tokens), cap))
            arrival = (r.arrival_s - t0) / rate_scale
            job = Job(i, arrival, max(1, int(r.prompt_tokens)), out, tuple(r.prefix_hash_ids))
            job.cap = cap
            job.kv_bytes = job.prompt * self.kvbpt
            job.tenant = getattr(r, "tenant", "")
            self.events.at(arrival, self._arrive, job)
        if self.roles is not None and requests:
            self.roles.start()

    # -- hooks for `disagg_tools.simcluster.role_switching.RoleController` and `Feedback` ------
    def push_call(self, t: float, fn: Callable[[], None]) -> None:
        self.events.call_at(t, fn)

    def schedule_step(self, d: DecodeWorker) -> None:
        """D starts stepping: its first step ends one step from now."""
        self.events.call_at(self.now + d.current_step_s, self.step_event[d])

    def start_prefill(self, p: PrefillWorker) -> None:
        self._start_prefill(p)

    def drain_queue(self) -> None:
        self._drain_queue()

    def handoff(self, job: Job) -> None:
        """Hand the job's KV to its decode worker now, or queue the handoff there."""
        d = job.d
        assert d is not None
        need = blocks_for(job.prompt, d.bs)
        if d.capacity - d.used >= need:
            d.allocate(self.now, job, need)
            self._start_transfer(job)
        else:
            job.refusals += 1
            d.handoff_wait.append(job)

    def run(self) -> SimResult:
        wall0 = time.perf_counter()
        n = 0
        for t, _, fire in self.events.drain():
            self.now = t
            n += 1
            fire()
        wall = time.perf_counter() - wall0
        return self._result(n, wall)

    # -- router ----------------------------------------------------------------------------
    def _arrive(self, job: Job) -> None:
        cfg = self.cfg
        info = RequestInfo(
            request_id=str(job.idx),
            model=cfg.model,
            prompt_tokens=job.prompt,
            max_tokens=job.cap,
            prefix_hashes=job.hashes,
            arrival_s=job.arrival,
            slo_ttft_s=self.slo_ttft_s,
            slo_itl_s=None,
            hint_output_tokens=job.out if self.send_hints else None,
            # A named tenant's answers teach its own classes (issue 31), as in the router.
            tenant=job.tenant,
        )
        job.info = info
        if self.roles is not None:
            self.roles.on_arrival(self.now, job)
        self._estimate(job)
        job.deadline = job.arrival + (self.slo_ttft_s if cfg.max_wait_s is None else cfg.max_wait_s)
        fair = self.fair
        if self.take_back is not None:
            self.take_back.arrived(job)
        if fair is not None:
            fair.arrived(job)
            # Under a fair order an arrival queues while anything waits (fair_queue.py).
            if not fair.holds_back(job, self.q_live) and self._admit(job):
                fair.admitted(job)
                return
        elif self.q_live == 0 and self._admit(job):
            return
        if self.q_live >= cfg.queue_limit:
            self._finish(job, "rejected", "admission queue full")
            return
        job.queued = True
        job.queued_at = self.now
        if fair is not None:
            fair.wait(job, self.now)
        else:
            self.queue.append(job)
        if self.take_back is not None:
            self.take_back.waits(job, self.now)
        self.q_live += 1
        self.c_queued += 1
        self.events.at(job.deadline, self._deadline, job)

    def _estimate(self, job: Job) -> None:
        """(Re-)estimate the output length from the histograms as they are now."""
        info = job.info
        assert info is not None
        est = self.estimator
        if job.cuts and job.rest > 0:
            # Taken back for others: the rest of its try's estimate (router/request/reserve.py
            # `rest_estimate`); its answer is recorded where its first estimate said.
            estimate = OutputEstimate(min(job.rest, info.max_tokens), source="taken back")
            job.rest = 0
        elif job.cuts:
            # A preempted stream's continuation: its estimate proved short, so its whole
            # remaining cap is reserved (router/request/lifecycle.py `_after_preemption`); its
            # answer is recorded where its first estimate said.
            job.rest = 0
            estimate = OutputEstimate(reserve_tokens=info.max_tokens, source="preempted")
        elif est is not None:
            keys = est.class_keys(info)
            hist = self.hist
            completed = {k: hist.get(k, {}) for k in keys}
            assert self.feedback is not None
            estimate = est.estimate(info, self.feedback.histograms(completed))
            # Where its answer will count, decided on the counts it was estimated on, as the
            # router does (router/request/reserve.py `estimated`).
            job.record = record_keys_of(est, info, completed, keys)
        else:
            # No reservation, no output awareness: the policy's room check covers the prompt.
            estimate = OutputEstimate(reserve_tokens=1 if not self.cfg.reserve else info.max_tokens)
        job.info = info = replace(info, estimate=estimate)
        # Expected completions use the reserved (upper) quantile, so a room forecast errs late.
        job.est_tokens = info.reserve_output_tokens
        job.est_ver = self._est_version()

    def _est_version(self) -> int:
        """Moves whenever an estimate could: a completion learned, or a live overrun reported."""
        return self.n_learned + (self.feedback.version if self.feedback is not None else 0)

    def _view(self, forecast_at: float | None = None, job: Job | None = None) -> ClusterView:
        cfg = self.cfg
        if forecast_at is None:
            decode = tuple([d.view() for d in self.d_live])
        else:
            decode = tuple([self._forecast(d, forecast_at) for d in self.d_live])
        if self.feedback is not None:
            decode = self.feedback.with_margins(decode, self.now)
        prefill = tuple([p.view() for p in self.p_live])
        if self.facts is not None and job is not None:
            prefill, decode = self.facts.decorate(prefill, decode, job)
        if self.loras is not None and job is not None:
            prefill, decode = self.loras.decorate(prefill, decode, job.idx)
        return ClusterView(
            prefill=prefill,
            decode=decode,
            kv_bytes_per_token=self.kvbpt,
            links=cfg.links,
            default_link_bytes_per_s=cfg.default_link_bytes_per_s,
            link_latency_s=cfg.link_latency_s,
        )

    def _forecast(self, d: DecodeWorker, at: float) -> DecodeView:
        """D as it should look at `at`: reservations expected to finish by then are gone."""
        v = d.view()
        freed = 0
        seqs = d.seqs
        now = self.now
        for j in d.reservations.values():
            # One already past its expected end outran the upper quantile: no forecast for it.
            if now < j.exp_end <= at:
                used = blocks_for(j.ctx0 + d.step - j.s0, d.bs) if j.idx in seqs else j.alloc
                freed += max(j.res, used)
        if not freed:
            return v
        held = max(0, d.held - freed)
        return replace(v, reserved_blocks=held, used_blocks=min(d.used, held))

    def _admit(self, job: Job) -> bool:
        """Place and (in reserve mode) reserve; dispatch to P. False = the policy said no."""
        if job.est_ver != self._est_version():
            # A queued request is re-estimated when the statistics moved: a cold-start
            # max_tokens estimate must not keep blocking the queue's head once we know better.
            self._estimate(job)
        info = job.info
        assert info is not None
        decision = self.policy.place(info, self._view(job=job))
        if isinstance(decision, Placement) and self._take(job, decision, forecast=False):
            return True
        if self.cfg.admission == "predictive" and self.cfg.reserve:
            # Mooncake-style: admit on the room forecast when this prefill should complete.
            wait = min(((p.queued_tokens + job.prompt) / p.rate for p in self.p_live), default=0.0)
            decision = self.policy.place(info, self._view(self.now + wait, job))
            if isinstance(decision, Placement) and self._take(job, decision, forecast=True):
                self.c_forecast += 1
                return True
        return False

    def _take(self, job: Job, decision: Placement, forecast: bool) -> bool:
        cfg = self.cfg
        for cand in decision.candidates:
            d = self.dmap[cand.decode_id]
            p = self.pmap[cand.prefill_id] if cand.prefill_id is not None else None
            if cfg.reserve:
                need = max(cand.reserve_blocks, blocks_for(job.prompt + 1, d.bs))
                if not forecast and d.free_held < need:
                    continue  # the snapshot is ours, so this only happens if a policy ignores room
                d.reserve(self.now, job, need)
                if self.take_back is not None:
                    self.take_back.busy(self.now)
                if self.roles is not None:
                    self.roles.on_reserve(self.now, job, need)
                step = d.step_estimate()
                ttft = cand.predicted_ttft_s or job.prompt / max(1.0, d.rate)
                job.exp_end = self.now + ttft + job.est_tokens * step
            job.placed = cand
            self._dispatch(job, p, d)
            return True
        return False

    def _dispatch(self, job: Job, p: PrefillWorker | None, d: DecodeWorker) -> None:
        job.admitted_at = self.now
        if job.first_admitted < 0:
            job.first_admitted = self.now
        job.d = d
        job.p = p
        if self.cfg.router_overhead_s > 0:
            # The live path's fixed cost (hops, store round trips): the job reaches its prefill
            # worker (or D, for a local prefill) that much later. Its room is already held.
            self.events.at(self.now + self.cfg.router_overhead_s, self._dispatched, job)
            return
        self._dispatched(job)

    def _dispatched(self, job: Job) -> None:
        p, d = job.p, job.d
        assert d is not None
        if self.loras is not None:
            # The router loads the adapter on both sides before the prefill leg.
            wids = [d.wid] if p is None else [p.wid, d.wid]
            wait = self.loras.ready_in(job.idx, wids)
            if wait > 0:
                for wid in self.loras.loading:  # the loads take their engines' time too
                    if p is not None and wid == p.wid:
                        self.loras.occupy(wid, self.now)
                    elif d.stepping:
                        d.extra_s += self.loras.config.load_s
                self.events.at(self.now + wait, self._dispatched, job)
                return
        if p is None:  # conditional disaggregation: D prefills it inside its next step
            job.local = True
            d.waiting.append(job)
            d._view = None
            if d.poll(self.now):
                self.schedule_step(d)
            return
        if self.roles is not None and p not in self.p_live and self.p_live:
            # Its prefill worker started draining while the job was on its way: the next best.
            p = job.p = min(self.p_live, key=lambda w: (w.queued_tokens, w.idx))
        p.enqueue(job)
        if self.facts is not None:
            self.facts.routed(p.wid, job)
        if self.roles is not None:
            self.roles.on_dispatch(self.now)
        self._start_prefill(p)

    def _drain_queue(self) -> None:
        if self.fair is not None:
            self.q_live -= self.fair.drain(self.now, self._admit)
            return
        q = self.queue
        while q:
            job = q[0]
            if not job.queued:
                q.popleft()
                continue
            if not self._admit(job):
                return
            q.popleft()
            job.queued = False
            self.q_live -= 1

    def _deadline(self, job: Job) -> None:
        # `now` before its deadline: the event of an earlier wait (a preempted stream's
        # continuation waits again, with a deadline of its own).
        if job.queued and self.now >= job.deadline:
            job.queued = False
            self.q_live -= 1
            if self.fair is not None:
                self.fair.withdraw(job)
            if job.cuts:  # the client's stream ends with an error frame (the router's)
                self._finish(job, "failed", "preempted, no room to resume in time")
                return
            self._finish(job, "rejected", "no room before the TTFT deadline")

    def _resume(self, job: Job) -> None:
        """A preempted stream's continuation (`RouterPreemption.continuation` made it; its
        charge settled by `_continue`): re-estimated (`_estimate`: the rest of its try's
        estimate after a take-back, else its whole remaining cap), waiting for room at the head
        of the admission queue (the router keeps its ticket, the oldest) until
        `preemption_resume_wait_s` — never refused for a full queue."""
        fair = self.fair
        job.kv_bytes = job.prompt * self.kvbpt
        self._estimate(job)
        job.deadline = self.now + self.cfg.preemption_resume_wait_s
        job.queued = True
        job.queued_at = self.now
        if fair is not None and job.waiting is not None and job.info is not None:
            cost = estimate_cost(job.info, self.slo_tpot_s, self.slo_ttft_s)
            job.waiting = replace(job.waiting, cost=cost)
            fair.wait(job, self.now)
        else:
            self.queue.appendleft(job)
        self.q_live += 1
        self.events.at(job.deadline, self._deadline, job)

    def _take_back(self, job: Job, reason: str) -> None:
        """The take-back stops a running stream now (fair_takeback.py): it resumes exactly, its
        continuation waiting for room like any request of its class, and the room it gave back
        goes to the queue at once (the router's release wakes its waiters)."""
        d = job.d
        assert d is not None and self.preemption is not None
        d.stop(job, self.now)
        if reason == FAIR_SHARE:
            job.cuts_fair_share += 1
        else:
            job.cuts_priority += 1
        # What its try still expected to decode (its reservation's answer less what it
        # produced in it), as the router's `rest_estimate` (router/request/reserve.py).
        assert job.info is not None
        job.rest = job.info.reserve_output_tokens - (job.ctx0 - job.prompt)
        self._continue(job)
        if self.q_live:
            self._drain_queue()

    def _continue(self, job: Job) -> None:
        """A cut stream resumes: first its fairness charge is settled for the try that ended
        — its reservation for the time it held it, the prompt it was prefilled with, as the
        router's release settles it — before `RouterPreemption.continuation` makes the
        continuation (which gives the reservation back and makes the prompt prompt + answer)."""
        fair = self.fair
        if fair is not None and job.charge is not None:
            fair.settle(job, actual_cost(job, self.now, False))
        assert self.preemption is not None
        self.preemption.continuation(job)

    # -- prefill side ------------------------------------------------------------------------
    def _start_prefill(self, p: PrefillWorker) -> None:
        job = p.next_job()
        if job is None:
            return
        if self.facts is not None:
            cached = self.facts.prefill_hit(p.wid, job)
        else:
            cached = p.cached_tokens(job)
        dur = p.perf.prefill_s(job.prompt, cached)
        if self.loras is not None:  # an adapter load running on its engine comes first
            dur += self.loras.busy_for(p.wid, self.now)
        if self.roles is not None:
            self.roles.on_prefill_start(self.now, job, cached)
        if self.cfg.prefill_jitter:
            j = self.cfg.prefill_jitter
            dur *= self.rng.uniform(1.0 - j, 1.0 + j)
        if self.quantum:
            dur = quantize(dur, self.quantum)
        p.busy_s += dur
        self.events.at(self.now + dur, self._prefill_done, p)

    def _prefill_done(self, p: PrefillWorker) -> None:
        job = p.busy
        assert job is not None and job.d is not None
        p.finish(self.now, job)
        if self.facts is not None:
            self.facts.stored(p.wid, job)
        self._start_prefill(p)
        if self.roles is not None:
            self._check_p(p)
        d = job.d
        need = blocks_for(job.prompt, d.bs)
        if need > d.capacity:
            p.release(self.now, job)
            d.cancel(self.now, job)
            self._finish(job, "failed", "prompt larger than the decode worker's KV")
            self._start_prefill(p)
            if self.roles is not None:
                self._check_p(p)
            return
        # Our router never pushes KV at a full D (room was reserved, or admitted on a forecast
        # that has not come true yet): the KV waits on P. The peers follow `on_full`.
        if d.capacity - d.used >= need or (self.cfg.on_full == "preempt" and not self.cfg.reserve):
            d.allocate(self.now, job, need)
            self._start_transfer(job)
        else:
            job.refusals += 1
            d.handoff_wait.append(job)

    def _start_transfer(self, job: Job) -> None:
        p, d = job.p, job.d
        assert p is not None and d is not None
        bw = self.cfg.link_bytes_per_s(p.group, d.group)
        moved = job.kv_bytes
        if self.facts is not None:  # D pulls only the blocks its own cache misses
            moved = self.facts.moved_bytes(d.wid, job, self.kvbpt)
        dur = self.cfg.link_latency_s + moved / bw
        if self.quantum:
            dur = quantize(dur, self.quantum)
        start = self.now
        if self.cfg.link_contention:
            # One transfer at a time out of P's NIC and into D's: it waits for both.
            start = max(start, p.nic_free, d.nic_free)
            p.nic_free = d.nic_free = start + dur
        self.events.at(start + dur, self._transfer_done, job)

    def _transfer_done(self, job: Job) -> None:
        p, d = job.p, job.d
        assert p is not None and d is not None
        p.release(self.now, job)
        if self.facts is not None:
            self.facts.stored(d.wid, job)
        self._start_prefill(p)  # the stranded cap may have held it back
        if self.roles is not None:
            self._check_p(p)
        step = d.step_estimate()
        job.exp_end = self.now + max(1, job.est_tokens) * step
        if d.arrive(self.now, job):
            self.schedule_step(d)
        if self.q_live:
            self._drain_queue()

    # -- decode side -------------------------------------------------------------------------
    def _step(self, d: DecodeWorker) -> None:
        now = self.now
        finished, evicted, failed, handoffs = d.boundary(now, self.gaps.add)
        if self.feedback is not None:
            self.feedback.after_step(d, now)
        if self.roles is not None and d not in self.d_live:
            self.roles.after_boundary(d)
        if d.stepping:
            self.events.call_at(now + d.durs[-1], self.step_event[d])
        for job in finished:
            job.last_t = now
            self._complete(job)
        for job in failed:
            self._finish(job, "failed", "sequence outgrew the decode worker's KV")
        for job in handoffs:
            self._start_transfer(job)
        cut = d.cut_now
        if cut:
            d.cut_now = []
            assert self.preemption is not None
            for job in cut:
                self._continue(job)
        if (finished or evicted or failed or cut) and self.q_live:
            self._drain_queue()

    def _check_p(self, p: PrefillWorker) -> None:
        assert self.roles is not None
        slot = self.roles.p_slot(p)
        if slot is not None and slot.state == "draining":
            self.roles.check(slot)

    def _complete(self, job: Job) -> None:
        if self.roles is not None:
            self.roles.on_complete(self.now, job)
        est = self.estimator
        if est is not None and job.info is not None:
            bucket = est.bucket_of(job.out)
            for key in job.record:
                h = self.hist.setdefault(key, {})
                h[bucket] = h.get(bucket, 0) + 1
            self.n_learned += 1
        self._finish(job, "ok")

    def _finish(self, job: Job, outcome: Outcome, reason: str = "") -> None:
        job.done = True
        if self.feedback is not None:
            self.feedback.ended(job)
        self.n_done += 1
        self.t_last = self.now
        ok = outcome == "ok"
        n = job.out
        block_s = 0.0
        if job.charge is not None and self.fair is not None:
            # Settled before the release's drain picks the next one (router/request/lifecycle.py).
            cost = actual_cost(job, self.now, ok)
            self.fair.settle(job, cost)
            block_s = cost.decode_block_s
        self.records[job.idx] = RequestRecord(
            index=job.idx,
            arrival_s=job.arrival,
            prompt_tokens=job.asked,
            output_tokens=n,
            outcome=outcome,
            ttft_s=job.first_t - job.arrival if ok else -1.0,
            e2e_s=job.last_t - job.arrival if ok else -1.0,
            mean_gap_s=(job.last_t - job.first_t) / (n - 1) if ok and n > 1 else 0.0,
            max_gap_s=job.max_gap,
            queued_s=(job.first_admitted if job.first_admitted >= 0 else job.admitted_at)
            - job.arrival,
            preemptions=job.preemptions,
            router_preemptions=job.cuts,
            fair_share_preemptions=job.cuts_fair_share,
            priority_preemptions=job.cuts_priority,
            redone_tokens=job.redone,
            refusals=job.refusals,
            reason=reason,
            tenant=job.tenant,
            decode_block_s=block_s,
        )
        job.info = None  # keep memory per finished request small

    def _result(self, n_events: int, wall: float) -> SimResult:
        stuck = [i for i, r in enumerate(self.records) if r is None]
        if stuck:
            raise RuntimeError(f"{len(stuck)} requests never finished (first: {stuck[:5]})")
        now = self.now
        for p in self.prefills:
            p._tick(now)
        for d in self.decodes:
            d._tick(now)
        counters: dict[str, float] = {
            "queued": self.c_queued,
            "admitted_on_forecast": self.c_forecast,
            "overrun_grown": sum(d.c_grown for d in self.decodes),
            "overrun_unreserved": sum(d.c_overran for d in self.decodes),
            "handoff_refusals": sum(r.refusals for r in self.records if r is not None),
            "stranded_byte_s": sum(p.area for p in self.prefills),
            "peak_stranded_bytes": max((p.peak_stranded for p in self.prefills), default=0),
            "reserved_unused_block_s": sum(d.area for d in self.decodes),
            "end_reserved_blocks": sum(d.held for d in self.decodes),
            "end_used_blocks": sum(d.used for d in self.decodes),
            "end_stranded_bytes": sum(p.stranded for p in self.prefills),
            "prefill_busy_s": sum(p.busy_s for p in self.prefills),
            # The most any decode worker was held past its capacity (0: never over-committed),
            # and the step boundaries that ended so (the router's forced growth, in effect).
            "steps_held_past_capacity": sum(d.c_past for d in self.decodes),
            "peak_held_past_capacity": max(
                (max(0, d.peak_held - d.capacity) for d in self.decodes), default=0
            ),
        }
        if self.preemption is not None:
            counters["preemption_forced_growth"] = self.preemption.forced
        if self.facts is not None:
            counters.update(self.facts.counters())
        roles = None
        if self.roles is not None:
            roles = self.roles.summary()
            counters["role_switches"] = len(roles["switches"])
            counters["role_migrated"] = roles["migrated"]
            counters["role_retargeted"] = roles["retargeted"]
            if (
                counters["end_reserved_blocks"]
                or counters["end_used_blocks"]
                or counters["end_stranded_bytes"]
            ):
                raise RuntimeError(f"accounting not empty after the run: {counters}")
        records = [r for r in self.records if r is not None]
        return SimResult(
            records=records,
            gaps=self.gaps,
            slo_ttft_s=self.slo_ttft_s,
            slo_tpot_s=self.slo_tpot_s,
            sim_end_s=self.t_last,
            counters=counters,
            events=n_events,
            wall_s=wall,
            roles=roles,
        )


def simulate(
    requests: Sequence[TraceLike],
    config: ClusterConfig,
    policy: PlacementPolicy,
    estimator: OutputLengthEstimator | None = None,
    *,
    seed: int = 0,
    slo_ttft_s: float = 2.0,
    slo_tpot_s: float = 0.1,
    rate_scale: float = 1.0,
    send_hints: bool | None = None,
    role_policy: RolePolicy | None = None,
    fairness: FairnessPolicy | None = None,
    tenants: Mapping[str, Tenant] | None = None,
    replicas: Replicas | None = None,
    loras: LoraSimConfig | None = None,
) -> SimResult:
    """Replay `requests` (arrival times divided by `rate_scale`) through the cluster.

    `policy` and `estimator` are used as given (the caller builds fresh ones per run when they
    keep state, e.g. round-robin's counter). The admission-queue deadline is the TTFT SLO
    (or `ClusterConfig.max_wait_s`).
    `send_hints` puts each request's true output length in `RequestInfo.hint_output_tokens`
    (None = only for an estimator named "oracle"). `role_policy` moves workers between the
    pools of an elastic cluster (`ClusterConfig.elastic`; default there: static).
    `fairness` (a `policies.base.FairnessPolicy`, e.g. `load_fairness("vtc")`) orders the
    admission queue as the router does (disagg_tools.simcluster.fair_queue); each request's
    `tenant` attribute (disagg_tools.simcluster.tenants) names its tenant in `tenants` (one not
    there: weight 1, class 0). Without it the queue is FIFO with head-of-line blocking, as before.
    The TPOT and TTFT SLOs stand for the router's `scaling.itl_slo_s` and `ttft_slo_s` there.
    `replicas` (with `fairness`) splits the admission queue over router replicas as today's
    router has it: a queue and fairness counters per replica, a release waking its own
    replica's waiters first (disagg_tools.simcluster.replica_queues); `shared` is one queue,
    and under vtc room is taken back by preemption as the router does (`replicas.take_back`,
    disagg_tools.simcluster.fair_takeback; counted in the records by reason).
    `loras` gives each request a LoRA adapter and the workers adapters to load
    (disagg_tools.simcluster.loras); its loads are the summary's `lora_loads`.
    """
    engine = _Engine(
        requests,
        config,
        policy,
        estimator,
        seed,
        slo_ttft_s,
        slo_tpot_s,
        rate_scale,
        send_hints,
        role_policy,
        fairness,
        tenants,
        replicas,
        loras,
    )
    result = engine.run()
    if engine.loras is not None:
        result.counters["lora_loads"] = engine.loras.loads
        result.counters["lora_evictions"] = engine.loras.evictions
    return result
