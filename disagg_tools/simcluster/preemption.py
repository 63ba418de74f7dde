"""Preemption with exact resume in the simulator (issue 31), as the live router does it
(router/request/preemption.py, holdings.py `Reservation._grow`, lifecycle.py
`_after_preemption`), with the router's own rule (policies/preemption.py `choose_victims`).

A sequence that outgrows its reservation grows the router's count ("held") one block at each
block boundary it crosses (disagg_tools/simcluster/workers.py). When a step boundary's growth
leaves a decode worker holding more than its capacity, each growing sequence in turn asks the
rule for room (one block, on this worker): the newest dispatched of its own tenant's running
streams there, itself included, at most `max_per_stream` times each. A chosen stream is cut
(`DecodeWorker.cut`: out of the batch at this boundary, its tokens kept, its room given back at
once — the simulator's release is instant, the router's takes a store round trip) and resumes
as a new request: its prompt is the client's prompt + the tokens it produced (re-prefilled on
a prefill worker: the redone work, counted), its whole remaining max_tokens is reserved, and it
waits in admission at the head of the line (the router keeps the request's ticket, the oldest)
up to `preemption_resume_wait_s`, never refused for a full queue. With no stream to take, the
growth is forced past capacity as before preemption existed (counted in `forced`): the engine
may then preempt on its own.

What is not modelled: the router's growth ahead of use (a quarter at a time) — the simulator's
count follows use block by block, so its preemptions come as late as possible; the tenant's
`max_reserved_blocks` (the simulator has no per-tenant block limit), so every preemption here is
the router's "worker_full".
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from disagg_tools.simcluster.workers import DecodeWorker, Job
from policies.base import blocks_for
from policies.preemption import StreamFacts, choose_victims

__all__ = ["RouterPreemption"]


class RouterPreemption:
    """The rule's side of preemption for every decode worker of one run, and its counts."""

    __slots__ = ("bound", "forced", "cuts", "redone_tokens", "resume")

    def __init__(self, max_per_stream: int, resume: Callable[[Job], None]) -> None:
        self.bound = max_per_stream
        self.resume = resume  # the engine's: the cut job's continuation into admission
        self.forced = 0  # growths past capacity with no stream to preempt
        self.cuts = 0
        self.redone_tokens = 0  # prefill tokens redone for the continuations

    def __repr__(self) -> str:
        return f"RouterPreemption(cuts={self.cuts}, forced={self.forced})"

    def make_room(self, d: DecodeWorker, now: float) -> None:
        """`d` holds more than its capacity after this boundary's growth: cut streams until it
        does not, or no growing stream has a victim left (its growth is then forced)."""
        ph = d.step % d.bs
        running = d.seqs.values()
        # The sequences that grew a block at this boundary, oldest dispatch first (join order):
        # each asks for its block in turn, as the router's growths come one by one.
        growers = [j for j in running if j.over and j.phase == ph] or [j for j in running if j.over]
        for grower in growers:
            if d.held <= d.capacity:
                return
            if grower.idx not in d.seqs:
                continue  # cut already, for an earlier grower's block
            victims = choose_victims(
                self._facts(d), str(grower.idx), grower.tenant, 1, d.wid, self.bound
            )
            if not victims:
                self.forced += 1
                continue
            for stream_id in victims.stream_ids:
                d.cut(d.seqs[int(stream_id)], now)
        if d.held > d.capacity and not growers:
            self.forced += 1  # held past capacity with no grower: nothing the rule may take

    def _facts(self, d: DecodeWorker) -> list[StreamFacts]:
        step, bs, wid = d.step, d.bs, d.wid
        return [
            StreamFacts(
                str(j.idx),
                j.tenant,
                wid,
                j.admitted_at,
                max(j.res, blocks_for(j.ctx0 + step - j.s0, bs)),
                j.cuts,
            )
            for j in d.seqs.values()
        ]

    def continuation(self, job: Job) -> None:
        """`job` was cut: the request its resume is (router/request/lifecycle.py
        `_after_preemption`): prompt + what it produced, the rest of its cap as max_tokens."""
        assert job.info is not None
        self.cuts += 1
        job.cuts += 1
        job.redone += job.ctx0
        self.redone_tokens += job.ctx0
        job.prompt = job.ctx0
        job.res = job.alloc = 0
        job.over = job.local = False
        job.d = job.p = None
        job.placed = None
        job.info = replace(job.info, prompt_tokens=job.prompt, max_tokens=max(1, job.cap - job.gen))
        self.resume(job)
