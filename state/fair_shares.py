"""The cluster's fair share, kept in the store so that every router replica orders its admission
queue by the same virtual counters (issue 33; the policy: policies/fairness.py `vtc`).

What is shared, per priority class: each tenant's virtual counter (VTC: units served / weight),
the class's floor, and who waits and holds where — per replica, each tenant it has waiting (how
many requests, since when) and the decode blocks its admitted requests hold there. A replica
does not write on a request's path: it adds up the charges of its admissions and settlements
and sends them, with its waiting tenants and holdings, in one call a sync period (`fair_sync`,
router/fair_share.py), and reads back the counters of every tenant waiting anywhere, the
floors, every replica's waiters and every tenant's holdings. So a request costs no store round
trip for its fairness; a busy replica one call a period.

**The arithmetic of one `fair_sync`** (the Redis script, state/fair_scripts.py, does the same
steps; the conformance suite holds both to the same results):

1. Registrations whose lease passed are dropped (a replica that died stops renewing); the
   tenants still registered are the ones waiting before this call. Then the calling replica's
   own are dropped (it sends all of its waiters each time).
2. Each class's floor is raised to the least counter of the tenants waiting in it before this
   call, never lowered.
3. A tenant named by this call (a charge, or waiting here) that was waiting nowhere is lifted to
   its class's floor (`max(counter, floor)`): idle time is not banked, as VTC lifts a tenant
   that starts to wait. Then its charge is added (a settlement's refund may be negative).
4. This replica's waiters and holdings are registered with the lease (a registration of a tenant
   that holds blocks but has nothing waiting counts as no waiter).
5. A class in which nobody waits now: its floor follows the counters charged by this call (the
   last to leave), never down.
6. Counters at or below their floor of tenants that wait nowhere are forgotten when the table
   grows past `SWEEP_ABOVE` (lossless: they would be lifted to it).

The answer: every class's floor, the counters of the tenants waiting anywhere and of those
this call named (holdings included), every live waiter with how long its oldest request has
waited, and the blocks each tenant holds, summed over the replicas.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

__all__ = [
    "SWEEP_ABOVE",
    "FairSlot",
    "FairTable",
    "FairView",
    "FairWaiter",
    "check_fair_sync",
    "check_nudge_line",
    "decode_nudge_line",
    "encode_nudge_line",
    "fair_sync_now",
]

# (priority class, tenant): what a counter and a registration are kept under.
FairSlot = tuple[int, str]

# Counters remembered before idle ones at or below their floor are swept.
SWEEP_ABOVE = 4096


@dataclass(frozen=True, slots=True)
class FairWaiter:
    """One replica's waiting requests of one tenant in one class."""

    replica: str
    priority: int
    tenant: str
    count: int
    waited_s: float  # how long its oldest request has waited, on the store's clock, now


@dataclass(frozen=True, slots=True)
class FairView:
    """What `fair_sync` answers."""

    counters: Mapping[FairSlot, float] = field(default_factory=dict)
    floors: Mapping[int, float] = field(default_factory=dict)
    waiters: tuple[FairWaiter, ...] = ()
    held: Mapping[FairSlot, int] = field(default_factory=dict)  # over every replica
    # Every replica with a live registration (waiting or holding), sorted: the ones a replica
    # whose first waiter starts a wait on a quiet cluster tells (router/fair_share.py).
    replicas: tuple[str, ...] = ()


@dataclass(slots=True)
class _Registration:
    count: int  # 0: it only holds blocks
    since: float
    expires: float
    held: int = 0


@dataclass(slots=True)
class FairTable:
    """The shared state as the memory store keeps it (a hash and a hash on Redis)."""

    counters: dict[FairSlot, float] = field(default_factory=dict)
    floors: dict[int, float] = field(default_factory=dict)
    # (replica, priority, tenant) -> its registration
    waiting: dict[tuple[str, int, str], _Registration] = field(default_factory=dict)


def check_fair_sync(
    replica: str,
    charges: Mapping[FairSlot, float],
    waiting: Mapping[FairSlot, tuple[int, float]],
    lease_s: float,
    holding: Mapping[FairSlot, int] | None = None,
) -> None:
    """Bad arguments raise ValueError before anything is written (both stores alike)."""
    holding = holding or {}
    for blocks in holding.values():
        if not isinstance(blocks, int) or blocks < 0:
            raise ValueError(f"held blocks must be an int >= 0, got {blocks!r}")
    if not replica or "|" in replica or "{" in replica or "}" in replica:
        raise ValueError(f"replica must be a non-empty name without '|' or braces: {replica!r}")
    if not (math.isfinite(lease_s) and lease_s > 0):
        raise ValueError(f"lease_s must be a positive finite number, got {lease_s}")
    for slot in (*charges, *waiting, *holding):
        _check_slot(slot)
    for amount in charges.values():
        if not math.isfinite(amount):
            raise ValueError(f"a charge must be finite, got {amount}")
    for count, age in waiting.values():
        if count < 1 or not (math.isfinite(age) and age >= 0):
            raise ValueError(f"a waiter needs count >= 1 and age >= 0, got {count}, {age}")


def _check_slot(slot: FairSlot) -> None:
    """A (class, tenant) as the store keeps it: a tenant the "|" separator cannot split, an
    int class (ValueError else)."""
    priority, tenant = slot
    if not tenant or "|" in tenant:
        raise ValueError(f"tenant must be a non-empty name without '|': {tenant!r}")
    if not isinstance(priority, int):
        raise ValueError(f"priority must be an int, got {priority!r}")


def check_nudge_line(line: FairSlot) -> None:
    """A nudge's line names a class and a tenant as a registration does, and its class is not
    a bool (sent as "True", it would not read back as an int) (ValueError else)."""
    if isinstance(line[0], bool):
        raise ValueError(f"priority must be an int, got {line[0]!r}")
    _check_slot(line)


def encode_nudge_line(line: FairSlot | None) -> bytes:
    """A nudge's message on the store's pub/sub: b"" for none, else b"<class>|<tenant>"."""
    if line is None:
        return b""
    check_nudge_line(line)
    return f"{line[0]}|{line[1]}".encode()


def decode_nudge_line(data: object) -> FairSlot | None:
    """The line a nudge names, None for a bare nudge or one this version cannot read (a
    replica of another version: the nudge still wakes the queue, by its order)."""
    if isinstance(data, bytes):
        data = data.decode(errors="replace")
    if not isinstance(data, str) or "|" not in data:
        return None
    priority, _, tenant = data.partition("|")
    try:
        line = (int(priority), tenant)
        check_nudge_line(line)
    except ValueError:
        return None
    return line


def fair_sync_now(
    table: FairTable,
    now: float,
    replica: str,
    charges: Mapping[FairSlot, float],
    waiting: Mapping[FairSlot, tuple[int, float]],
    lease_s: float,
    holding: Mapping[FairSlot, int] | None = None,
) -> FairView:
    """One `fair_sync` applied to `table` at store time `now` (the module's steps)."""
    holding = holding or {}
    # 1. expired registrations, and this replica's previous ones
    live = {k: r for k, r in table.waiting.items() if r.expires > now}
    waiting_before = {(p, t) for (_, p, t), r in live.items() if r.count > 0}
    table.waiting = {k: r for k, r in live.items() if k[0] != replica}
    # 2. floors up to the least waiting counter
    _raise_floors(table, waiting_before)
    # 3. lift and charge
    for slot in _ordered(set(charges) | set(waiting)):
        floor = table.floors.get(slot[0], 0.0)
        if slot not in waiting_before:
            table.counters[slot] = max(table.counters.get(slot, floor), floor)
        table.counters[slot] = table.counters.get(slot, floor) + charges.get(slot, 0.0)
    # 4. register
    for priority, tenant in _ordered(set(waiting) | set(holding)):
        count, age = waiting.get((priority, tenant), (0, 0.0))
        blocks = holding.get((priority, tenant), 0)
        if count or blocks:
            table.waiting[(replica, priority, tenant)] = _Registration(
                int(count), now - age, now + lease_s, int(blocks)
            )
    waiting_now = {(p, t) for (_, p, t), r in table.waiting.items() if r.count > 0}
    # 5. a class nobody waits in: the floor follows what this call charged
    for slot in charges:
        priority = slot[0]
        if not any(p == priority for p, _ in waiting_now):
            _raise_floor(table, priority, table.counters[slot])
    _raise_floors(table, waiting_now)
    # 6. sweep
    if len(table.counters) > SWEEP_ABOVE:
        table.counters = {
            s: c
            for s, c in table.counters.items()
            if s in waiting_now or c > table.floors.get(s[0], 0.0)
        }
    named = waiting_now | set(charges) | set(waiting) | set(holding)
    held: dict[FairSlot, int] = {}
    for (_, p, t), reg in table.waiting.items():
        if reg.held:
            held[(p, t)] = held.get((p, t), 0) + reg.held
    named |= set(held)
    return FairView(
        counters={s: table.counters.get(s, table.floors.get(s[0], 0.0)) for s in _ordered(named)},
        floors=dict(table.floors),
        waiters=tuple(
            FairWaiter(r, p, t, reg.count, max(0.0, now - reg.since))
            for (r, p, t), reg in sorted(table.waiting.items())
            if reg.count > 0
        ),
        held=dict(sorted(held.items())),
        replicas=tuple(sorted({r for r, _, _ in table.waiting})),
    )


def _raise_floors(table: FairTable, waiting: Iterable[FairSlot]) -> None:
    least: dict[int, float] = {}
    for slot in waiting:
        counter = table.counters.get(slot)
        if counter is not None:
            least[slot[0]] = min(least.get(slot[0], counter), counter)
    for priority, counter in least.items():
        _raise_floor(table, priority, counter)


def _raise_floor(table: FairTable, priority: int, counter: float) -> None:
    # Kept only once above 0 (what an absent floor reads as), as the script does.
    if counter > table.floors.get(priority, 0.0):
        table.floors[priority] = counter


def _ordered(slots: Iterable[FairSlot]) -> list[FairSlot]:
    return sorted(slots)
