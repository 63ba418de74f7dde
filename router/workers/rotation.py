"""Who is in rotation in each pool, and why a worker is not: the admin API's guard rails
(router/edge/admin.py) and the 503 a request gets when a pool is empty (router/request/reserve.py).

A pool is one side (prefill or decode) of one model, as placement sees it (`PlacementView`):
the workers of that side whose layout names the model, or names none (they serve every
model). A `both` worker is on the side its current role names, in neither while it drains for
a switch; with no role yet (or `roles.local_prefill`) a decode-side `both` worker prefills its
own requests, so it counts on the prefill side too. A worker is in rotation on a side when it is
there and `available`: healthy, layout known, breaker letting requests through, not drained.

A worker whose engine's role switch failed (`broken`: the mark its role record carries on
every replica) is in no pool and on its way to none: only a restart and a check that it serves
its role bring it back (router/control/role_manager.py), so nothing waits for it. The admin guard
rails
count only the workers in rotation; a request waits for a pool only if a worker is in rotation
there or, fit to serve, on its way there.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from router.workers.membership import PoolMembers, broken
from router.workers.worker_state import WorkerState

__all__ = [
    "OPERATOR_RETRY_AFTER_S",
    "SIDES",
    "emptied_without",
    "in_rotation",
    "models_of",
    "pool_alive",
    "why_empty",
    "retry_after_s",
]

SIDES = ("prefill", "decode")

# A pool emptied by the operator's hand (drained workers, roles the static policy never
# changes back) does not come back by itself: no retry is likely to succeed soon. 30 s is the
# order of an operator's reaction, and within what OpenAI's clients honour (they take a
# Retry-After of up to 60 s, else back off by themselves).
OPERATOR_RETRY_AFTER_S = 30.0


def _could_serve(w: WorkerState, side: str) -> bool:
    """Registered for `side` at all (a plain decode worker never prefills, and vice versa)."""
    return w.spec.is_prefill if side == "prefill" else w.spec.is_decode


def _on_side(pools: PoolMembers, w: WorkerState, side: str) -> bool:
    if broken(w):
        return False
    if side == "decode":
        return w.in_decode_pool
    return w.in_prefill_pool or (w.in_decode_pool and pools.can_prefill_locally(w))


def models_of(pools: PoolMembers) -> tuple[str, ...]:
    """The configured model names plus those the workers' layouts name."""
    names = dict.fromkeys(pools.settings.models)
    for w in pools.workers.values():
        if w.spec.layout.model:
            names.setdefault(w.spec.layout.model)
    return tuple(names)


def in_rotation(
    pools: PoolMembers, side: str, model: str = "", without: str | None = None
) -> list[WorkerState]:
    """The workers in rotation on `side` for `model` ("": any), leaving out `without`."""
    return [
        w
        for w in pools.workers.values()
        if w.spec.id != without
        and w.available
        and _on_side(pools, w, side)
        and w.spec.serves(model)
    ]


def _candidates(
    pools: PoolMembers, side: str, model: str, without: str | None = None
) -> Iterable[WorkerState]:
    return (
        w
        for w in pools.workers.values()
        if w.spec.id != without and _could_serve(w, side) and w.spec.serves(model)
    )


def _reasons(pools: PoolMembers, w: WorkerState, side: str) -> list[str]:
    """Why `w` takes no `side` work now (empty: it is in rotation there)."""
    out: list[str] = []
    if why := broken(w):
        target = w.role_state.target if w.role_state is not None else "?"
        out.append(f"broken by a failed role switch to {target} ({why})")
    elif not _on_side(pools, w, side):
        role = w.current_role
        if role.startswith("draining-to-"):
            out.append(f"draining for a role switch to {role.removeprefix('draining-to-')}")
        else:
            out.append(f"serving {role}")
    if w.drained:
        out.append("drained by the operator")
    if not w.healthy:
        out.append("health probe failing")
    elif not w.layout_known:
        out.append("KV layout not read yet")
    if not w.breaker.allows():
        out.append("circuit breaker open")
    return out


def why_empty(pools: PoolMembers, side: str, model: str = "", without: str | None = None) -> str:
    """What each worker of the pool out of rotation does instead: "d0 drained by the operator,
    d1 serving prefill" (`without` left out, as if gone)."""
    parts = [
        f"{w.spec.id} {' and '.join(reasons)}"
        for w in _candidates(pools, side, model, without)
        if (reasons := _reasons(pools, w, side))
    ]
    return ", ".join(parts)  # empty: the pool has no worker at all (or all in rotation)


def _back_in_s(pools: PoolMembers, w: WorkerState, side: str) -> float:
    """When `w` may be back on `side` by itself (inf: only by an operator's hand)."""
    s = pools.settings
    if w.drained or broken(w):  # a broken engine needs a restart: not by itself
        return math.inf
    t = 0.0
    if not _on_side(pools, w, side):
        heading_here = w.current_role == f"draining-to-{side}"
        if not heading_here and s.roles.policy == "static":
            return math.inf  # the static policy never switches a worker back
        # The lease holder finishes the drain (or decides a switch back) within a tick once
        # every replica has seen it.
        t = s.roles.settle_s + s.roles.interval_s
    if not w.healthy or not w.layout_known:
        t = max(t, s.loops.health_interval_s)  # back with the first probe that passes
    b = w.breaker
    if not b.allows() and b.opened_at is not None:
        t = max(t, b.opened_at + b.cooldown_s - b.clock())
    return t


def retry_after_s(pools: PoolMembers, side: str, model: str = "") -> float:
    """An honest Retry-After for an empty pool: the soonest any of its workers may be back by
    itself, or OPERATOR_RETRY_AFTER_S when none will without the operator."""
    soonest = min(
        (_back_in_s(pools, w, side) for w in _candidates(pools, side, model)), default=math.inf
    )
    return OPERATOR_RETRY_AFTER_S if math.isinf(soonest) else max(1.0, soonest)


def _coming(w: WorkerState, side: str) -> bool:
    """Draining for a switch to `side`, and fit to serve once there: the role manager puts it
    in that pool by itself within a few seconds. Not one whose switch failed: it comes nowhere
    until restarted."""
    return w.current_role == f"draining-to-{side}" and w.available and not broken(w)


def pool_alive(pools: PoolMembers, side: str, model: str = "", without: str | None = None) -> bool:
    """A worker in rotation on `side` for `model`, or one on its way there (draining for a
    switch to it): waiting for room there is not in vain. `without` left out, as if gone."""
    return bool(in_rotation(pools, side, model, without)) or any(
        _coming(w, side) for w in _candidates(pools, side, model, without)
    )


def emptied_without(
    pools: PoolMembers, worker_id: str, arriving: str | None = None
) -> list[tuple[str, str]]:
    """The pools, as (side, model), that `worker_id` is in rotation in with no other worker in
    rotation: taking it out (drain, role switch, removal) would leave them with none serving.
    A worker on its way there does not count (issue 31: its switch may fail, and a broken one
    never arrives): the operator says `force` to rely on it. `arriving`: the side a role switch
    sends it to. A pool that is empty already is not listed: taking out a worker that is not
    serving changes nothing."""
    w = pools.workers.get(worker_id)
    if w is None or not w.available:
        return []
    models = (w.spec.layout.model,) if w.spec.layout.model else models_of(pools)
    return [
        (side, model)
        for model in models
        for side in SIDES
        if side != arriving
        and _on_side(pools, w, side)
        and not in_rotation(pools, side, model, without=worker_id)
    ]
