"""The registry sync: workers registered or removed through any replica's admin API, adopted.

Every `registry_refresh_s` (and before an admin guard decides) this replica reads the shared
registry in one store call (`registry_view`: the loss marker, the registrations, the drain
marks and the `both` workers' roles) and makes its membership match: a new registration joins
(probed at once when a session is given: it enters rotation when it answers), a changed one
replaces the old, a missing one leaves; drains and roles are applied. A store that lost its
data is put back first (router/workers/store_loss.py), and read again.
"""

from __future__ import annotations

import asyncio
import logging

import aiohttp
import orjson

from router.config import ConfigError, Settings
from router.workers.drain import apply_drained
from router.workers.health_probe import HealthProber
from router.workers.loop_timing import LoopTiming
from router.workers.membership import Membership
from router.workers.store_loss import StoreLoss
from router.workers.worker_state import WorkerState
from state.base import StateStore, StoreError

__all__ = ["RegistrySync"]

log = logging.getLogger(__name__)


class RegistrySync:
    def __init__(
        self,
        settings: Settings,
        store: StateStore,
        members: Membership,
        loss: StoreLoss,
        prober: HealthProber,
        timing: LoopTiming,
    ) -> None:
        self._settings = settings
        self._store = store
        self._members = members
        self._loss = loss
        self._prober = prober
        self._timing = timing

    def __repr__(self) -> str:
        return f"RegistrySync(every {self._settings.registry_refresh_s} s)"

    async def sync(self, session: aiohttp.ClientSession | None = None) -> None:
        """Adopt the registry as the store has it now; with a `session`, a newly adopted
        worker is probed at once. One store call, two after a loss."""
        store, loss, members = self._store, self._loss, self._members
        async with loss.lock:
            lost, registered, drained, roles = await store.registry_view(loss.marker_ttl_s)
            # A store that lost its data has lost the registry too: put ours back first, and
            # read again, or every dynamic worker would look removed.
            if await loss.put_back_if_lost(lost):
                _, registered, drained, roles = await store.registry_view(loss.marker_ttl_s)
        joined: list[WorkerState] = []
        for wid, blob in registered.items():
            try:
                spec = members.parse_registration(orjson.loads(blob))
            except (ConfigError, orjson.JSONDecodeError, TypeError, ValueError) as exc:
                log.warning("ignoring bad registration of %s: %s", wid, exc)
                continue
            current = members.workers.get(wid)
            if current is None or (current.dynamic and current.spec != spec):
                joined.append(members.add(spec, dynamic=True, registration=blob))
                if spec.is_decode:
                    await store.set_capacity(spec.id, spec.capacity_blocks)
                log.info("worker %s (%s) joined the pools", wid, spec.role)
        gone = [
            w.spec.id for w in members.workers.values() if w.dynamic and w.spec.id not in registered
        ]
        for wid in gone:
            members.remove(wid)
            log.info("worker %s left the pools", wid)
        apply_drained(members.workers.values(), drained)
        if any(True for _ in members.both_workers) and (kept := members.apply_roles(roles)):
            log.warning("the store lost the roles of %s: putting them back", ", ".join(kept))
            await store.restore_registry({}, kept)
        if session is not None and joined:
            await asyncio.gather(*(self._prober.probe(session, w) for w in joined))

    async def run(self, session: aiohttp.ClientSession | None = None) -> None:
        while True:
            await self._timing.beat(self._settings.registry_refresh_s)
            try:
                await self.sync(session)
            except asyncio.CancelledError:
                raise
            except StoreError as exc:  # the refresher reports the outage once
                log.debug("registry sync failed: %s", exc)
            except Exception as exc:
                log.warning("registry sync failed: %r", exc)
