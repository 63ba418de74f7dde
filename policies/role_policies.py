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
from collections.abc import Mapping

from policies.base import Role, RolePlan, RoleSnapshot, RoleSwitch, RoleWorkerView

__all__ = ["StaticRoles", "ElasticRoles", "role_pressures", "split_of"]

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
    rate = 0.0
    queued = 0
    held = 0
    pending = 0
    cap = 0.0
    itl = itl_fraction * snapshot.slo_itl_s
    for w in snapshot.workers:
        role = w.role if roles is None else roles.get(w.worker_id, w.role)
        queued += w.queued_prompt_tokens
        held += w.held_blocks
        pending += w.pending_blocks
        if role == "prefill":
            rate += w.prefill_tokens_per_s
        else:
            cap += _decode_capacity(w, kv_target, itl)
    demand = snapshot.prefill_demand_tokens_per_s
    # Decode room held for requests prefill has not reached is the prefill pool's backlog, and
    # so is that share of the requests held back for room: blaming decode for it would move
    # workers the wrong way exactly when prefill is the bottleneck.
    share = min(1.0, pending / held) if held > 0 else 0.0
    queued = queued + int(share * snapshot.decode_waiting_prompt_tokens)
    held -= pending
    queued_peak = max(float(queued), snapshot.peak_queued_prompt_tokens)
    p_load = max(
        demand / rho_target, queued_peak / (wait_fraction * max(snapshot.slo_ttft_s, 1e-9))
    )
    d_held = max(float(held), snapshot.decode_demand_blocks)
    waiting = (1.0 - share) * snapshot.decode_waiting_blocks
    if snapshot.decode_hold_s <= 0:
        return _ratio(p_load, rate), _ratio(d_held + waiting, cap)
    # Requests waiting for room wait until that many blocks are freed (capacity / hold time per
    # second): a wait like a prefill queue's, against the same fraction of the TTFT SLO.
    d_wait = waiting * snapshot.decode_hold_s / (wait_fraction * max(snapshot.slo_ttft_s, 1e-9))
    return _ratio(p_load, rate), max(_ratio(d_held, cap), _ratio(d_wait, cap))


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


class ElasticRoles:
    """Moves workers toward the split that minimises the larger phase pressure; see the module
    docstring for the rule and why it does not flap."""

    name = "elastic"

    def __init__(
        self,
        *,
        rho_target: float = 0.85,
        wait_fraction: float = 0.5,
        kv_target: float = 1.0,
        itl_fraction: float = 0.8,
        hysteresis: float = 0.15,
        pause_horizon_s: float = 600.0,
        min_time_in_role_s: float = 20.0,
        reverse_after_s: float = 60.0,
        dwell_pauses: float = 3.0,
        max_switches_per_minute: int = 6,
        max_switches_per_decision: int = 2,
        activate_above: float = 0.3,
        min_prefill: int = 1,
        min_decode: int = 1,
        max_in_flight_per_role: int | None = None,
        seed: int = 0,
    ) -> None:
        for name, value in (("rho_target", rho_target), ("wait_fraction", wait_fraction),
                            ("kv_target", kv_target), ("itl_fraction", itl_fraction)):  # fmt: skip
            if not 0.0 < value <= 1.0:
                raise ValueError(f"{name} must be within (0, 1], got {value}")
        if min(hysteresis, min_time_in_role_s, reverse_after_s, dwell_pauses) < 0 or (
            pause_horizon_s <= 0
        ):
            raise ValueError(
                "hysteresis, min_time_in_role_s, reverse_after_s, dwell_pauses >= 0; "
                "pause_horizon_s > 0"
            )
        if max_switches_per_minute < 0 or min_prefill < 0 or min_decode < 1:
            raise ValueError("max_switches_per_minute >= 0, min_prefill >= 0, min_decode >= 1")
        self.rho_target = rho_target
        self.wait_fraction = wait_fraction
        self.kv_target = kv_target
        self.itl_fraction = itl_fraction
        self.hysteresis = hysteresis
        self.pause_horizon_s = pause_horizon_s
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

    def __repr__(self) -> str:
        return (
            f"ElasticRoles(hysteresis={self.hysteresis}, min_time_in_role_s="
            f"{self.min_time_in_role_s}, max_switches_per_minute={self.max_switches_per_minute}, "
            f"activate_above={self.activate_above}, seed={self.seed})"
        )

    def pressures(
        self, snapshot: RoleSnapshot, roles: Mapping[str, Role] | None = None
    ) -> tuple[float, float]:
        return role_pressures(
            snapshot, roles, rho_target=self.rho_target, wait_fraction=self.wait_fraction,
            kv_target=self.kv_target, itl_fraction=self.itl_fraction,
        )  # fmt: skip

    def decide(self, snapshot: RoleSnapshot) -> RolePlan:
        roles: dict[str, Role] = {w.worker_id: w.role for w in snapshot.workers}
        p0, d0 = p, d = self.pressures(snapshot, roles)
        now = snapshot.now_s
        budget = self.max_switches_per_minute - sum(
            1 for t in snapshot.recent_switches_s if now - 60.0 < t <= now
        )
        budget = min(budget, self.max_switches_per_decision)
        if budget <= 0:
            return RolePlan((), p0, d0, "switch budget for this minute spent")
        if max(p, d) < self.activate_above:
            return RolePlan((), p0, d0, "both phases lightly loaded")
        pause = snapshot.reconfig_pause_s
        dwell = max(self.min_time_in_role_s, self.dwell_pauses * pause)
        gain = 1.0 + self.hysteresis + pause / self.pause_horizon_s
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
            best: tuple[float, int, int, RoleWorkerView, float, float] | None = None
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
                p2, d2 = self.pressures(snapshot, roles)
                roles[w.worker_id] = give
                new = max(p2, d2)
                if new * gain > worst:
                    continue
                after = p2 if give == "prefill" else d2
                if after > 1.0 and worst < 2.0 * after:
                    continue  # it would push the giving phase past its SLO to ease the other
                drain = w.held_blocks if give == "decode" else w.queued_prompt_tokens
                key = (new, drain, _tie(self.seed, w.worker_id), w, p2, d2)
                if best is None or key[:3] < best[:3]:
                    best = key
            if best is None:
                note = "no move lowers the worst pressure enough" if note == "balanced" else note
                break
            new, _, _, w, p2, d2 = best
            if now - last_to[give] < self.reverse_after_s and not (worst > 1.0 > new):
                # Reversing a recent switch only to end an overload it caused, never to fine-tune.
                note = f"a worker moved to {give} {now - last_to[give]:.0f} s ago: not reversing"
                break
            n0 = split_of(roles)
            roles[w.worker_id] = take
            n1 = split_of(roles)
            switches.append(RoleSwitch(w.worker_id, take, (
                f"prefill pressure {p:.2f}, decode {d:.2f}: {n0[0]}P:{n0[1]}D -> "
                f"{n1[0]}P:{n1[1]}D, worst {worst:.2f} -> {new:.2f}"
            )))  # fmt: skip
            moved.add(w.worker_id)
            p, d = p2, d2
            budget -= 1
            note = "moving"
        return RolePlan(tuple(switches), p0, d0, note)


def _tie(seed: int, worker_id: str) -> int:
    # crc32, not hash(): str hashes are salted per process, and replicas must agree.
    return zlib.crc32(f"{seed}|{worker_id}".encode())
