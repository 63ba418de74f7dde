"""The reservation invariants the state machine checks after every step, on one snapshot.

`snapshot` runs inside the cluster's loop and reads Redis with a blocking client in one
MULTI: no router code runs meanwhile, so the routers' views (each live replica's LeaseKeeper)
and the store are taken at the same instant; what the store may be ahead by is exactly the
store calls in flight (tests/sm_cluster.py `Tracker`).

- `exact`: every reservation the store holds (unexpired) is some live replica's, owed, in
  flight, or a killed replica's whose lease has not run out yet (and was not renewed since);
  every live reservation is in the store at the blocks the replica believes (unless the store
  was just reset, or a call on it is in flight); reserved <= capacity on each decode worker
  but for the blocks forced growth added (a growth with no room preempts first, issue 31: what
  is forced is classified by tests/sm_tenants.py `PreemptionWatch`) and the reservations a
  renewal put back; each reservation bounded by what the request can ever hold.
- tenants (issue 31): each limited tenant's holds in the store sum to its `hsum` key exactly,
  each unexpired hold is a live replica's (or in flight, or of a killed replica, or its settle
  failed: it expires by lease), and two or more holds never pass the tenant's
  max_reserved_blocks but by the blocks forced resizes added (one hold alone may: the store
  grants a tenant's only hold whatever its size, state/quotas.py).
- `quiet`: nothing reserved, nothing stranded, nothing live or owed anywhere; no quota hold in
  any router or the store, no live preemptible stream.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import redis

from policies.base import blocks_for
from state import Keys
from tests.sm_cluster import BLOCK, Cluster
from tests.sm_tenants import LIMITED

__all__ = ["Snapshot", "snapshot", "exact", "quiet", "RequestBound"]

KEYS = Keys("dr:")


@dataclass(frozen=True)
class RequestBound:
    """What one client request can hold at most: its prompt and every choice's max_tokens,
    grown by the router's growth steps (a quarter past what was sent, router/request/reserve.py)."""

    prompt_chars: int
    max_tokens: int
    n: int

    def max_blocks(self) -> int:
        prompt = self.prompt_chars // 4 + 64  # the chat template's tokens, generously
        output = int(1.25 * (self.n * self.max_tokens + self.n * BLOCK)) + 2
        # A resumed attempt's prompt holds what was sent before the resume.
        return blocks_for(prompt + self.n * self.max_tokens + output + self.n * BLOCK, BLOCK)


@dataclass
class Snapshot:
    now: float
    store_up: bool
    # worker -> reservation id -> (blocks, lease expiry)
    reservations: dict[str, dict[str, tuple[int, float]]] = field(default_factory=dict)
    sums: dict[str, int] = field(default_factory=dict)
    stranded: dict[str, dict[str, int]] = field(default_factory=dict)
    stranded_sums: dict[str, int] = field(default_factory=dict)
    live: dict[str, tuple[int, str, int]] = field(default_factory=dict)  # rid -> (rep, w, blocks)
    owed: set[str] = field(default_factory=set)
    strands: set[str] = field(default_factory=set)
    owed_ledger: set[str] = field(default_factory=set)
    inflight: set[str] = field(default_factory=set)
    capacity: dict[str, int] = field(default_factory=dict)  # decode workers in some replica's pools
    # limited tenant -> hold id -> (blocks, lease expiry); tenant -> its hsum key
    holds: dict[str, dict[str, tuple[int, float]]] = field(default_factory=dict)
    hsums: dict[str, int] = field(default_factory=dict)
    router_holds: dict[str, tuple[int, str, int]] = field(default_factory=dict)  # id -> rep, t, b
    preemptible: dict[int, list[str]] = field(default_factory=dict)  # replica -> live streams


def _read_store(client: redis.Redis, workers: list[str]) -> Any:
    pipe = client.pipeline(transaction=True)
    pipe.time()
    for w in workers:
        pipe.hgetall(KEYS.decode_blocks(w))
        pipe.zrange(KEYS.decode_leases(w), 0, -1, withscores=True)
        pipe.get(KEYS.decode_sum(w))
        pipe.hgetall(KEYS.stranded_bytes(w))
        pipe.get(KEYS.stranded_sum(w))
    for t in sorted(LIMITED):
        _, holds, hexp, hsum = KEYS.tenant_quota(t)
        pipe.hgetall(holds)
        pipe.zrange(hexp, 0, -1, withscores=True)
        pipe.get(hsum)
    return pipe.execute()


def snapshot(c: Cluster, client: redis.Redis) -> Snapshot:
    """Blocking on purpose (see the module docstring): call it from the cluster's loop."""
    workers = sorted(c.workers)
    try:
        raw = _read_store(client, workers)
    except redis.RedisError:
        raw = None
    snap = Snapshot(now=time.time(), store_up=raw is not None)
    for r in c.alive:
        leases = r.parts.leases
        for rid, wid in leases.live.items():
            snap.live[rid] = (r.index, wid, leases.expected.get(rid, (0, 0.0))[0])
        snap.owed |= set(leases.owed_releases)
        snap.strands |= set(leases.strands)
        snap.owed_ledger |= set(leases.owed_unstrands) | set(leases.owed_strands)
        for w in r.parts.pools.decode_workers:
            snap.capacity[w.spec.id] = w.spec.capacity_blocks
        for tenant, held in r.parts.requests.quota.holds.items():
            for hid, b in held.items():
                snap.router_holds[hid] = (r.index, tenant, b)
        live = r.parts.requests.answering.preemptor.live
        if live:
            snap.preemptible[r.index] = [repr(s) for s in live.values()]
    snap.inflight = c.tracker.inflight_rids()
    if raw is None:
        return snap
    secs, micros = raw[0]
    snap.now = int(secs) + int(micros) / 1e6
    for i, w in enumerate(workers):
        blocks, leases_, total, strand, strand_sum = raw[1 + 5 * i : 6 + 5 * i]
        expiry = {k.decode(): score for k, score in leases_}
        snap.reservations[w] = {
            k.decode(): (int(v), expiry.get(k.decode(), 0.0)) for k, v in blocks.items()
        }
        snap.sums[w] = int(total or 0)
        snap.stranded[w] = {k.decode(): int(v) for k, v in strand.items()}
        snap.stranded_sums[w] = int(strand_sum or 0)
    base = 1 + 5 * len(workers)
    for j, t in enumerate(sorted(LIMITED)):
        holds, hexp, hsum = raw[base + 3 * j : base + 3 * j + 3]
        expiry = {k.decode(): score for k, score in hexp}
        snap.holds[t] = {
            k.decode(): (int(v.split(b"|")[0]), expiry.get(k.decode(), 0.0))
            for k, v in holds.items()
        }
        snap.hsums[t] = int(hsum or 0)
    return snap


def exact(c: Cluster, s: Snapshot, bounds: Mapping[str, RequestBound]) -> list[str]:
    if not s.store_up:
        return []
    bad: list[str] = []
    settling = s.now < c.reset_until
    for w, held in s.reservations.items():
        unexpired = {rid: b for rid, (b, exp) in held.items() if exp > s.now}
        for rid, (blocks, exp) in held.items():
            if exp <= s.now:
                continue
            owner = s.live.get(rid)
            if owner is not None:
                if owner[1] != w:
                    bad.append(f"{rid} is held on {w} in the store, on {owner[1]} by its replica")
                elif owner[2] != blocks and rid not in s.inflight:
                    bad.append(f"{rid} on {w}: {blocks} blocks in the store, {owner[2]} live")
                continue
            if rid in s.owed or rid in s.inflight:
                continue
            if rid in c.orphans:
                if exp > c.orphans[rid]:
                    bad.append(f"{rid} of a killed replica renewed after its death on {w}")
                continue
            info = c.tracker.rids.get(rid)
            calls = [
                (n, rep, round(t0 - s.now, 3), round(t1 - s.now, 3), out)
                for n, rep, t0, t1, out in c.tracker.history.get(rid, [])
            ]
            bad.append(
                f"stranded reservation {rid} on {w} ({blocks} blocks, lease ends in "
                f"{exp - s.now:.3f} s, {info}); its calls (times from now): {calls}"
            )
        cap = s.capacity.get(w)
        if cap is not None and not settling:
            # Only what forced resizes added (a growth that found no room and could preempt
            # nothing, or whose victims' room did not come back in time: sm_tenants.py).
            growth = sum(c.tracker.forced.get(rid, 0) for rid in unexpired)
            # Known (bug table): new reservations take the room of reservations the store lost
            # before their renewal puts them back, over capacity.
            growth += sum(b for rid, b in unexpired.items() if rid in c.tracker.put_back)
            total = sum(unexpired.values())
            if total > cap + growth:
                bad.append(
                    f"{w}: {total} blocks reserved > capacity {cap} + forced growth {growth}"
                )
        for rid, b in unexpired.items():
            info = c.tracker.rids.get(rid)
            bound = bounds.get(info.request_id or "") if info is not None else None
            if bound is not None and b > bound.max_blocks():
                bad.append(f"{rid} on {w} grew to {b} blocks > {bound.max_blocks()} ({bound})")
    if not settling:
        for rid, (_, w, _) in s.live.items():
            if s.now < c.deleted_until.get(w, 0.0):
                continue
            blocks, exp = s.reservations.get(w, {}).get(rid, (0, 0.0))
            if exp <= s.now and rid not in s.inflight:
                state = "expired" if blocks else "missing"
                bad.append(f"live reservation {rid} on {w} is {state} in the store")
    bad += _tenant_holds(c, s, settling)
    bad += c.preemptions.violations
    return bad


def _tenant_holds(c: Cluster, s: Snapshot, settling: bool) -> list[str]:
    bad: list[str] = []
    watch = c.quotas
    for t, held in s.holds.items():
        if sum(b for b, _ in held.values()) != s.hsums[t]:
            bad.append(f"tenant {t}: holds {held} do not sum to its hsum {s.hsums[t]}")
        unexpired = {hid: b for hid, (b, exp) in held.items() if exp > s.now}
        for hid in unexpired:
            key = f"q:{hid}"
            if hid in s.router_holds or key in s.inflight:
                continue
            if key in c.orphans:
                continue
            calls = c.tracker.history.get(key, [])
            # A call that raised or was cancelled may have landed unseen: its lease ends it.
            if any(_failed(out) for *_, out in calls):
                continue
            bad.append(f"tenant {t}: stranded quota hold {hid} ({unexpired[hid]} blocks): {calls}")
        if settling or sum(1 for b in unexpired.values() if b > 0) < 2:
            continue
        total = sum(unexpired.values())
        grown = sum(watch.allowance(hid)[0] for hid in unexpired)
        by_try = sum(watch.allowance(hid)[1] for hid in unexpired)
        put_back = sum(b for hid, b in unexpired.items() if hid in watch.put_back)
        limit = LIMITED[t]
        if total > limit + grown + by_try + put_back:
            bad.append(
                f"tenant {t}: holds {unexpired} = {total} blocks > its limit {limit} + forced "
                f"growth {grown} + forced by tries {by_try} + put back {put_back}"
            )
        elif total > limit + grown + put_back:
            watch.counts["hold past the limit by a try's forced hold"] += 1
    return bad


def _failed(outcome: str) -> bool:
    return outcome == "cancelled" or "Error(" in outcome or "Exception(" in outcome


def quiet(s: Snapshot) -> list[str]:
    bad: list[str] = []
    if s.router_holds or s.preemptible:
        bad.append(f"routers still hold quota holds {s.router_holds}, streams {s.preemptible}")
    for t, held in s.holds.items():
        live = {hid: b for hid, (b, exp) in held.items() if exp > s.now}
        if live:
            bad.append(f"tenant {t}: quota holds left {live}")
    if s.live or s.owed or s.strands or s.owed_ledger:
        bad.append(
            f"routers still hold: live={sorted(s.live)} owed={sorted(s.owed)} "
            f"strands={sorted(s.strands)} owed ledger={sorted(s.owed_ledger)}"
        )
    if not s.store_up:
        return [*bad, "the store does not answer"]
    for w, held in s.reservations.items():
        live = {rid: b for rid, (b, exp) in held.items() if exp > s.now}
        if live:
            bad.append(f"{w}: reservations left {live}")
        elif w in s.capacity and (held or s.sums[w]):
            bad.append(f"{w}: expired reservations never purged: {held} sum={s.sums[w]}")
    for w, entries in s.stranded.items():
        if entries or s.stranded_sums[w]:
            bad.append(f"{w}: stranded KV left {entries} sum={s.stranded_sums[w]}")
    return bad
