"""Role policies: which `kv_both` workers serve prefill and which decode (docs/elastic-roles.md).

Placement cannot beat a wrong P:D ratio: on a prefill-bound shape every policy that balances
prefill queues reaches the same goodput. A role policy moves the ratio. It sees the demand on
both phases and returns the workers to move; the caller drains each (no new work of the old
kind, what it holds finishes), pauses it for the modelled reconfiguration, then serves the new
role. Like placement it is pure: a frozen `RoleSnapshot` in, a `RolePlan` out.

**What is balanced.** Each phase's *pressure* is its demand over its SLO-bound capacity, so 1.0
means "at the load where this phase starts to break its SLO":

    prefill = max(D / (rho_target · R),  Q / (wait_fraction · TTFT SLO · R))
    decode  = max(H, W · hold / (wait_fraction · TTFT SLO)) / C
    C       = Σ min(kv_target · capacity, blocks where a step = itl_fraction · ITL SLO)

with D the prompt tokens/s arriving, R the prefill pool's tokens/s, Q the prompt tokens queued
(now, or the recent peak if larger: bursts break the TTFT SLO at a low mean load),
H the KV blocks held on decode workers (reserved or used; or, if larger, the blocks the pool
should hold at the current arrival rate, `decode_demand_blocks`), W the blocks wanted by
requests held back for lack of room and `hold` how long a request holds its room: W · hold / C is
the wait those requests see, judged like a prefill queue's (without `hold`, W adds to H). Room
held for requests still waiting for prefill is prefill's backlog, not decode's load: it is
taken out of H, and that share of W (and of its prompt tokens) counts on the prefill side. Both
scale as 1 / pool size, so moving one worker changes them predictably, and the best split is the
one minimising max(prefill, decode): the goodput is set by whichever phase breaks first
(DistServe's offline choice, made online).

**Why it does not flap.** A move is made only when it lowers the larger pressure by a factor of
at least 1 + hysteresis (+ pause / pause_horizon_s, so a long pause needs a larger gain); with
whole workers the move back is then never an improvement of that size. A worker stays in a role
at least max(min_time_in_role_s, dwell_pauses × pause); within `reverse_after_s` of a switch, a
move the other way is made only if it ends an overload (worst pressure > 1, and < 1 after it): a
swap pays two drains for nothing; at most `max_switches_per_minute` start per minute
cluster-wide; nothing moves while both phases are below `activate_above` (light load: any split
serves); a move may not push the giving phase past 1.0 unless the other is at twice that (when
both phases are overloaded the cluster needs GPUs, not a re-role, and the transition would cost
the overloaded giving phase a worker before the other gains it). During a switch the giving side
has already lost the worker and the taking side has not gained it yet; the hysteresis test
bounds the giving side's new pressure below the current maximum, so the transition never raises
the worst phase's pressure.

Which worker moves: the one whose move helps most, then the cheapest to drain (fewest held
blocks leaving decode, fewest queued tokens leaving prefill), then a seeded hash of its id.
"""

from __future__ import annotations

import math
import zlib
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass

from policies.base import Role, RolePlan, RoleSnapshot, RoleSwitch, RoleWorkerView

__all__ = [
    "StaticRoles",
    "ElasticRoles",
    "SwitchCost",
    "phase_capacities",
    "phase_loads",
    "role_pressures",
    "split_of",
]

_OTHER: dict[Role, Role] = {"prefill": "decode", "decode": "prefill"}


def split_of(roles: Mapping[str, Role]) -> tuple[int, int]:
    """(prefill workers, decode workers) of a role assignment."""
    n_p = sum(1 for r in roles.values() if r == "prefill")
    return n_p, len(roles) - n_p


def role_pressures(
    snapshot: RoleSnapshot,
    roles: Mapping[str, Role] | None = None,
    *,
    rho_target: float = 0.85,
    wait_fraction: float = 0.25,
    kv_target: float = 0.9,
    itl_fraction: float = 0.8,
) -> tuple[float, float]:
    """(prefill pressure, decode pressure) if the workers had `roles` (default: their `role`).

    Load is what the whole cluster holds (a draining worker's blocks and queue count: that work
    lands on the pool it leaves); capacity is that of the workers assigned to each role.
    """
    p_load, d_load = phase_loads(snapshot, rho_target=rho_target, wait_fraction=wait_fraction)
    rate, cap = phase_capacities(snapshot, roles, kv_target=kv_target, itl_fraction=itl_fraction)
    return _ratio(p_load, rate), _ratio(d_load, cap)


def phase_loads(
    snapshot: RoleSnapshot, *, rho_target: float = 0.85, wait_fraction: float = 0.25
) -> tuple[float, float]:
    """The pressures' numerators, which do not depend on the split: (prefill tokens/s the pool
    must sustain, decode blocks it must hold). A pressure is one of them over its pool's
    capacity (`phase_capacities`), so a policy can smooth the loads across decisions and
    still price any split."""
    queued = held = pending = 0
    for w in snapshot.workers:
        queued += w.queued_prompt_tokens
        held += w.held_blocks
        pending += w.pending_blocks
    # Decode room held for requests prefill has not reached is the prefill pool's backlog, and
    # so is that share of the requests held back for room: blaming decode for it would move
    # workers the wrong way exactly when prefill is the bottleneck.
    share = min(1.0, pending / held) if held > 0 else 0.0
    queued = queued + int(share * snapshot.decode_waiting_prompt_tokens)
    held -= pending
    queued_peak = max(float(queued), snapshot.peak_queued_prompt_tokens)
    wait_s = wait_fraction * max(snapshot.slo_ttft_s, 1e-9)
    p_load = max(snapshot.prefill_demand_tokens_per_s / rho_target, queued_peak / wait_s)
    d_held = max(float(held), snapshot.decode_demand_blocks)
    waiting = (1.0 - share) * snapshot.decode_waiting_blocks
    if snapshot.decode_hold_s <= 0:
        return p_load, d_held + waiting
    # Requests waiting for room wait until that many blocks are freed (capacity / hold time per
    # second): a wait like a prefill queue's, against the same fraction of the TTFT SLO.
    return p_load, max(d_held, waiting * snapshot.decode_hold_s / wait_s)


def phase_capacities(
    snapshot: RoleSnapshot,
    roles: Mapping[str, Role] | None = None,
    *,
    kv_target: float = 0.9,
    itl_fraction: float = 0.8,
) -> tuple[float, float]:
    """(prefill tokens/s, SLO-bound decode blocks) of the workers `roles` puts in each pool."""
    rate = cap = 0.0
    itl = itl_fraction * snapshot.slo_itl_s
    for w in snapshot.workers:
        role = w.role if roles is None else roles.get(w.worker_id, w.role)
        if role == "prefill":
            rate += w.prefill_tokens_per_s
        else:
            cap += _decode_capacity(w, kv_target, itl)
    return rate, cap


def _decode_capacity(w: RoleWorkerView, kv_target: float, itl_s: float) -> float:
    """Blocks `w` can hold in decode before it breaks either its KV or its step-time target."""
    kv = kv_target * w.capacity_blocks
    if w.step_s_per_block <= 0:
        return kv if w.step_base_s < itl_s else 0.0
    return max(0.0, min(kv, (itl_s - w.step_base_s) / w.step_s_per_block))


def _ratio(load: float, capacity: float) -> float:
    if capacity > 0:
        return load / capacity
    return math.inf if load > 0 else 0.0


class StaticRoles:
    """Never switches: the operator's fixed split. Still reports the pressures it sees."""

    name = "static"

    def __init__(self, rho_target: float = 0.85, kv_target: float = 0.9) -> None:
        self.rho_target = rho_target
        self.kv_target = kv_target

    def __repr__(self) -> str:
        return f"StaticRoles(rho_target={self.rho_target}, kv_target={self.kv_target})"

    def decide(self, snapshot: RoleSnapshot) -> RolePlan:
        p, d = role_pressures(snapshot, rho_target=self.rho_target, kv_target=self.kv_target)
        return RolePlan((), p, d, "static")


@dataclass(frozen=True, slots=True)
class SwitchCost:
    """What one switch costs and what it is predicted to gain, in pressure-seconds (a phase's
    pressure × seconds: the unit the gain is measured in, so the two compare directly).

    - `drain_s`: until the worker holds nothing of its old role. Leaving decode, the last of
      its resident streams ends (residual lives taken as exponential with the mean decode hold
      time: the last of n ends after hold × H(n)), at most the drain deadline; leaving prefill,
      its queued prompt tokens at its rate (an upper bound: queued prompts move at once).
    - `migrated` streams and their `reprefill_tokens`: resident streams still running at the
      deadline (a share exp(-deadline / hold)) are resumed on another decode worker, their
      context prefilled again, which loads the prefill pool.
    - `pause_s`: the engine's reconfiguration (the snapshot's).

    step = max(worst, knee) - max(new, knee)   (knee: `activate_above`; pressure under it is
                                               headroom, lowering it gains nothing)
    cost = step × (drain + pause)               the gain not had until the worker serves
         + reprefill_tokens / (one prefill worker's rate)   the migrated streams' stalls,
                                               a stalled stream-second as a pressure-second
         + max(0, giving phase's pressure after - worst) × (drain + pause)
    gain = step × horizon
    """

    drain_s: float
    pause_s: float
    migrated: float
    reprefill_tokens: float
    gain_ps: float
    cost_ps: float

    @property
    def pays(self) -> bool:
        return self.gain_ps > self.cost_ps

    def __str__(self) -> str:
        return (
            f"gain {self.gain_ps:.1f} vs cost {self.cost_ps:.1f} pressure-s (drain "
            f"{self.drain_s:.1f} s, pause {self.pause_s:.1f} s, {self.migrated:.1f} streams "
            f"re-prefilled)"
        )


class ElasticRoles:
    """Moves workers toward the split that minimises the larger phase pressure, on pressures
    smoothed across decisions, when a switch's predicted gain pays for its cost; see the module
    docstring for the rule and why it does not flap.

    Keeps state from snapshot to snapshot (the recent loads); deterministic given the same
    sequence of snapshots. A snapshot older than the last one starts the history afresh."""

    name = "elastic"

    def __init__(
        self,
        *,
        rho_target: float = 0.85,
        wait_fraction: float = 0.5,
        kv_target: float = 1.0,
        itl_fraction: float = 0.8,
        hysteresis: float = 0.15,
        give_limit: float = 0.9,
        smooth_window_s: float = 30.0,
        horizon_s: float = 60.0,
        drain_deadline_s: float = 5.0,
        block_tokens: int = 16,
        min_time_in_role_s: float = 20.0,
        reverse_after_s: float = 60.0,
        dwell_pauses: float = 3.0,
        max_switches_per_minute: int = 6,
        max_switches_per_decision: int = 2,
        activate_above: float = 0.5,
        min_prefill: int = 1,
        min_decode: int = 1,
        max_in_flight_per_role: int | None = None,
        seed: int = 0,
    ) -> None:
        for name, value in (("rho_target", rho_target), ("wait_fraction", wait_fraction),
                            ("kv_target", kv_target), ("itl_fraction", itl_fraction)):  # fmt: skip
            if not 0.0 < value <= 1.0:
                raise ValueError(f"{name} must be within (0, 1], got {value}")
        if min(hysteresis, min_time_in_role_s, reverse_after_s, dwell_pauses) < 0:
            raise ValueError("hysteresis, min_time_in_role_s, reverse_after_s, dwell_pauses >= 0")
        if smooth_window_s < 0 or horizon_s <= 0 or drain_deadline_s < 0 or block_tokens < 1:
            raise ValueError(
                "smooth_window_s >= 0, horizon_s > 0, drain_deadline_s >= 0, block_tokens >= 1"
            )
        if max_switches_per_minute < 0 or min_prefill < 0 or min_decode < 1:
            raise ValueError("max_switches_per_minute >= 0, min_prefill >= 0, min_decode >= 1")
        self.rho_target = rho_target
        self.wait_fraction = wait_fraction
        self.kv_target = kv_target
        self.itl_fraction = itl_fraction
        self.hysteresis = hysteresis
        # A move may not push the giving phase past this pressure unless the other phase is at
        # twice it (both overloaded: the cluster needs GPUs, not a re-role). Below 1.0: the
        # pressures are linear in pool size, a pool of one or two workers is not.
        self.give_limit = give_limit
        # The loads decided on are the medians of those seen over this window (0: the latest
        # only): a giant prompt or one long-context stream lasts a few decisions, a shift in
        # the mix lasts minutes.
        self.smooth_window_s = smooth_window_s
        # How long a switch's gain is counted for: the next window the demand is predicted over.
        self.horizon_s = horizon_s
        # The caller's drain deadline (simulator and router default: 5 s), for the cost model.
        self.drain_deadline_s = drain_deadline_s
        self.block_tokens = block_tokens
        self.min_time_in_role_s = min_time_in_role_s
        self.reverse_after_s = reverse_after_s
        self.dwell_pauses = dwell_pauses
        self.max_switches_per_minute = max_switches_per_minute
        self.max_switches_per_decision = max_switches_per_decision
        self.activate_above = activate_above
        self.min_prefill = min_prefill
        self.min_decode = min_decode
        # At most this many switches toward one role under way at once (None: no limit): the
        # next one is decided only once the pressure shows what the first one changed.
        self.max_in_flight_per_role = max_in_flight_per_role
        self.seed = seed
        self._loads: deque[tuple[float, float, float]] = deque()  # (now, prefill, decode)

    def __repr__(self) -> str:
        return (
            f"ElasticRoles(hysteresis={self.hysteresis}, smooth_window_s="
            f"{self.smooth_window_s}, horizon_s={self.horizon_s}, min_time_in_role_s="
            f"{self.min_time_in_role_s}, max_switches_per_minute={self.max_switches_per_minute}, "
            f"activate_above={self.activate_above}, seed={self.seed}, "
            f"{len(self._loads)} loads kept)"
        )

    def pressures(
        self, snapshot: RoleSnapshot, roles: Mapping[str, Role] | None = None
    ) -> tuple[float, float]:
        """This snapshot's pressures, unsmoothed."""
        return role_pressures(
            snapshot, roles, rho_target=self.rho_target, wait_fraction=self.wait_fraction,
            kv_target=self.kv_target, itl_fraction=self.itl_fraction,
        )  # fmt: skip

    def smoothed_loads(self, snapshot: RoleSnapshot) -> tuple[float, float]:
        """Record this snapshot's loads and return the medians of the window (each phase on
        its own). With less history than the window (a cold start, a new leader) the median is
        of what there is: the first decision acts on the first snapshot."""
        p, d = phase_loads(snapshot, rho_target=self.rho_target, wait_fraction=self.wait_fraction)
        now = snapshot.now_s
        hist = self._loads
        if hist and now < hist[-1][0]:
            hist.clear()
        hist.append((now, p, d))
        while len(hist) > 1 and hist[0][0] <= now - self.smooth_window_s:
            hist.popleft()
        return _median([x[1] for x in hist]), _median([x[2] for x in hist])

    def switch_cost(
        self,
        snapshot: RoleSnapshot,
        w: RoleWorkerView,
        roles_after: Mapping[str, Role],
        worst: float,
        new: float,
        giving_after: float,
    ) -> SwitchCost:
        """The cost model (`SwitchCost`) of moving `w` out of its role, `roles_after` being the
        split it leads to."""
        pause = snapshot.reconfig_pause_s
        migrated = tokens = 0.0
        if w.role == "decode":
            n = w.resident_seqs
            ctx_blocks = max(0, w.held_blocks - w.pending_blocks)
            drain = 0.0
            if n > 0 or ctx_blocks > 0:
                # Hold time unknown (the live router): assume twice the deadline.
                hold = snapshot.decode_hold_s or 2.0 * self.drain_deadline_s
                n = max(1, n)
                harmonic = sum(1.0 / k for k in range(1, n + 1))
                drain = min(self.drain_deadline_s, hold * harmonic)
                share = math.exp(-self.drain_deadline_s / hold) if hold > 0 else 0.0
                migrated = n * share
                tokens = ctx_blocks * self.block_tokens * share
        else:
            rate = w.prefill_tokens_per_s
            drain = w.queued_prompt_tokens / rate if rate > 0 else 0.0
        busy = drain + pause
        # A migrated stream stalls for its re-prefill on one prefill worker; each second of a
        # stalled stream counts as a pressure-second (a request at its SLO's limit).
        prefill = [
            x.prefill_tokens_per_s
            for x in snapshot.workers
            if roles_after.get(x.worker_id) == "prefill"
        ]
        per_worker = sum(prefill) / len(prefill) if prefill else 0.0
        # Pressure below `activate_above` is headroom: lowering it gains nothing now, and a
        # split tuned at a light load is the wrong one when the load comes back.
        knee = self.activate_above
        step = max(0.0, max(worst, knee) - max(new, knee))
        reprefill = _ratio(tokens, per_worker)
        if math.isinf(step):
            # The taking phase has no worker at all (its pressure is infinite) and the move gives
            # it one: any cost is paid (inf x a zero drain would read as NaN and refuse it).
            return SwitchCost(drain, pause, migrated, tokens, math.inf, reprefill)
        cost = step * busy + reprefill + max(0.0, giving_after - worst) * busy
        return SwitchCost(drain, pause, migrated, tokens, step * self.horizon_s, cost)

    def decide(self, snapshot: RoleSnapshot) -> RolePlan:
        roles: dict[str, Role] = {w.worker_id: w.role for w in snapshot.workers}
        p_load, d_load = self.smoothed_loads(snapshot)
        kw = {"kv_target": self.kv_target, "itl_fraction": self.itl_fraction}

        def pressures(split: Mapping[str, Role]) -> tuple[float, float]:
            rate, cap = phase_capacities(snapshot, split, **kw)
            return _ratio(p_load, rate), _ratio(d_load, cap)

        p0, d0 = p, d = pressures(roles)
        now = snapshot.now_s
        budget = self.max_switches_per_minute - sum(
            1 for t in snapshot.recent_switches_s if now - 60.0 < t <= now
        )
        budget = min(budget, self.max_switches_per_decision)
        if budget <= 0:
            return RolePlan((), p0, d0, "switch budget for this minute spent")
        if max(p, d) < self.activate_above:
            return RolePlan((), p0, d0, "both phases lightly loaded")
        dwell = max(self.min_time_in_role_s, self.dwell_pauses * snapshot.reconfig_pause_s)
        gain = 1.0 + self.hysteresis
        # The last switch toward each role: a move the other way soon after is a swap that pays
        # two drains and two pauses for nothing (the demand signals are noisy; the split is not).
        last_to: dict[Role, float] = {"prefill": -math.inf, "decode": -math.inf}
        for w in snapshot.workers:
            if w.can_switch and w.since_s > last_to[w.role]:
                last_to[w.role] = w.since_s
        switches: list[RoleSwitch] = []
        moved: set[str] = set()
        note = "balanced"
        while budget > 0:
            worst = max(p, d)
            take: Role = "prefill" if p >= d else "decode"
            give = _OTHER[take]
            n_give = sum(1 for r in roles.values() if r == give)
            cap = self.max_in_flight_per_role
            if cap is not None:
                under_way = sum(1 for w in snapshot.workers if w.role == take and not w.serving)
                if under_way + sum(1 for x in switches if x.to_role == take) >= cap:
                    note = f"a switch to {take} is under way"
                    break
            if n_give - 1 < (self.min_prefill if give == "prefill" else self.min_decode):
                note = f"{give} pool at its minimum"
                break
            best: tuple[float, float, int, RoleWorkerView, float, float, SwitchCost] | None = None
            unpaid: SwitchCost | None = None
            for w in snapshot.workers:
                if (
                    not w.can_switch
                    or not w.serving
                    or roles[w.worker_id] != give
                    or w.worker_id in moved
                    or now - w.since_s < dwell
                ):
                    continue
                roles[w.worker_id] = take
                p2, d2 = pressures(roles)
                new = max(p2, d2)
                after = p2 if give == "prefill" else d2
                # Hysteresis on the pressure above the knee: a move must lower it by the
                # factor, so nothing moves while the worst phase is under knee × (1 + hysteresis).
                knee = self.activate_above
                ok = max(new, knee) * gain <= max(worst, knee)
                ok = ok and not (after > self.give_limit and worst < 2.0 * after)
                # (a move may not push the giving phase past its SLO to ease the other)
                cost = self.switch_cost(snapshot, w, roles, worst, new, after) if ok else None
                roles[w.worker_id] = give
                if cost is None:
                    continue
                if not cost.pays:
                    unpaid = cost if unpaid is None or cost.cost_ps < unpaid.cost_ps else unpaid
                    continue
                key = (new, cost.cost_ps, _tie(self.seed, w.worker_id), w, p2, d2, cost)
                if best is None or key[:3] < best[:3]:
                    best = key
            if best is None:
                if unpaid is not None:
                    note = f"the gain does not pay for a switch: {unpaid}"
                elif note == "balanced":
                    note = "no move lowers the worst pressure enough"
                break
            new, _, _, w, p2, d2, cost = best
            if now - last_to[give] < self.reverse_after_s and not (worst > 1.0 > new):
                # Reversing a recent switch only to end an overload it caused, never to fine-tune.
                note = f"a worker moved to {give} {now - last_to[give]:.0f} s ago: not reversing"
                break
            n0 = split_of(roles)
            roles[w.worker_id] = take
            n1 = split_of(roles)
            switches.append(RoleSwitch(w.worker_id, take, (
                f"prefill pressure {p:.2f}, decode {d:.2f}: {n0[0]}P:{n0[1]}D -> "
                f"{n1[0]}P:{n1[1]}D, worst {worst:.2f} -> {new:.2f}; {cost}"
            )))  # fmt: skip
            moved.add(w.worker_id)
            p, d = p2, d2
            budget -= 1
            note = "moving"
        return RolePlan(tuple(switches), p0, d0, note)


def _median(xs: list[float]) -> float:
    ys = sorted(xs)
    n = len(ys)
    return ys[n // 2] if n % 2 else 0.5 * (ys[n // 2 - 1] + ys[n // 2])


def _tie(seed: int, worker_id: str) -> int:
    # crc32, not hash(): str hashes are salted per process, and replicas must agree.
    return zlib.crc32(f"{seed}|{worker_id}".encode())
