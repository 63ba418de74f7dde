"""The hold-back after a decode worker's capacity is re-created (docs/reliability.md row 16).

A store that lost a worker's keys (Redis restarted empty; the worker deleted and registered
again) has lost its reservations too, while their sequences still occupy the worker. Each
replica puts its own back at its next renewal round (`renew_many`: over capacity if need be,
since those sequences are there). A replica that restores the capacity first would otherwise
admit new reservations into that room, and the put-backs would land on top of them.

So when a capacity is written where the store has none (missing or 0) by a store object that
had written it before — a loss or a re-registration, not a first start — the store holds new
reservations back on that worker until a deadline on its own clock: `reserve` refuses (no room
now: the request waits in admission), a non-forced growth too, while renewals and put-backs
land. The length is agreed in the store, not taken from one replica's settings: every replica
publishes how long it may let pass between two renewal rounds (`advertise_renewal`) with each
store-loss marker check, the store keeps the longest for a marker TTL, and every store object
remembers the last value it read — so the replica that restores the capacity after a loss holds
back for the slowest replica's round, whatever its own lease. The replica that finds the marker
missing publishes that remembered value again, so a second loss before the slow replica's next
check is covered as well.

The hold is that longest round plus a margin for the round's own time (its store call, a busy
event loop): half of it, at least `HOLD_MARGIN_MIN_S`. A replica whose round runs later than
that puts back over capacity as before; a renewal later than its lease loses the reservation
anyway, loss or not.
"""

from __future__ import annotations

__all__ = ["HOLD_MARGIN_MIN_S", "RenewalHorizon", "hold_for"]

HOLD_MARGIN_MIN_S = 1.0


def hold_for(renew_within_s: float) -> float:
    """The hold-back for a cluster whose slowest renewal round comes every `renew_within_s`."""
    if renew_within_s <= 0:
        return 0.0
    return renew_within_s + max(HOLD_MARGIN_MIN_S, renew_within_s / 2)


class RenewalHorizon:
    """One store object's side of the agreement: what its replica publishes, the longest round
    it last read from the store, and the workers whose capacity it has written."""

    __slots__ = ("own_s", "agreed_s", "known")

    def __init__(self) -> None:
        self.own_s = 0.0  # this replica's longest gap between renewal rounds (0: none said)
        self.agreed_s = 0.0  # the longest any replica published, as last read
        self.known: set[str] = set()  # decode workers this store object gave a capacity

    def advertise(self, renew_within_s: float) -> None:
        if not renew_within_s >= 0 or renew_within_s == float("inf"):
            raise ValueError(f"renew_within_s must be finite and >= 0, got {renew_within_s}")
        # Several lease keepers on one store object (one process): the slowest counts.
        self.own_s = max(self.own_s, float(renew_within_s))

    def carried(self) -> float:
        """What to publish where the store lost the value: the longest known round."""
        return max(self.own_s, self.agreed_s)

    def read(self, published_s: float, lost: bool) -> None:
        """The store's longest published round, read with a marker check. After a loss the
        store's value starts over (only what was published since), so the one remembered
        stays; otherwise the store's is the truth (a slow replica that left stops counting once
        its entry's TTL runs out)."""
        seen = max(published_s, self.own_s)
        self.agreed_s = max(self.agreed_s, seen) if lost else seen

    def hold_s(self, worker_id: str) -> float:
        """The hold-back to ask for when writing `worker_id`'s capacity: none on the first write
        by this store object (a start, a new worker), the agreed one on a later write (the
        store applies it only if it had no capacity: a loss or a re-registration)."""
        if worker_id not in self.known:
            self.known.add(worker_id)
            return 0.0
        return hold_for(max(self.agreed_s, self.own_s))

    def __repr__(self) -> str:
        return f"RenewalHorizon(own={self.own_s}s, agreed={self.agreed_s}s)"
