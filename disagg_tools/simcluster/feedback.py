"""The router's in-flight corrections, run in the simulator with the router's own code.

The live router tells `policies.overruns` when an answer grows past its reservation (each
quarter of growth) and when a reservation is grown past a worker's capacity; this module does
the same from the simulated decode steps, so both run one `LiveOverruns` and one
`OverrunMargin`:

- a sequence outgrowing its reservation at a step boundary is reported at its length so far,
  and again each time it has grown by a quarter (an engine event, as the router's growth is);
- a decode worker whose held blocks exceed its capacity after a step (sequences running on
  unreserved room: the router's forced growth) sets that worker's margin.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from disagg_tools.simcluster.workers import DecodeWorker, Job
from policies.base import DecodeView, OutputLengthEstimator
from policies.overruns import LiveOverruns, OverrunMargin

__all__ = ["Feedback"]


class Feedback:
    def __init__(
        self,
        estimator: OutputLengthEstimator,
        push: Callable[[float, Callable[[], None]], None],
        clock: Callable[[], float],
        *,
        inflight: bool = True,
        margin: bool = True,
        half_life_s: float = 60.0,
        max_share: float = 0.25,
    ) -> None:
        self.estimator = estimator
        self.push = push  # schedules a call at a simulated time
        self.clock = clock  # the simulated time now
        self.live = LiveOverruns(estimator.bucket_of) if inflight else None
        self.margin = OverrunMargin(half_life_s, max_share) if margin else None

    @property
    def version(self) -> int:
        return self.live.version if self.live is not None else 0

    def histograms(
        self, completed: Mapping[str, Mapping[int, int]]
    ) -> Mapping[str, Mapping[int, int]]:
        return self.live.with_live(completed) if self.live is not None else completed

    def after_step(self, d: DecodeWorker, now: float) -> None:
        """What one decode step boundary showed: overruns, and room held past capacity."""
        if self.live is not None and d.overran_now:
            for job in d.overran_now:
                self._report(job, d, now)
        d.overran_now.clear()
        if self.margin is not None and d.held > d.capacity:
            self.margin.observe(d.wid, d.held - d.capacity, now)

    def _report(self, job: Job, d: DecodeWorker, now: float) -> None:
        if job.done or job.d is not d or job.info is None or self.live is None:
            return
        # Preempted and waiting to be recomputed, it has written `gen` (its residency's steps
        # are already in it); counting the steps since its old s0 again would overstate it.
        tokens = job.gen + (d.step - job.s0) if job.idx in d.seqs else job.gen
        self.live.overran(str(job.idx), self.estimator.class_keys(job.info), tokens)
        # The router reports again once the answer has grown by a quarter (its next growth).
        step_s = d.durs[-1] if d.durs else d.step_base
        self.push(now + max(1, tokens // 4) * step_s, lambda: self._report(job, d, self.clock()))

    def ended(self, job: Job) -> None:
        if self.live is not None:
            self.live.ended(str(job.idx))

    def with_margins(self, views: tuple[DecodeView, ...], now: float) -> tuple[DecodeView, ...]:
        return views if self.margin is None else self.margin.held(views, now)
