"""Who is in the pools: the worker states by id, joining and leaving, and which pool each is in.

The configured workers are in from the start; the registry sync (router/workers/registry.py)
and the admin API add and remove the dynamic ones. A removed worker is remembered for a while,
for the requests still running their legs on it. A `both` worker is in one pool at a time, the
one its current role names (the store's, applied here by `apply_roles`); draining between the
two, in neither; broken by a failed engine switch (the record's mark), in neither until the
role manager has seen it serve its role again.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import Protocol

from router.config import Settings
from router.worker_spec import WorkerSpec, parse_worker
from router.workers.breaker import CircuitBreaker
from router.workers.dp_ranks import expand_ranks, is_lead, parent_id
from router.workers.worker_state import WorkerState
from state.base import WorkerRole

__all__ = ["Membership", "PoolMembers", "broken"]

# Removed workers kept for the requests still on them: a removal is an operator's act, so a
# few dozen is plenty, and bounded whatever an API client does.
_DEPARTED_KEPT = 64

log = logging.getLogger(__name__)


class PoolMembers(Protocol):
    """What the rotation rules (router/workers/rotation.py) read of the membership."""

    @property
    def settings(self) -> Settings: ...

    @property
    def workers(self) -> dict[str, WorkerState]: ...

    def can_prefill_locally(self, w: WorkerState) -> bool: ...


class Membership:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.workers: dict[str, WorkerState] = {}
        # A data-parallel entry's rank targets by the entry's id (router/workers/dp_ranks.py):
        # it joins, is replaced and leaves as one.
        self._ranks: dict[str, tuple[str, ...]] = {}
        # Workers removed while requests may still be on them (`worker`): the last few, by id.
        self._departed: dict[str, WorkerState] = {}
        # Kubernetes discovery's word on a discovered worker's pod (router/workers/kube/):
        # whether this replica's watch sees it Ready. Asked as such a worker joins, however it
        # joins (this replica's discovery, or another replica's registration read back).
        self.pod_readiness: Callable[[WorkerSpec], bool] | None = None
        # Told of every target as it joins (`on_join`): what waits for a kind of worker (a LoRA
        # engine, an https URL) is woken by its arrival instead of looking on a timer.
        self._on_join: list[Callable[[WorkerSpec], None]] = []
        for spec in settings.workers:
            self.add(spec)

    def __repr__(self) -> str:
        return f"Membership({list(self.workers.values())!r})"

    # -- joining and leaving ------------------------------------------------------------------
    def on_join(self, listener: Callable[[WorkerSpec], None]) -> None:
        """`listener(spec)` for every target in the pools now, then for each one that joins
        (however it joins: the configuration, the admin API, the registry, discovery) as it
        joins, and for a registration's worker before the registration first calls it
        (`announce`): before the router's first connection to any worker."""
        self._on_join.append(listener)
        for w in list(self.workers.values()):
            listener(w.spec)

    def announce(self, spec: WorkerSpec) -> None:
        """Worker `spec` joins, or is about to be called before it joins (a registration
        reading its facts, router/workers/registration.py): the `on_join` listeners told."""
        for listener in self._on_join:
            listener(spec)

    def add(
        self, spec: WorkerSpec, dynamic: bool = False, registration: str | None = None
    ) -> WorkerState:
        """The entry `spec` joins (replacing one of the same id): one target, or one per
        data-parallel rank (`<id>@<rank>`). Returns its lead (rank 0), which the health probe
        reaches its URL through."""
        targets = expand_ranks(spec)
        if spec.id in self._ranks:
            self._depart(spec.id)
        elif len(targets) > 1 and spec.id in self.workers:  # it was one target, now ranks
            self.remove(spec.id)
        states = [self._target(t, dynamic, registration) for t in targets]
        if len(targets) > 1:
            self._ranks[spec.id] = tuple(t.id for t in targets)
        return states[0]

    def _target(self, spec: WorkerSpec, dynamic: bool, registration: str | None) -> WorkerState:
        cap = spec.capacity_blocks if spec.is_decode else 0
        state = WorkerState(
            spec=spec,
            capacity_blocks=cap,
            dynamic=dynamic,
            registration=registration,
            breaker=CircuitBreaker(self.settings.breaker),
            layout_known=not spec.reads_server_facts,
            # A worker that joins at run time enters rotation once a health probe passes
            # (the admin API probes it at once; other replicas' probers within an interval).
            healthy=not dynamic,
        )
        if spec.pod and self.pod_readiness is not None:
            state.pod_ready = self.pod_readiness(spec)
        self.workers[spec.id] = state
        self.announce(spec)
        return state

    def remove(self, worker_id: str) -> bool:
        """Out of the pools at once (a data-parallel entry's id: all its ranks); requests
        already on it finish (releases go by id, their legs find it through `worker`)."""
        if worker_id in self._ranks:
            return self._depart(worker_id)
        state = self.workers.pop(worker_id, None)
        if state is None:
            return False
        self._departed.pop(worker_id, None)
        self._departed[worker_id] = state
        while len(self._departed) > _DEPARTED_KEPT:
            del self._departed[next(iter(self._departed))]
        return True

    def _depart(self, parent: str) -> bool:
        gone = False
        for rid in self._ranks.pop(parent, ()):
            gone = self.remove(rid) or gone
        return gone

    # -- entries and their ranks --------------------------------------------------------------
    def entry(self, entry_id: str) -> WorkerState | None:
        """The target standing for a worker entry (config file, registration): the worker
        itself, or its rank 0; None when no such entry is in the pools."""
        ranks = self._ranks.get(entry_id)
        return self.workers.get(ranks[0] if ranks else entry_id)

    def entry_ids(self) -> set[str]:
        """The ids of the entries in the pools (a data-parallel entry's once, not per rank)."""
        return {parent_id(w.spec) for w in self.workers.values()}

    def ranks_of(self, entry_id: str) -> list[WorkerState]:
        """An entry's targets: its ranks in order, or the worker alone."""
        ids = self._ranks.get(entry_id, (entry_id,))
        return [self.workers[i] for i in ids if i in self.workers]

    def probe_targets(self) -> list[WorkerState]:
        """One target per worker URL: the health prober's (the ranks follow: `follow_lead`)."""
        return [w for w in self.workers.values() if is_lead(w.spec)]

    def follow_lead(self, lead: WorkerState) -> None:
        """The URL's health and what it reported, copied from its lead to its other ranks:
        one server answers for all. Breakers stay each rank's own."""
        if not lead.spec.dp_parent:
            return
        for w in self.ranks_of(lead.spec.dp_parent):
            if w is lead:
                continue
            w.healthy, w.consecutive_failures = lead.healthy, lead.consecutive_failures
            w.layout_known = lead.layout_known
            if lead.layout_known and (
                w.spec.layout != lead.spec.layout
                or w.spec.bootstrap_port != lead.spec.bootstrap_port
            ):
                w.spec = replace(
                    w.spec, layout=lead.spec.layout, bootstrap_port=lead.spec.bootstrap_port
                )

    def worker(self, worker_id: str) -> WorkerState:
        """The worker an attempt was placed on, also when it has been removed since: its
        request still runs its legs there (KeyError only for an id never known)."""
        state = self.workers.get(worker_id)
        return state if state is not None else self._departed[worker_id]

    def parse_registration(self, raw: object) -> WorkerSpec:
        """A registration (the admin API's body, the store's registry entry) as a spec, with
        the configuration's defaults under it."""
        s = self.settings
        return parse_worker(raw, s.default_perf, s.default_layout, "registration")

    # -- the pools ----------------------------------------------------------------------------
    # A broken mark keeps a worker out whatever its record's role says (the role manager also
    # leaves it draining, so replicas of an older version keep it out too).
    @property
    def prefill_workers(self) -> Iterable[WorkerState]:
        return (w for w in self.workers.values() if w.in_prefill_pool and not broken(w))

    @property
    def decode_workers(self) -> Iterable[WorkerState]:
        return (w for w in self.workers.values() if w.in_decode_pool and not broken(w))

    @property
    def both_workers(self) -> Iterable[WorkerState]:
        return (w for w in self.workers.values() if w.spec.role == "both")

    # Whatever a worker's role now, the store's ledgers for each side it can serve are read:
    # a worker leaving decode still holds reservations, one leaving prefill stranded KV.
    @property
    def reservable(self) -> Iterable[WorkerState]:
        return (w for w in self.workers.values() if w.spec.is_decode)

    @property
    def strandable(self) -> Iterable[WorkerState]:
        return (w for w in self.workers.values() if w.spec.is_prefill)

    def can_prefill_locally(self, w: WorkerState) -> bool:
        """A decode-side `both` worker that may prefill its own requests (no role yet, or
        `roles.local_prefill`). Not an SGLang engine in PD mode: its decode side takes no
        request without a prefill partner."""
        if w.spec.role != "both":
            return False
        if w.spec.switches_engine_role and w.engine_role != "both":
            return False
        return w.role_state is None or self.settings.roles.local_prefill

    def unpaired(self) -> list[str]:
        """Workers whose KV layout matches no worker on the other side: never used for a
        handoff (a 'both' worker can still serve alone), reported so operators see it."""
        prefill_layouts = {w.spec.layout.key for w in self.prefill_workers}
        decode_layouts = {w.spec.layout.key for w in self.decode_workers}
        out = [w.spec.id for w in self.prefill_workers if w.spec.layout.key not in decode_layouts]
        out += [
            w.spec.id
            for w in self.decode_workers
            if w.spec.role == "decode" and w.spec.layout.key not in prefill_layouts
        ]
        return out

    def carrying_work(self) -> bool:
        """Some worker has legs of this replica's requests on it, or a placement being written:
        the replica is not quiet (router/loop_timing.py)."""
        return any(w.inflight or w.pending_blocks for w in self.workers.values())

    # -- the `both` workers' roles ------------------------------------------------------------
    def apply_roles(self, roles: dict[str, WorkerRole]) -> dict[str, WorkerRole]:
        """Take the store's roles of the `both` workers (logged on a change). A worker whose
        role the store no longer has keeps the one known here: a role is never removed while
        the worker is in the pools (deleting it removes both), so its absence means the store
        lost it (a Redis restarted empty), and falling back to no role would flip a worker
        forced to prefill back into decode. Returns those kept, for the registry sync to put
        back (not the role manager: a worker deleted meanwhile must not get its role back)."""
        kept: dict[str, WorkerRole] = {}
        for w in self.both_workers:
            record = roles.get(w.spec.id)
            if record is None and w.role_state is not None:
                kept[w.spec.id] = w.role_state
                continue
            if record != w.role_state:
                old = w.role_state if w.role_state is not None else None
                if record is not None and (old is None or old.role != record.role):
                    log.info("worker %s is now %s", w.spec.id, record.role)
                if record is not None and (old.broken if old else "") != record.broken:
                    if record.broken:
                        log.warning("worker %s is broken (%s): out of both pools until it "
                                    "serves its role again", w.spec.id, record.broken)  # fmt: skip
                    else:
                        log.info("worker %s serves its role again", w.spec.id)
                w.role_state = record
        return kept

    def role_view(self) -> dict[str, WorkerRole]:
        """The roles this replica knows, as of its last read or change."""
        return {w.spec.id: w.role_state for w in self.both_workers if w.role_state is not None}


def broken(w: WorkerState) -> str:
    """Why `w`'s engine's last role switch left it broken ("": it is not), as every replica
    reads it from the store's role record."""
    record = w.role_state
    return record.broken if record is not None else ""
