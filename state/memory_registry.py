"""`MemoryRegistry`: the worker registry half of `MemoryStore` — registrations, drains, the roles
of `both` workers, the role manager's lease, the store-loss marker and the put-back after a
loss, rule for rule as `RedisRegistry` (the conformance suite holds both to the same results).

One process has one `MemoryStore`, so its marker is lost only by its TTL lapsing (nothing else
empties it); the re-created-by-another-replica case of `RedisRegistry` cannot arise.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

from state.base import DrainMark, WorkerRole
from state.keys import check_id, check_lease, check_role

__all__ = ["MemoryRegistry"]


class MemoryRegistry:
    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._registry: dict[str, str] = {}
        self._drained: set[str] = set()
        self._drained_at: dict[str, float] = {}  # worker id -> its last drain or undrain
        self._roles: dict[str, WorkerRole] = {}
        self._leases: dict[str, tuple[str, float]] = {}  # name -> (holder, until)
        self._marker_until: float | None = None

    def _drop_worker(self, worker_id: str) -> None:
        """What the store keeps under `worker_id` outside the registry (`MemoryStore`'s)."""

    # -- worker registry ---------------------------------------------------------------------
    async def register_worker(self, worker_id: str, spec_json: str) -> None:
        self._registry[check_id("worker_id", worker_id)] = spec_json

    async def unregister_worker(self, worker_id: str) -> bool:
        wid = check_id("worker_id", worker_id)
        self._drained.discard(wid)
        self._drained_at.pop(wid, None)
        self._roles.pop(wid, None)
        self._drop_worker(wid)
        return self._registry.pop(wid, None) is not None

    async def registered_workers(self) -> dict[str, str]:
        return dict(self._registry)

    # -- drained workers ----------------------------------------------------------------------
    async def set_drained(self, worker_id: str, drained: bool) -> bool:
        wid = check_id("worker_id", worker_id)
        if drained == (wid in self._drained):
            return False
        if drained:
            self._drained.add(wid)
        else:
            self._drained.discard(wid)
        self._drained_at[wid] = self._clock()
        return True

    async def drained_workers(self) -> set[str]:
        return set(self._drained)

    async def drain_marks(self) -> dict[str, DrainMark]:
        ids = self._drained | set(self._drained_at)
        return {w: DrainMark(w in self._drained, self._drained_at.get(w, 0.0)) for w in ids}

    # -- roles of `both` workers ----------------------------------------------------------------
    async def worker_roles(self) -> dict[str, WorkerRole]:
        return dict(self._roles)

    async def set_role(self, worker_id: str, role: str, expect_version: int) -> WorkerRole | None:
        wid = check_id("worker_id", worker_id)
        check_role(role)
        current = self._roles.get(wid)
        if (current.version if current else 0) != expect_version:
            return None
        record = WorkerRole(role, expect_version + 1, self._clock())
        self._roles[wid] = record
        return record

    async def forget_role(self, worker_id: str) -> bool:
        return self._roles.pop(worker_id, None) is not None

    async def hold_lease(self, name: str, holder: str, ttl_s: float) -> bool:
        check_id("lease", name)
        check_lease(ttl_s)
        now = self._clock()
        current = self._leases.get(name)
        if current is not None and current[0] != holder and current[1] > now:
            return False
        self._leases[name] = (holder, now + ttl_s)
        return True

    async def release_lease(self, name: str, holder: str) -> bool:
        current = self._leases.get(name)
        if current is None or current[0] != holder:
            return False
        del self._leases[name]
        return True

    # -- after a store loss ---------------------------------------------------------------
    async def restore_registry(
        self, drains: Mapping[str, DrainMark], roles: Mapping[str, WorkerRole]
    ) -> None:
        for wid in (*drains, *roles):
            check_id("worker_id", wid)
        for role in roles.values():
            check_role(role.role)
        for wid, mark in drains.items():
            since = self._drained_at.get(wid)
            if since is None or since < mark.since_s:
                if mark.drained:
                    self._drained.add(wid)
                else:
                    self._drained.discard(wid)
                self._drained_at[wid] = mark.since_s
        for wid, role in roles.items():
            current = self._roles.get(wid)
            if current is None or current.version < role.version:
                self._roles[wid] = role

    # -- lifecycle ------------------------------------------------------------------------
    async def check_marker(self, ttl_s: float) -> bool:
        now = self._clock()
        missing = self._marker_until is None or self._marker_until <= now
        self._marker_until = now + max(1, int(ttl_s))
        return missing

    # -- one read for the registry sync ---------------------------------------------------------
    async def registry_view(
        self, marker_ttl_s: float
    ) -> tuple[bool, dict[str, str], dict[str, DrainMark], dict[str, WorkerRole]]:
        lost = await self.check_marker(marker_ttl_s)
        return lost, dict(self._registry), await self.drain_marks(), dict(self._roles)
