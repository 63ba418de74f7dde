"""The simulated workers' state: a prefill FIFO with a stranded-KV ledger, a continuous-batching
decode worker with finite KV blocks. The event loop lives in `disagg_tools.simcluster.engine`;
these classes only
keep accounting straight and say what happened at each decode step boundary.

Decode steps are simulated per worker, not per token: one event ends a step for the whole batch.
To keep a step O(1) in the batch size, per-sequence facts that change every step are derived:

- a sequence that joined at step s0 with context c0 has context c0 + (s - s0) after step s, and
  gets a new KV block at the steps where that context crosses a block boundary, i.e. when
  s ≡ (1 - c0 + s0) mod block_size (its "phase"). Per-phase counters turn "which sequences grow
  a block now" into one list lookup per step;
- its finish step (and the step it outgrows its reservation) is known when it joins, so those go
  into a per-worker heap keyed by step number;
- token gaps of a sequence are the durations of the steps it sat through, kept in a list per
  worker (cleared when the worker idles), so its max gap is a C-level `max` over a slice.

"held" blocks are what the router's accounting holds per sequence: max(reservation, used). With
no reservations (the peers' mode) held equals used.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict, deque
from collections.abc import Callable
from itertools import count

from disagg_tools.simcluster.config import SimWorkerSpec
from policies.base import (
    Candidate,
    Charge,
    DecodeView,
    KVLayout,
    PrefillView,
    RequestInfo,
    WaitingRequest,
    blocks_for,
)
from policies.costmodel import PerfModel

__all__ = ["Job", "PrefillWorker", "DecodeWorker", "quantize"]

_uid = count()  # heap tie-breaker; any unique increasing int will do


class Job:
    """One request in flight. Mutable and slotted: the hot loop touches these a lot."""

    __slots__ = (
        "idx", "arrival", "prompt", "out", "hashes", "info", "est_tokens", "est_ver",
        "deadline", "queued", "queued_at", "admitted_at", "done",
        "p", "d", "res", "alloc", "ctx0", "gen", "s0", "phase", "over", "ver",
        "first_t", "last_t", "max_gap", "preemptions", "refusals", "kv_bytes", "exp_end",
        "local", "tenant", "waiting", "charge", "placed", "cap", "record",
        "asked", "cuts", "redone", "first_admitted", "cuts_fair_share", "cuts_priority",
        "rest",
    )  # fmt: skip

    def __init__(self, idx: int, arrival: float, prompt: int, out: int, hashes: tuple[int, ...]):
        self.idx = idx
        self.arrival = arrival
        self.prompt = prompt
        self.out = out
        self.cap = out  # the client's max_tokens (set by the engine from the request or config)
        self.hashes = hashes
        self.info: RequestInfo | None = None
        # The classes its answer is recorded in, decided at its estimate (policies/
        # tenant_classes.py `record_keys_of`: a tenant feeds the shared ones up to its share).
        self.record: tuple[str, ...] = ()
        self.est_tokens = out
        self.est_ver = -1
        self.deadline = 0.0
        self.queued = False
        self.queued_at = arrival
        self.admitted_at = arrival
        self.done = False
        self.p: PrefillWorker | None = None
        self.d: DecodeWorker | None = None
        self.res = 0  # reserved blocks on d (0 = none)
        self.alloc = 0  # blocks physically allocated on d before the sequence joins its batch
        self.ctx0 = prompt  # context when (re)joining a batch
        self.gen = 0  # tokens generated before the current residency
        self.s0 = 0
        self.phase = 0
        self.over = False  # grows "held" blocks (outgrew its reservation, or none)
        self.ver = 0  # bumped on eviction: stale heap entries are skipped
        self.first_t = -1.0
        self.last_t = -1.0
        self.max_gap = 0.0
        self.preemptions = 0
        self.refusals = 0
        self.kv_bytes = 0
        self.exp_end = 0.0
        self.local = False  # needs a local prefill on d (recompute or conditional disagg.)
        # Who it is for, and what the fairness policy knows of it (disagg_tools.simcluster.
        # fair_queue): its place in line and estimated cost, then what it charged.
        self.tenant = ""
        self.waiting: WaitingRequest | None = None
        self.charge: Charge | None = None
        self.placed: Candidate | None = None  # the candidate it was placed on, at admission
        # Preemption by the router (disagg_tools/simcluster/preemption.py): its prompt as the
        # client sent it (`prompt` becomes prompt + tokens produced for a continuation), how
        # many times it was cut, the prefill tokens redone for it, its first admission.
        self.asked = prompt
        self.cuts = 0
        # Taken back for others: the output tokens its cut try still expected (its
        # continuation reserves them, not its whole cap); 0: not taken back.
        self.rest = 0
        self.redone = 0
        self.first_admitted = -1.0
        # Of its cuts, those that took room back for the fair share or a more urgent class
        # (disagg_tools/simcluster/fair_takeback.py); the rest were its tenant's growths'.
        self.cuts_fair_share = 0
        self.cuts_priority = 0

    def __repr__(self) -> str:
        return f"Job({self.idx}, prompt={self.prompt}, out={self.out}, gen={self.gen})"


class PrefillWorker:
    """FIFO prefill, one prompt at a time; the KV stays "stranded" here until D has pulled it."""

    __slots__ = (
        "idx", "wid", "perf", "group", "layout", "cap", "queue", "busy", "queued_tokens",
        "stranded", "peak_stranded", "area", "last_t", "lru", "lru_cap", "block_tokens",
        "rate", "_view", "busy_s", "nic_free",
    )  # fmt: skip

    def __init__(self, idx: int, spec: SimWorkerSpec, layout: KVLayout, cap: int, lru_cap: int,
                 block_tokens: int) -> None:  # fmt: skip
        self.idx = idx
        self.wid = spec.worker_id
        self.perf: PerfModel = spec.perf
        self.group = spec.group
        self.layout = layout
        self.cap = cap
        self.queue: deque[Job] = deque()
        self.busy: Job | None = None
        self.queued_tokens = 0  # includes the prompt in prefill now
        self.stranded = 0
        self.peak_stranded = 0
        self.area = 0.0  # stranded byte-seconds
        self.last_t = 0.0
        self.lru: OrderedDict[int, None] = OrderedDict()
        self.lru_cap = lru_cap
        self.block_tokens = block_tokens
        self.rate = spec.perf.prefill_tokens_per_s()
        self._view: PrefillView | None = None
        self.busy_s = 0.0
        self.nic_free = 0.0  # when its NIC is free for the next KV transfer (link contention)

    def _tick(self, now: float) -> None:
        self.area += self.stranded * (now - self.last_t)
        self.last_t = now

    def enqueue(self, job: Job) -> None:
        self.queue.append(job)
        self.queued_tokens += job.prompt
        self._view = None

    def next_job(self) -> Job | None:
        """The job to start now, or None if busy, idle, or held back by the stranded cap."""
        if self.busy is not None or not self.queue:
            return None
        head = self.queue[0]
        if self.cap > 0 and self.stranded > 0 and self.stranded + head.kv_bytes > self.cap:
            return None
        self.busy = self.queue.popleft()
        return self.busy

    def cached_tokens(self, job: Job) -> int:
        """Prefix-cache hit on the job's leading hash ids; records them as recently used."""
        if self.lru_cap <= 0 or not job.hashes:
            return 0
        lru = self.lru
        hits = 0
        for h in job.hashes:
            if h not in lru:
                break
            hits += 1
        for h in job.hashes:
            lru[h] = None
            lru.move_to_end(h)
        while len(lru) > self.lru_cap:
            lru.popitem(last=False)
        self._view = None
        # The last prompt token is always computed (it yields the logits), as vLLM does.
        return min(hits * self.block_tokens, job.prompt - 1)

    def finish(self, now: float, job: Job) -> None:
        self._tick(now)
        self.busy = None
        self.queued_tokens -= job.prompt
        self.stranded += job.kv_bytes
        self.peak_stranded = max(self.peak_stranded, self.stranded)
        self._view = None

    def release(self, now: float, job: Job) -> None:
        self._tick(now)
        self.stranded -= job.kv_bytes
        self._view = None

    def view(self) -> PrefillView:
        v = self._view
        if v is None:
            v = self._view = PrefillView(
                worker_id=self.wid,
                layout=self.layout,
                group=self.group,
                queued_prompt_tokens=self.queued_tokens,
                inflight=len(self.queue) + (self.busy is not None),
                prefill_tokens_per_s=self.rate,
                stranded_bytes=self.stranded,
                stranded_cap_bytes=self.cap,
                recent_prefixes=frozenset(self.lru) if self.lru_cap else frozenset(),
            )
        return v

    def __repr__(self) -> str:
        return f"PrefillWorker({self.wid}, queued={self.queued_tokens}, stranded={self.stranded})"


def quantize(dur: float, quantum: float) -> float:
    """`dur` as a timer of granularity `quantum` runs it: a whole number of quanta, rounded half
    to even (uvloop's `call_later` rounds its delay to whole milliseconds the same way)."""
    return round(dur / quantum) * quantum


def _with_live_costs(
    step_s: Callable[[int, int], float], quantum: float, extra: float
) -> Callable[[int, int], float]:
    """A step as the live simulated worker runs it: its sleep rounded to the timer's quantum,
    then `extra` of event-loop work and overshoot (ClusterConfig.timer_quantum_s,
    step_overhead_s)."""
    if quantum:

        def live(kv_tokens: int, batch: int) -> float:
            return quantize(step_s(kv_tokens, batch), quantum) + extra

    else:

        def live(kv_tokens: int, batch: int) -> float:
            return step_s(kv_tokens, batch) + extra

    return live


def _step_time_fn(perf: PerfModel) -> Callable[[int, int], float]:
    """`perf.decode_step_s` with its constants folded: it runs once per simulated decode step.

    The folded formula is checked against the model at a spread of points; if the cost model
    ever changes shape, the check fails and the model's own method is used instead.
    """
    bw = perf.kv_bytes_per_block / perf.step_s_per_block  # effective HBM bytes/s
    mem0 = perf.model.weight_bytes / bw
    kv_s = perf.kv_bytes_per_token / bw
    per_seq = 2.0 * perf.model.params / (perf.gpu.bf16_flops * perf.tp_size * perf.mfu)
    overhead = perf.step_overhead_s

    def fast(kv_tokens: int, batch: int) -> float:
        m = mem0 + kv_tokens * kv_s
        c = batch * per_seq
        return overhead + (m if m > c else c)

    points = [(kv, b) for kv in (0, 1, 1000, 10**5, 10**7) for b in (1, 7, 256, 10**5)]
    for kv, b in points:
        want = perf.decode_step_s(kv, b)
        if abs(fast(kv, b) - want) > 1e-9 * want:
            return perf.decode_step_s
    return fast


class DecodeWorker:
    """Continuous batching over finite KV blocks, with the router's reservations beside it."""

    __slots__ = (
        "idx", "wid", "perf", "group", "layout", "capacity", "bs", "seqs", "joining", "fresh",
        "heap", "ph_used", "ph_held", "step", "used", "held", "kv_tokens", "durs", "durs_base",
        "stepping", "extra_s", "waiting", "handoff_wait", "reservations", "area", "last_t",
        "_view", "c_grown", "c_overran", "step_base", "step_per_block", "rate", "step_s",
        "join_mid_step", "can_prefill", "nic_free", "overran_now", "local_hit",
        "make_room", "cut_now", "peak_held", "c_past", "boundary_t",
    )  # fmt: skip

    def __init__(self, idx: int, spec: SimWorkerSpec, layout: KVLayout, *, quantum: float = 0.0,
                 step_extra_s: float = 0.0, join_mid_step: bool = False,
                 can_prefill: bool = False) -> None:  # fmt: skip
        self.idx = idx
        self.wid = spec.worker_id
        self.perf: PerfModel = spec.perf
        self.group = spec.group
        self.layout = layout
        self.capacity = spec.kv_capacity_blocks
        self.bs = layout.block_size
        self.seqs: dict[int, Job] = {}  # insertion order = join order; last = newest
        self.joining: list[Job] = []  # KV landed during the current step; join at its end
        self.fresh: list[Job] = []  # joined at the last boundary; first token at the next
        self.heap: list[tuple[int, int, int, int, Job]] = []  # (step, kind, uid, ver, job)
        self.ph_used = [0] * self.bs
        self.ph_held = [0] * self.bs
        self.step = 0  # completed steps
        self.used = 0  # blocks physically in use (incl. KV being pulled in)
        self.held = 0  # router's accounting: sum of max(reservation, used) per sequence
        self.kv_tokens = 0  # context tokens of the running batch
        self.durs: list[float] = []  # duration of step durs_base + i
        self.durs_base = 1
        self.stepping = False
        self.extra_s = 0.0  # local prefill work folded into the next step
        self.waiting: deque[Job] = deque()  # preempted / local-prefill jobs (vLLM's waiting queue)
        self.handoff_wait: deque[Job] = deque()  # refused handoffs, KV still stranded on P
        self.reservations: dict[int, Job] = {}
        self.area = 0.0  # reserved-but-unused block-seconds
        self.last_t = 0.0
        self._view: DecodeView | None = None
        self.c_grown = 0
        self.c_overran = 0
        self.overran_now: list[Job] = []  # outgrew their reservations at the last boundary
        self.step_base = spec.perf.step_base_s
        self.step_per_block = spec.perf.step_s_per_block
        self.rate = spec.perf.prefill_tokens_per_s()
        self.step_s = _step_time_fn(spec.perf)
        if quantum or step_extra_s:
            self.step_s = _with_live_costs(self.step_s, quantum, step_extra_s)
        self.join_mid_step = join_mid_step
        self.can_prefill = can_prefill
        self.nic_free = 0.0
        # Exact prefix cache (simcluster/prefix_facts.py): tokens a local prefill is spared.
        self.local_hit: Callable[[Job], int] | None = None
        # The router's preemption (disagg_tools/simcluster/preemption.py): called at a step
        # boundary whose growth left more held than capacity; it cuts streams (`cut`), which
        # land in `cut_now` for the engine to resume. None: the growth is forced, as before.
        self.make_room: Callable[[DecodeWorker, float], None] | None = None
        self.cut_now: list[Job] = []
        self.peak_held = 0  # the most the router's accounting ever held here
        self.c_past = 0  # step boundaries that ended with more held than capacity
        self.boundary_t = 0.0  # when the last step ended (its tokens' time)

    # -- accounting -------------------------------------------------------------------------
    def _tick(self, now: float) -> None:
        self.area += (self.held - self.used) * (now - self.last_t)
        self.last_t = now

    @property
    def free_held(self) -> int:
        return self.capacity - self.held

    def reserve(self, now: float, job: Job, blocks: int) -> None:
        self._tick(now)
        job.res = blocks
        self.held += blocks
        self.peak_held = max(self.peak_held, self.held)
        self.reservations[job.idx] = job
        self._view = None

    def allocate(self, now: float, job: Job, blocks: int) -> None:
        """Blocks for the job's KV (pulled from P or recomputed here) before it joins a batch."""
        self._tick(now)
        if job.idx not in self.reservations:  # re-admission after a preemption
            self.reservations[job.idx] = job
            self.held += job.res
        job.alloc = blocks
        self.used += blocks
        self.held += max(job.res, blocks) - job.res
        self.peak_held = max(self.peak_held, self.held)
        self._view = None

    def cancel(self, now: float, job: Job) -> None:
        """Drop a reservation (and any allocation) of a job that never joined a batch."""
        self._tick(now)
        if self.reservations.pop(job.idx, None) is not None:
            self.held -= max(job.res, job.alloc)
        self.used -= job.alloc
        job.alloc = 0
        self._view = None

    def step_estimate(self) -> float:
        return self.step_s(self.kv_tokens, len(self.seqs) + 1)

    # -- batch membership --------------------------------------------------------------------
    def _merge(self, job: Job) -> None:
        s0 = self.step
        c0 = job.ctx0
        bs = self.bs
        job.s0 = s0
        job.phase = ph = (1 - c0 + s0) % bs
        job.alloc = 0
        self.ph_used[ph] += 1
        remaining = job.out - job.gen
        limit = job.res * bs
        if c0 > limit:
            job.over = True
            self.ph_held[ph] += 1
        else:
            job.over = False
            if c0 + remaining > limit:
                heapq.heappush(self.heap, (s0 + limit - c0 + 1, 0, next(_uid), job.ver, job))
        heapq.heappush(self.heap, (s0 + remaining, 1, next(_uid), job.ver, job))
        self.seqs[job.idx] = job
        self.kv_tokens += c0
        self.fresh.append(job)

    def _remove(self, job: Job, now: float) -> int:
        """Take a running sequence out of the batch at the current boundary; returns its context."""
        s = self.step
        ctx = job.ctx0 + s - job.s0
        used = blocks_for(ctx, self.bs)
        self.used -= used
        self.held -= max(job.res, used)
        self.ph_used[job.phase] -= 1
        if job.over:
            self.ph_held[job.phase] -= 1
        self.kv_tokens -= ctx
        del self.seqs[job.idx]
        self.reservations.pop(job.idx, None)
        if s > job.s0:  # it emitted tokens in this residency
            lo = job.s0 + 2 - self.durs_base
            if s + 1 - self.durs_base > lo:
                job.max_gap = max(job.max_gap, max(self.durs[lo : s + 1 - self.durs_base]))
            job.last_t = now
        return ctx

    def _evict(self, job: Job, now: float) -> int:
        """Remove a running sequence at the current step keeping its tokens (a preemption, or
        a drain's take): its context becomes prompt + generated, and a stale event of it is
        told apart by `ver`. Returns that context."""
        ctx = self._remove(job, now)
        job.ver += 1
        job.gen += self.step - job.s0
        job.ctx0 = ctx
        if job in self.fresh:
            self.fresh.remove(job)
        return ctx

    def cut(self, job: Job, now: float) -> None:
        """The router stops a running sequence at this step boundary (its growth found no room
        for it or another stream of its tenant): out of the batch with its tokens kept, its
        room given back, on its way to `cut_now`. Only inside `boundary` (it sets `stepping`)."""
        self._evict(job, now)
        self.cut_now.append(job)

    def stop(self, job: Job, now: float) -> None:
        """The router stops a running sequence now, between two boundaries (a take-back for the
        fair share: disagg_tools/simcluster/fair_takeback.py; the router closes the stream
        when it decides, not at a step's end): out of the batch with the tokens of its finished
        steps kept, its room given back at once. The step under way ends as it was priced; its
        token of that step is lost, as a cancelled engine request's is."""
        self._tick(now)
        emitted = self.step > job.s0
        self._evict(job, now)
        if emitted:
            job.last_t = self.boundary_t  # its last token came at the last boundary, not now
        self._view = None

    def take(self, job: Job, now: float) -> int:
        """Take a running sequence out at a step boundary to resume it elsewhere (a drain past
        its deadline). Like an eviction, it keeps its tokens: context = prompt + generated.
        Returns that context."""
        self._tick(now)
        s = self.step
        ctx = self._evict(job, now)
        if not self.seqs:
            self.stepping = False
            self.durs = []
            self.durs_base = s + 1
        self._view = None
        return ctx

    def arrive(self, now: float, job: Job) -> bool:
        """The job's KV has landed. Returns True if the caller must schedule a step now."""
        if self.stepping:
            if self.join_mid_step:
                # The live worker's engine: in the running set at once, so its first token
                # comes at the end of the step already under way (priced without it).
                self._tick(now)
                self._merge(job)
                self._view = None
                return False
            self.joining.append(job)
            self._view = None  # resident_seqs counts it already
            return False
        self._tick(now)
        self._merge(job)
        return self._start(now)

    def poll(self, now: float) -> bool:
        """Admit local waiters on an idle worker. True if the caller must schedule a step."""
        if self.stepping:
            return False
        self._tick(now)
        self._admit_waiting()
        return self._start(now)

    def _start(self, now: float) -> bool:
        if not self.seqs:
            return False
        self.stepping = True
        self.durs.append(self.step_s(self.kv_tokens, len(self.seqs)) + self.extra_s)
        self.extra_s = 0.0
        self._view = None
        return True

    @property
    def current_step_s(self) -> float:
        return self.durs[-1]

    def _admit_waiting(self) -> None:
        while self.waiting:
            job = self.waiting[0]
            need = blocks_for(job.ctx0, self.bs)
            if self.capacity - self.used < need:
                return
            self.waiting.popleft()
            self.allocate(self.last_t, job, need)
            # vLLM recomputes a preempted sequence's KV locally, inside the next step.
            cached = self.local_hit(job) if self.local_hit is not None else 0
            self.extra_s += self.perf.prefill_s(job.ctx0, cached)
            job.local = False
            self._merge(job)

    # -- one step boundary -------------------------------------------------------------------
    def boundary(
        self, now: float, gap_add: Callable[[float, int], None]
    ) -> tuple[list[Job], list[Job], list[Job], list[Job]]:
        """End the running step. Returns (finished, evicted, failed, handoffs to start)."""
        self._tick(now)
        self._view = None
        self.step += 1
        self.boundary_t = now
        s = self.step
        dur = self.durs[-1]
        batch = len(self.seqs)
        fresh = self.fresh
        if batch > len(fresh):
            gap_add(dur, batch - len(fresh))
        for job in fresh:
            if job.first_t < 0:
                job.first_t = now
            else:  # resumed after preemption: the gap spans the wait and the recompute
                gap = now - job.last_t
                job.max_gap = max(job.max_gap, gap)
                gap_add(gap, 1)
        self.fresh = []
        self.kv_tokens += batch
        ph = s % self.bs
        self.used += self.ph_used[ph]
        finished: list[Job] = []
        heap = self.heap
        while heap and heap[0][0] <= s:
            _, kind, _, ver, job = heapq.heappop(heap)
            if ver != job.ver:
                continue
            if kind == 1:
                finished.append(job)
            else:  # it outgrows its reservation at this very step (a block boundary)
                if self.capacity - self.held > 0:
                    self.c_grown += 1
                else:
                    self.c_overran += 1
                job.over = True
                self.overran_now.append(job)
                self.ph_held[job.phase] += 1
        self.held += self.ph_held[ph]
        for job in finished:
            self._remove(job, now)
        for job in self.joining:
            self._merge(job)
        self.joining = []
        if self.held > self.capacity and self.make_room is not None:
            self.make_room(self, now)  # the router preempts instead of over-committing
        if self.held > self.capacity:
            self.c_past += 1
            self.peak_held = max(self.peak_held, self.held)
        evicted: list[Job] = []
        failed: list[Job] = []
        while self.used > self.capacity and self.seqs:
            job = self.seqs[next(reversed(self.seqs))]
            ctx = self._evict(job, now)
            if not self.seqs and blocks_for(ctx, self.bs) >= self.capacity:
                failed.append(job)  # it cannot fit even alone: never finishes here
                continue
            job.preemptions += 1
            job.local = True
            evicted.append(job)
        # Preempted sequences go to the front, as vLLM does; oldest preempted first.
        self.waiting.extendleft(reversed(evicted))
        self._admit_waiting()
        handoffs: list[Job] = []
        while self.handoff_wait:
            job = self.handoff_wait[0]
            need = blocks_for(job.prompt, self.bs)
            if self.capacity - self.used < need:
                break
            self.handoff_wait.popleft()
            self.allocate(now, job, need)
            handoffs.append(job)
        if self.seqs:
            self.durs.append(self.step_s(self.kv_tokens, len(self.seqs)) + self.extra_s)
            self.extra_s = 0.0
            if len(self.durs) > 65_536:
                self._trim()
        else:
            self.stepping = False
            self.durs = []
            self.durs_base = s + 1
        return finished, evicted, failed, handoffs

    def _trim(self) -> None:
        keep_from = min(j.s0 for j in self.seqs.values()) + 2
        cut = keep_from - self.durs_base
        if cut > 0:
            del self.durs[:cut]
            self.durs_base = keep_from

    def view(self) -> DecodeView:
        v = self._view
        if v is None:
            v = self._view = DecodeView(
                worker_id=self.wid,
                layout=self.layout,
                capacity_blocks=self.capacity,
                reserved_blocks=self.held,
                used_blocks=self.used,
                resident_seqs=len(self.seqs) + len(self.joining),
                group=self.group,
                step_base_s=self.step_base,
                step_s_per_block=self.step_per_block,
                prefill_tokens_per_s=self.rate,
                queued_prompt_tokens=sum(j.ctx0 for j in self.waiting),
                can_prefill=self.can_prefill,
            )
        return v

    def __repr__(self) -> str:
        return (
            f"DecodeWorker({self.wid}, seqs={len(self.seqs)}, used={self.used}, "
            f"held={self.held}/{self.capacity})"
        )
