"""`MemoryRegistry`: the worker registry half of `MemoryStore` — registrations, drains, the roles
of `both` workers, the role manager's lease, the store-loss marker, the put-back after a loss
and the tenants' key table, rule for rule as `RedisRegistry` (the conformance suite holds both
to the same results).

One process has one `MemoryStore`, so its marker is lost only by its TTL lapsing (nothing else
empties it); the re-created-by-another-replica case of `RedisRegistry` cannot arise.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping

from state.base import DrainMark, RegistryFeed, RegistryView, TenantKey, TenantKeys, WorkerRole
from state.holdback import RenewalHorizon
from state.keys import check_digest, check_id, check_lease, check_role, check_tenant_key
from state.registry_feed import FeedCounter, MemoryRegistryFeed

__all__ = ["MemoryRegistry"]


class MemoryRegistry:
    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._registry: dict[str, str] = {}
        self._drained: set[str] = set()
        self._drained_at: dict[str, float] = {}  # worker id -> its last drain or undrain
        self._roles: dict[str, WorkerRole] = {}
        self._leases: dict[str, tuple[str, float]] = {}  # name -> (holder, until)
        self._demands: dict[str, tuple[float, str]] = {}  # replica -> (when, its demand)
        self._marker_until: float | None = None
        # The hold-back agreement (state/holdback.py): this object's side, and the longest
        # renewal round published with the marker, until when.
        self._horizon = RenewalHorizon()
        self._renewal: tuple[float, float] | None = None
        self._tkeys: dict[str, TenantKey] = {}  # key id -> its key (digest)
        self._trevoked: set[str] = set()
        self._tversion = 0
        # Told of every registry change, as the Redis scripts append to the feed.
        self._changes = FeedCounter()

    def _drop_worker(self, worker_id: str) -> None:
        """What the store keeps under `worker_id` outside the registry (`MemoryStore`'s)."""

    # -- worker registry ---------------------------------------------------------------------
    async def register_worker(self, worker_id: str, spec_json: str) -> None:
        wid = check_id("worker_id", worker_id)
        if self._registry.get(wid) != spec_json:
            self._registry[wid] = spec_json
            self._changes.fed()

    async def unregister_worker(self, worker_id: str) -> bool:
        wid = check_id("worker_id", worker_id)
        self._drained.discard(wid)
        self._drained_at.pop(wid, None)
        self._roles.pop(wid, None)
        self._drop_worker(wid)
        self._changes.fed()
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
        self._changes.fed()
        return True

    async def drained_workers(self) -> set[str]:
        return set(self._drained)

    async def drain_marks(self) -> dict[str, DrainMark]:
        ids = self._drained | set(self._drained_at)
        return {w: DrainMark(w in self._drained, self._drained_at.get(w, 0.0)) for w in ids}

    # -- roles of `both` workers ----------------------------------------------------------------
    async def worker_roles(self) -> dict[str, WorkerRole]:
        return dict(self._roles)

    async def set_role(
        self, worker_id: str, role: str, expect_version: int, broken: str = ""
    ) -> WorkerRole | None:
        wid = check_id("worker_id", worker_id)
        check_role(role)
        current = self._roles.get(wid)
        if (current.version if current else 0) != expect_version:
            return None
        record = WorkerRole(role, expect_version + 1, self._clock(), broken)
        self._roles[wid] = record
        self._changes.fed()
        return record

    async def forget_role(self, worker_id: str) -> bool:
        had = self._roles.pop(worker_id, None) is not None
        if had:
            self._changes.fed()
        return had

    async def publish_demand(self, replica: str, payload: str, max_age_s: float) -> None:
        check_id("replica", replica)
        check_lease(max_age_s)
        self._demands[replica] = (self._clock(), payload)
        self._prune_demands(max_age_s)

    async def replica_demands(self, max_age_s: float) -> dict[str, str]:
        check_lease(max_age_s)
        self._prune_demands(max_age_s)
        return {replica: payload for replica, (_, payload) in self._demands.items()}

    def _prune_demands(self, max_age_s: float) -> None:
        now = self._clock()
        for replica in [r for r, (at, _) in self._demands.items() if now - at > max_age_s]:
            del self._demands[replica]

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
        before = (set(self._drained), dict(self._drained_at), dict(self._roles))
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
        if (self._drained, self._drained_at, self._roles) != before:
            self._changes.fed()

    # -- tenants' API keys ------------------------------------------------------------------
    async def put_tenant_key(
        self, key_id: str, tenant: str, digest_hex: str, source: str = "admin", replaces: str = ""
    ) -> int:
        check_tenant_key(key_id, tenant, digest_hex, source)
        if replaces:
            check_digest(replaces)
        if digest_hex in self._trevoked:
            return 0
        current = self._tkeys.get(key_id)
        for old in (current.digest_hex if current else "", replaces):
            if old and old != digest_hex:
                self._trevoked.add(old)
        self._tkeys[key_id] = TenantKey(tenant, digest_hex, source)
        self._tversion += 1
        self._changes.fed()
        return self._tversion

    async def revoke_tenant_key(self, key_id: str, digest_hex: str = "") -> int:
        check_id("key_id", key_id)
        if digest_hex:
            self._trevoked.add(check_digest(digest_hex))
        current = self._tkeys.pop(key_id, None)
        if current is not None:
            self._trevoked.add(current.digest_hex)
        self._tversion += 1
        self._changes.fed()
        return self._tversion

    async def tenant_keys(self) -> TenantKeys:
        return TenantKeys(self._tversion, dict(self._tkeys), frozenset(self._trevoked))

    async def restore_tenant_keys(
        self, keys: Mapping[str, TenantKey], revoked: Iterable[str], known_version: int
    ) -> int:
        revoked = [check_digest(d) for d in revoked]
        for key_id, key in keys.items():
            check_tenant_key(key_id, key.tenant, key.digest_hex, key.source)
        before = (dict(self._tkeys), set(self._trevoked))
        self._trevoked.update(revoked)
        for key_id, key in list(self._tkeys.items()):
            if key.digest_hex in self._trevoked:
                del self._tkeys[key_id]
        for key_id, key in keys.items():
            if key.digest_hex not in self._trevoked and key_id not in self._tkeys:
                self._tkeys[key_id] = key
        if (self._tkeys, self._trevoked) != before:
            self._tversion = max(self._tversion, known_version) + 1
            self._changes.fed()
        return self._tversion

    # -- the change feed (state/registry_feed.py) ------------------------------------------
    def registry_feed(self, longest_wait_s: float) -> RegistryFeed:
        return MemoryRegistryFeed(self._changes)

    # -- lifecycle ------------------------------------------------------------------------
    def advertise_renewal(self, renew_within_s: float) -> None:
        self._horizon.advertise(renew_within_s)

    async def check_marker(self, ttl_s: float) -> bool:
        now = self._clock()
        missing = self._marker_until is None or self._marker_until <= now
        self._marker_until = now + max(1, int(ttl_s))
        if missing:
            self._changes.fed()
        # Published as `RedisRegistry`'s marker script does (registry_scripts.py `marker`).
        h = self._horizon
        published = h.carried() if missing else h.own_s
        current = self._renewal if self._renewal and self._renewal[1] > now else None
        if published > 0 and (current is None or published >= current[0]):
            current = (published, self._marker_until)
        self._renewal = current
        h.read(current[0] if current else 0.0, missing)
        return missing

    # -- one read for the registry sync ---------------------------------------------------------
    async def registry_view(self, marker_ttl_s: float) -> RegistryView:
        lost = await self.check_marker(marker_ttl_s)
        marks = await self.drain_marks()
        return RegistryView(lost, dict(self._registry), marks, dict(self._roles), self._tversion)
