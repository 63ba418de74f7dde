"""A shared store that lost its data, noticed and answered: what this replica puts back.

Redis restarted empty, or a failover to an empty replica, loses every key at once: the decode
capacities, the registry of dynamic workers, the drains and roles, the tenants' shared API keys
(and revocations), the reservations and the stranded entries. The store keeps a marker key; a
check that finds it gone (after this replica's first use, which sets it) means the loss, and
every replica then puts back its own view within one refresh. The registry sync
(router/workers/registry.py) reads the marker with the registry (and, while this replica is
quiet, with the state refresher's usage, in one store call; a quiet replica reads when the
registry's change feed moves or its connection breaks, as a Redis restarted empty breaks it,
and every `registry_quiet_wait_s` at the latest), the state refresher
(router/workers/refresher.py) checks it on its own while busy; both hold `lock`, so one
put-back runs at a time.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from router.config import Settings
from router.tenants import Keyring
from router.workers.dp_ranks import parent_id
from router.workers.drain import drain_view
from router.workers.membership import Membership
from state.base import StateStore

__all__ = ["StoreLoss"]

log = logging.getLogger(__name__)


class StoreLoss:
    def __init__(
        self,
        settings: Settings,
        store: StateStore,
        members: Membership,
        on_reset: Callable[[], Awaitable[None]] | None = None,
        keyring: Keyring | None = None,
    ) -> None:
        """`on_reset`: what else to put back after the workers' own keys (the lease keeper's
        reservations and stranded entries); `keyring`: whose shared key table to put back."""
        self._settings = settings
        self._store = store
        self._members = members
        self._on_reset = on_reset
        self._keyring = keyring
        self.lock = asyncio.Lock()  # held by whoever reads the marker and may put back
        self._marker_seen = False
        self._put_back_owed = False

    def __repr__(self) -> str:
        return f"StoreLoss(marker_seen={self._marker_seen}, owed={self._put_back_owed})"

    @property
    def marker_ttl_s(self) -> float:
        return max(60.0, 10 * self._settings.leases.reservation_s)

    async def register_capacities(self) -> None:
        await asyncio.gather(
            *(
                self._store.set_capacity(w.spec.id, w.capacity_blocks)
                for w in self._members.reservable
            )
        )

    async def check(self) -> None:
        """Read the marker key and put back what this replica knows if it is gone."""
        async with self.lock:
            await self.put_back_if_lost(await self._store.check_marker(self.marker_ttl_s))

    async def put_back_if_lost(self, marker_missing: bool) -> bool:
        """After a marker check: if the store lost its data, put back capacities, the dynamic
        workers' registrations, drains and roles, then (`on_reset`) reservations and stranded
        entries; True if it did. Called with `lock` held."""
        first, self._marker_seen = not self._marker_seen, True
        if first:  # first use: start-up registers everything anyway
            return False
        if not marker_missing and not self._put_back_owed:
            return False
        log.warning(
            "the state store has lost its data (restarted empty?): putting back "
            "capacities, registrations, drains, roles, tenant keys, reservations and stranded "
            "entries"
        )
        # Owed until done: the marker now reads as present, so a put-back cut short by a
        # store error would otherwise never be finished.
        self._put_back_owed = True
        await self.register_capacities()
        members = self._members
        # One registration per entry: a data-parallel entry's ranks share theirs (its id's).
        dynamic = {
            parent_id(w.spec): w.registration or ""
            for w in members.workers.values()
            if w.dynamic and w.registration
        }
        await asyncio.gather(*(self._store.register_worker(i, r) for i, r in dynamic.items()))
        # Drains and roles as this replica last saw them. Every replica puts back its own view
        # (each learns of the loss from the marker), and the store keeps the freshest of them:
        # a drain mark by its time, a role by its version. So a drain another replica undid
        # just before the loss, which this replica still shows, is not brought back by it:
        # the undoing replica's later undrain mark wins, whichever writes first. (Were that
        # replica gone too, nobody would know of the undrain: the drain comes back, the safe
        # side — a drained worker takes no new work until the operator undrains it again.)
        await self._store.restore_registry(
            drain_view(members.workers.values()), members.role_view()
        )
        await self._put_back_keys()
        if self._on_reset is not None:
            await self._on_reset()
        self._put_back_owed = False
        return True

    async def _put_back_keys(self) -> None:
        """The tenant-key table as this replica last knew it. Every replica puts back its own
        and the store keeps their union, revocations winning (`restore_tenant_keys`): a key
        revoked on any replica stays revoked. Then this replica reads the table again."""
        keyring = self._keyring
        if keyring is None:
            return
        keys, revoked, version = keyring.shared_table()
        if keys or revoked:
            await self._store.restore_tenant_keys(keys, revoked, version)
        keyring.version = None  # unknown: the registry sync reads it again
