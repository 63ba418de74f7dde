"""What the role policy sees of the live pools: a `RoleSnapshot` from the router's accounting.

The same fields the simulator fills (disagg_tools/sim/cluster_roles.py), from the live signals:
- prefill demand: prompt tokens arriving per second (the autoscaling meter, router/scaling.py)
  and the prompt tokens queued on prefill workers now, with a decayed recent peak (bursts break
  the TTFT SLO at a low mean load);
- decode demand: KV blocks held on each decode worker (every replica's reservations, from the
  store) against its capacity and its step-time model at the ITL SLO.

Queued prompt tokens and the arrival rate are this replica's own (the one holding the role
lease); reservations are every replica's. Behind a balancer that spreads requests evenly the
leader's queue is a fair sample of each worker's; the reservations are exact.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable

from policies.base import Role, RoleSnapshot, RoleWorkerView
from router.config import Settings
from router.workers.worker_state import WorkerState

__all__ = ["QueuePeak", "role_of", "role_snapshot"]


class QueuePeak:
    """The largest total prompt-token queue of the last while, decaying with `window_s`."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self.value = 0.0
        self._at: float | None = None

    def __repr__(self) -> str:
        return f"QueuePeak({self.value:.0f} tokens, window {self.window_s} s)"

    def update(self, queued: float, now: float) -> float:
        if self._at is not None:
            self.value *= math.exp(-max(0.0, now - self._at) / self.window_s)
        self._at = now
        self.value = max(self.value, queued)
        return self.value


def role_of(w: WorkerState) -> Role:
    """The role `w` serves or is heading to, as a policy names it (a `both` worker with no
    role yet serves decode; an SGLang one the role its engine was started in)."""
    if w.role_state is not None:
        target = w.role_state.target
    else:
        target = (w.engine_role if w.spec.switches_engine_role else None) or w.spec.role
    return "prefill" if target == "prefill" else "decode"


def can_switch(w: WorkerState) -> bool:
    """A `both` worker the role manager may move now: in rotation, and for an SGLang engine
    one in PD mode started with --enable-pd-role-switch."""
    if w.spec.role != "both" or not w.available:
        return False
    if w.spec.switches_engine_role:
        return w.engine_can_switch
    return True


def _view(w: WorkerState) -> RoleWorkerView:
    spec = w.spec
    perf = spec.perf
    record = w.role_state if spec.role == "both" else None
    return RoleWorkerView(
        worker_id=spec.id,
        role=role_of(w),
        state="draining" if record is not None and record.draining else "active",
        can_switch=can_switch(w),
        since_s=record.since_s if record is not None else -math.inf,
        queued_prompt_tokens=w.queued_prompt_tokens,
        prefill_tokens_per_s=perf.prefill_tokens_per_s() if perf else 10_000.0,
        capacity_blocks=w.capacity_blocks if spec.is_decode else 0,
        held_blocks=w.reserved_blocks,
        resident_seqs=w.reservations,
        step_base_s=perf.step_base_s if perf else 0.005,
        step_s_per_block=perf.step_s_per_block if perf else 0.0,
    )


def role_snapshot(
    workers_in_pools: Iterable[WorkerState],
    settings: Settings,
    *,
    arriving_tokens_per_s: float,
    peak: QueuePeak,
    recent_switches_s: tuple[float, ...],
    now_s: float | None = None,
) -> RoleSnapshot:
    """The snapshot at `now_s` (unix seconds: the store's role times are on that clock)."""
    now = time.time() if now_s is None else now_s
    workers = tuple(_view(w) for w in workers_in_pools if w.healthy)
    queued = sum(w.queued_prompt_tokens for w in workers)
    return RoleSnapshot(
        now_s=now,
        workers=workers,
        prefill_demand_tokens_per_s=arriving_tokens_per_s,
        peak_queued_prompt_tokens=peak.update(queued, now),
        slo_ttft_s=settings.scaling.ttft_slo_s,
        slo_itl_s=settings.scaling.itl_slo_s,
        reconfig_pause_s=settings.roles.reconfig_pause_s,
        recent_switches_s=recent_switches_s,
    )
