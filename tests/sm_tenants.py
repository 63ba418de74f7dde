"""Tenants, their quota holds and preemption in the reservation state machine (issue 31;
tests/system/test_state_machine.py, tests/sm_cluster.py).

- `TENANTS`: three tenants configured with keys on every replica, of different weights: `lim`
  (max_reserved_blocks), `rpm` (requests_per_minute), `free` (no limit).
- `QuotaWatch` wraps each replica's quota store calls like the cluster's `Tracker` wraps the
  reservations' (in flight, history, the ids a renewal put back), and keeps what each hold may
  hold past its tenant's limit: the deltas of forced resizes, by where they came from — a
  growth that found no room (router/request/holdings.py `_grow`: counted forced growth) or a
  try that set the hold to its reservation (router/request/lifecycle.py `_try`).
- `PreemptionWatch` wraps each replica's `Preemptor.choose` and the store's forced `resize`,
  and classifies every forced growth on a decode worker by what the preemption rule
  (policies/preemption.py) allows: the growing stream could not be preempted (not resumable,
  preemption off, at its bound, preempted meanwhile) or it grows past every decode worker's
  capacity (its continuation would fit nowhere). A forced growth of a stream that could have
  been preempted is a violation (since 48efed6 a grower whose victims' room does not come back
  within `release_wait_s` preempts itself).
"""

from __future__ import annotations

import asyncio
import inspect
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tests.sm_cluster import Tracker

__all__ = ["TENANTS", "TENANT_KEYS", "LIMITED", "QuotaWatch", "PreemptionWatch"]

TENANT_KEYS = {
    "lim": "sk-sm-lim-4f3e2d1c0b9a8f7e6d5c",
    "rpm": "sk-sm-rpm-0a1b2c3d4e5f60718293",
    "free": "sk-sm-free-9e8d7c6b5a4f3e2d1c0b",
}
LIMITED = {"lim": 300}  # tenant -> max_reserved_blocks
TENANTS = [
    {"name": "lim", "weight": 1, "keys": [TENANT_KEYS["lim"]], "max_reserved_blocks": 300},
    {"name": "rpm", "weight": 2, "keys": [TENANT_KEYS["rpm"]], "requests_per_minute": 40},
    {"name": "free", "weight": 4, "keys": [TENANT_KEYS["free"]]},
]
QUOTA_CALLS = ("take_quota", "resize_quota_hold", "settle_quota", "renew_quota_holds")


def _caller(names: frozenset[str]) -> tuple[str, Any]:
    """The nearest function on the running stack among `names` ("" if none) and its `self`:
    a coroutine's awaiters are on the stack while it runs."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name in names:
            return frame.f_code.co_name, frame.f_locals.get("self")
        frame = frame.f_back  # type: ignore[assignment]
    return "", None


@dataclass
class QuotaWatch:
    """Every quota hold's known size and its allowances past the tenant's limit."""

    tracker: Tracker
    preemptions: PreemptionWatch
    sizes: dict[str, int] = field(default_factory=dict)  # hold id -> blocks (last known)
    tenant_of: dict[str, str] = field(default_factory=dict)
    forced_growth: dict[str, int] = field(default_factory=dict)  # hold id -> blocks (`_grow`)
    forced_try: dict[str, int] = field(default_factory=dict)  # hold id -> blocks (`_try`)
    put_back: set[str] = field(default_factory=set)
    counts: Counter[str] = field(default_factory=Counter)

    def wrap(self, store: Any, replica: int) -> None:
        for name in QUOTA_CALLS:
            real = getattr(store, name)
            setattr(store, name, self._wrapped(name, real, replica))

    def _wrapped(
        self, name: str, real: Callable[..., Awaitable[Any]], replica: int
    ) -> Callable[..., Awaitable[Any]]:
        sig = inspect.signature(real)
        tracker = self.tracker

        async def call(*args: Any, **kwargs: Any) -> Any:
            a = sig.bind(*args, **kwargs).arguments
            tenant = a["tenant"]
            ids = set(a["holds"]) if name == "renew_quota_holds" else {a["hold_id"]}
            ids.discard("")
            keys = frozenset(f"q:{i}" for i in ids)
            seq = next(tracker._seq)
            tracker.inflight[seq] = (replica, tenant, keys)
            where, owner = _caller(frozenset({"_grow", "_try", "_after_preemption"}))
            forced = name == "resize_quota_hold" and a.get("force", False)
            if forced and where == "_grow":  # the growth of `owner`, a Reservation
                self.preemptions.classify(replica, "", owner.reservation_id, "tenant limit")
            if forced and a["blocks"] > self.sizes.get(a["hold_id"], 0):
                # Allowed before the call: it may land whatever the router hears.
                delta = a["blocks"] - self.sizes.get(a["hold_id"], 0)
                book = self.forced_growth if where == "_grow" else self.forced_try
                book[a["hold_id"]] = book.get(a["hold_id"], 0) + delta
                self.counts[f"forced hold growth ({where or 'elsewhere'})"] += 1
            start, outcome = time.time(), "cancelled"
            try:
                result = await real(*args, **kwargs)
                outcome = repr(result)[:60]
            except Exception as exc:
                outcome = repr(exc)[:60]
                raise
            finally:
                asyncio.get_running_loop().call_later(0.05, tracker.inflight.pop, seq, None)
                for key in keys:
                    tracker.history.setdefault(key, []).append(
                        (name, replica, start, time.time(), outcome)
                    )
            self._after(name, a, result)
            return result

        return call

    def _after(self, name: str, a: dict[str, Any], result: Any) -> None:
        if name == "take_quota" and result and a["hold_id"]:
            self.sizes[a["hold_id"]] = a["blocks"]
            self.tenant_of[a["hold_id"]] = a["tenant"]
        elif name == "resize_quota_hold" and result:
            self.sizes[a["hold_id"]] = a["blocks"]
        elif name == "renew_quota_holds":
            self.put_back.update(result)

    def allowance(self, hold_id: str) -> tuple[int, int]:
        """(counted forced growth, forced by a try's own reservation) of one hold."""
        return self.forced_growth.get(hold_id, 0), self.forced_try.get(hold_id, 0)


@dataclass
class PreemptionWatch:
    """What each replica's preemption rule chose, and every forced growth, classified."""

    # reservation id -> (when, the streams chosen) of each choice made for its growth
    choices: dict[str, list[tuple[float, tuple[str, ...]]]] = field(default_factory=dict)
    preemptors: dict[int, Any] = field(default_factory=dict)  # replica -> its Preemptor
    counts: Counter[str] = field(default_factory=Counter)
    violations: list[str] = field(default_factory=list)

    def wrap(self, gateway: Any, replica: int) -> None:
        preemptor = gateway.requests.answering.preemptor
        self.preemptors[replica] = preemptor
        real_choose = preemptor.choose

        def choose(grower_id: str, tenant: str, need: int, decode_id: str | None) -> Any:
            victims = real_choose(grower_id, tenant, need, decode_id)
            self.choices.setdefault(grower_id, []).append((time.time(), victims.stream_ids))
            if not victims and preemptor.enabled:
                # Nothing chosen: then the grower is no candidate and the tenant's others here
                # (on the worker when it is full) hold less than the growth needs.
                bound = preemptor.settings.max_per_stream
                others = [
                    s
                    for s in preemptor.live.values()
                    if s.reason is None
                    and s.tenant == tenant
                    and s.preempted < bound
                    and decode_id in (None, s.decode_id)
                ]
                if any(s.reservation_id == grower_id for s in others) or (
                    sum(s.blocks() for s in others) >= need
                ):
                    self.violations.append(
                        f"replica {replica}: the preemption rule chose nothing for {grower_id} "
                        f"(tenant {tenant}, {need} blocks on {decode_id}) among {others}"
                    )
            kind = "worker_full" if decode_id is not None else "tenant_limit"
            chosen = len(victims.stream_ids) if victims else "none"
            self.counts[f"preemption rule, {kind}: {chosen} chosen"] += 1
            return victims

        preemptor.choose = choose
        store = gateway.store
        real_resize = store.resize

        async def resize(
            worker_id: str, reservation_id: str, blocks: int, *, force: bool = False
        ) -> bool:
            if force:
                largest = max((w.capacity_blocks for w in gateway.pools.decode_workers), default=0)
                if blocks > largest:  # its continuation would fit nowhere (48efed6~: forced)
                    self.counts["forced growth (worker full): past every decode worker"] += 1
                else:
                    self.classify(replica, worker_id, reservation_id, "worker full")
            return bool(await real_resize(worker_id, reservation_id, blocks, force=force))

        store.resize = resize

    def classify(self, replica: int, worker: str, rid: str, why: str) -> None:
        """A growth of reservation `rid` is forced past a worker's capacity or its tenant's
        limit (`why`): say why the rule let it, or record a violation."""
        preemptor = self.preemptors[replica]
        stream = preemptor.live.get(rid)
        bound = preemptor.settings.max_per_stream
        if not preemptor.enabled:
            kind = "preemption off"
        elif stream is None:
            kind = "not preemptible (whole, n > 1, or not relayed)"
        elif stream.reason is not None:
            kind = "itself preempted meanwhile"
        elif preemptor._count.get(rid, 0) >= bound:
            kind = "at its preemption bound"
        else:
            # Since 48efed6 a grower whose victims' room did not come back preempts itself:
            # a candidate's growth is never forced, whatever was chosen for it.
            kind = "VIOLATION"
            self.violations.append(
                f"replica {replica}: reservation {rid} grew past its {why} {worker} by force "
                f"while it could itself be preempted ({stream}, preempted "
                f"{preemptor._count.get(rid, 0)} of {bound}); choices for it: "
                f"{self.choices.get(rid, [])}"
            )
        self.counts[f"forced growth ({why}): {kind}"] += 1
