"""What the role policy sees of the live pools: a `RoleSnapshot` from the router's accounting.

The same fields the simulator fills (disagg_tools/sim/cluster_roles.py), from the live signals:
- prefill demand: prompt tokens arriving per second (the autoscaling meter,
router/control/scaling.py)
  and the prompt tokens queued on prefill workers now, with a decayed recent peak (bursts break
  the TTFT SLO at a low mean load);
- decode demand: KV blocks held on each decode worker (every replica's reservations, from the
  store) against its capacity and its step-time model at the ITL SLO.

Queued prompt tokens and the arrival rate are each replica's own: every replica publishes its
own (`ReplicaDemand`, one store write a role tick) and the replica holding the role lease decides
on their sum (`summed`), so behind N replicas it sees the whole cluster's prefill demand, not
its 1/N — whatever the balancer does. Reservations are every replica's already (the store).
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import orjson

from policies.base import Role, RoleSnapshot, RoleWorkerView
from router.config import Settings
from router.workers.membership import broken
from router.workers.worker_state import WorkerState

__all__ = ["QueuePeak", "ReplicaDemand", "role_of", "role_snapshot", "summed"]


@dataclass(frozen=True, slots=True)
class ReplicaDemand:
    """One replica's own prefill demand: the prompt tokens per second arriving through it, and
    the prompt tokens it has queued on each worker (sent, not answered yet)."""

    arriving_tokens_per_s: float = 0.0
    queued_prompt_tokens: Mapping[str, int] = field(default_factory=dict)

    def encode(self) -> str:
        return orjson.dumps(
            {"a": self.arriving_tokens_per_s, "q": dict(self.queued_prompt_tokens)}
        ).decode()

    @classmethod
    def decode(cls, payload: str) -> ReplicaDemand | None:
        """None for a payload this version cannot read (another version's replica): skipped."""
        try:
            raw = orjson.loads(payload)
            arriving = float(raw["a"])
            queued = {str(k): int(v) for k, v in raw["q"].items()}
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError):
            return None
        if not math.isfinite(arriving) or arriving < 0:
            return None
        return cls(arriving, queued)

    @classmethod
    def of(cls, workers: Iterable[WorkerState], arriving_tokens_per_s: float) -> ReplicaDemand:
        queued = {w.spec.id: w.queued_prompt_tokens for w in workers if w.queued_prompt_tokens}
        return cls(arriving_tokens_per_s, queued)


def summed(demands: Iterable[ReplicaDemand]) -> ReplicaDemand:
    """The cluster's demand: every replica's arrivals and queues added up."""
    arriving = 0.0
    queued: dict[str, int] = {}
    for d in demands:
        arriving += d.arriving_tokens_per_s
        for wid, tokens in d.queued_prompt_tokens.items():
            queued[wid] = queued.get(wid, 0) + tokens
    return ReplicaDemand(arriving, queued)


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
    if w.spec.role != "both" or not w.available or broken(w):
        return False
    if w.spec.switches_engine_role:
        return w.engine_can_switch
    return True


def _view(w: WorkerState, queued: Mapping[str, int] | None) -> RoleWorkerView:
    spec = w.spec
    perf = spec.perf
    record = w.role_state if spec.role == "both" else None
    return RoleWorkerView(
        worker_id=spec.id,
        role=role_of(w),
        state="draining" if record is not None and record.draining else "active",
        can_switch=can_switch(w),
        since_s=record.since_s if record is not None else -math.inf,
        queued_prompt_tokens=w.queued_prompt_tokens if queued is None else queued.get(spec.id, 0),
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
    queued_prompt_tokens: Mapping[str, int] | None = None,
) -> RoleSnapshot:
    """The snapshot at `now_s` (unix seconds: the store's role times are on that clock).
    `queued_prompt_tokens`: every replica's queue on each worker (`summed`); None: this
    replica's own. The pause told to the policy is the longest of the switchable workers'
    engine kinds (policies/role_pauses.py). A worker broken by a failed switch is left out,
    as a failing one is: it serves neither phase, and counting it where it was heading would
    hide that phase's want of a worker from the policy."""
    now = time.time() if now_s is None else now_s
    healthy = [w for w in workers_in_pools if w.healthy and not broken(w)]
    workers = tuple(_view(w, queued_prompt_tokens) for w in healthy)
    roles = settings.roles
    pause = max(
        (roles.pause_for(w.spec.adapter) for w in healthy if w.spec.role == "both"), default=0.0
    )
    queued = sum(w.queued_prompt_tokens for w in workers)
    return RoleSnapshot(
        now_s=now,
        workers=workers,
        prefill_demand_tokens_per_s=arriving_tokens_per_s,
        peak_queued_prompt_tokens=peak.update(queued, now),
        slo_ttft_s=settings.scaling.ttft_slo_s,
        slo_itl_s=settings.scaling.itl_slo_s,
        reconfig_pause_s=pause,
        recent_switches_s=recent_switches_s,
    )
