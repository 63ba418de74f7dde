"""The state store interface shared by every router replica (docs/design.md §5).

Two implementations pass one conformance suite (tests/state/test_state_conformance.py):
`RedisStore` (the default: Lua scripts, one hash tag per worker so it runs on Redis Cluster)
and `MemoryStore` (in-process, for a single router with no Redis).

What lives here:
- decode reservations: per decode worker a capacity in KV blocks and leased reservations;
- the stranded-KV ledger: per prefill worker, KV built by prefill and not yet accepted by decode,
  written with the reservation (pending while its prefill runs);
- the cluster-wide retry budget;
- output-length histograms, so every replica's estimator learns from every completion;
- the tenants' API keys made, rotated or revoked through any replica's admin API (digests only,
  never a key: `TenantKeys`);
- the tenants' quotas: request and token buckets, and the decode blocks each tenant holds
  (state/quotas.py).

The store knows nothing of HTTP or of placement; times are seconds.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from state.fair_shares import FairSlot, FairView
from state.quotas import Quota, QuotaTaken

__all__ = [
    "DecodeUsage",
    "RegistryFeed",
    "DrainMark",
    "Finished",
    "Reserved",
    "StrandIntent",
    "StrandedEntry",
    "RetryBudgetPolicy",
    "TenantKey",
    "TenantKeys",
    "RegistryView",
    "UsageView",
    "WorkerRole",
    "ROLE_STATES",
    "StateStore",
    "StoreBusy",
    "StoreError",
]


class StoreError(Exception):
    """A store call failed: the store is unreachable, timed out, its connection pool stayed
    full past its timeout, or it answered with an error. The router answers 503 with
    Retry-After (router.errors maps it); nothing the call was to record may be assumed."""


class StoreBusy(StoreError):
    """No store connection came free within the pool's wait: the store answers, but this
    router has more calls in flight than connections — an overload of the router, shed with
    429 + Retry-After like any other (the call was not sent)."""


@dataclass(frozen=True, slots=True)
class DecodeUsage:
    capacity_blocks: int
    reserved_blocks: int
    reservations: int

    @property
    def free_blocks(self) -> int:
        return self.capacity_blocks - self.reserved_blocks


@dataclass(frozen=True, slots=True)
class StrandedEntry:
    prefill_id: str
    request_id: str
    nbytes: int
    # Store clock (unix seconds) when the KV became ready; for an entry still pending (its
    # prefill has not answered), the latest time it can become ready.
    since_s: float


@dataclass(frozen=True, slots=True)
class StrandIntent:
    """A stranded-KV entry written with the reservation, before the prefill is sent: the KV
    `nbytes` the prefill will leave on `prefill_id`. It is *pending* until the prefill answers
    (`StateStore.mark_ready`); until then the reaper counts its KV lease from
    `ready_within_s` ahead, the longest the prefill may take, so a live prefill's entry is
    never reaped."""

    prefill_id: str
    request_id: str  # the entry's id in the prefill worker's ledger
    nbytes: int
    ready_within_s: float


@dataclass(frozen=True, slots=True)
class Reserved:
    """What `StateStore.reserve` did. True when the blocks are held, so ``if await
    store.reserve(...)`` reads as before.

    `stranded`: the intent is in the ledger now. One server or the memory store write it in
    the reservation's own step, only when the blocks are held; a cluster writes it alongside
    (another slot, another node), so it may be there for a refused reservation (the caller
    unstrands it) or missing for a held one (the caller writes it later)."""

    held: bool
    stranded: bool = False

    def __bool__(self) -> bool:
        return self.held


# A `both` (kv_both) worker's current role: serving prefill or decode, or leaving the other one
# for it (no new work of the old kind while what it holds finishes; none of the new kind yet).
ROLE_STATES = ("prefill", "decode", "draining-to-prefill", "draining-to-decode")


@dataclass(frozen=True, slots=True)
class WorkerRole:
    """A `both` worker's role as every replica sees it. `version` counts its changes: a change
    is a compare-and-set on it, so two replicas cannot both flip the same worker."""

    role: str  # one of ROLE_STATES
    version: int
    since_s: float  # store clock (unix seconds) of the last change
    # Why its engine's last role switch left it broken ("": it is not). Kept in the record, not
    # on one replica, so every replica keeps the worker out of both pools (the role manager
    # writes it with the role's compare-and-set, and clears it only once the engine has proved
    # it serves its role again: router/workers/engine_role.py).
    broken: str = ""

    @property
    def target(self) -> str:
        """The role it serves or is heading to."""
        return self.role.removeprefix("draining-to-")

    @property
    def draining(self) -> bool:
        return self.role.startswith("draining-to-")


@dataclass(frozen=True, slots=True)
class DrainMark:
    """A worker's last drain or undrain as the store recorded it. An undrain is kept too (a
    mark with `drained` False), so that after a store loss a replica's stale view of a drain
    loses to another replica's later undrain (`StateStore.restore_registry`)."""

    drained: bool
    since_s: float  # store clock (unix seconds) of that change; 0: unknown (an older writer)


class RegistryView(tuple[bool, dict[str, str], dict[str, DrainMark], dict[str, WorkerRole]]):
    """`StateStore.registry_view`: (data lost, registrations, drain marks, roles), and, read in
    the same call, `keys_version`: the tenant-key table's version (`TenantKeys.version`), so a
    replica learns that the table changed without a store call of its own. A tuple still (it
    compares and unpacks as the 4-tuple it always was); the version rides as an attribute."""

    keys_version: int

    def __new__(
        cls,
        lost: bool,
        workers: dict[str, str],
        drains: dict[str, DrainMark],
        roles: dict[str, WorkerRole],
        keys_version: int = 0,
    ) -> RegistryView:
        view = super().__new__(cls, (lost, workers, drains, roles))
        view.keys_version = keys_version
        return view


TENANT_KEY_SOURCES = ("admin", "config")


@dataclass(frozen=True, slots=True)
class TenantKey:
    """One API key in the shared table, as its SHA-256 digest (64 lowercase hex digits): never
    the key. `source`: "admin" (made or rotated through the admin API) or "config"."""

    tenant: str
    digest_hex: str
    source: str = "admin"


@dataclass(frozen=True, slots=True)
class TenantKeys:
    """`StateStore.tenant_keys`: the shared key table as one consistent snapshot. `version`
    counts its changes (0: never changed, or the store lost it); `revoked` holds the digest of
    every key revoked or rotated out (a configured key's too), so it stays refused wherever and
    whenever a replica starts. A digest, once revoked, never comes back."""

    version: int
    keys: Mapping[str, TenantKey]  # key id -> its key
    revoked: frozenset[str]

    def __repr__(self) -> str:
        return f"TenantKeys(v{self.version}, keys={len(self.keys)}, revoked={len(self.revoked)})"


# `StateStore.usage_view`: (usage per decode worker, stranded bytes per prefill worker).
UsageView = tuple[dict[str, DecodeUsage], dict[str, int]]


@dataclass(frozen=True, slots=True)
class RetryBudgetPolicy:
    """Finagle-style budget: retries are allowed while
    retries <= ratio * requests + min_per_s * window."""

    ratio: float = 0.2
    min_per_s: float = 10.0
    window_s: float = 10.0


@dataclass(frozen=True, slots=True)
class Finished:
    """What `StateStore.finish` did, step by step: None where that step failed (the others
    still ran), so the caller retries exactly the steps that did not happen."""

    released_blocks: int | None = 0  # blocks the reservation held (0: already gone)
    unstranded_bytes: int | None = 0
    recorded: bool = True

    @property
    def complete(self) -> bool:
        return (
            self.released_blocks is not None and self.unstranded_bytes is not None and self.recorded
        )


class RegistryFeed(Protocol):
    """A wait for the next change to the shared registry (state/registry_feed.py: on Redis
    and in process)."""

    async def start(self) -> None:
        """Wait from here: before the registry read the next `wait` follows. Raises
        `StoreError` when the store cannot be reached."""

    async def wait(self, timeout_s: float) -> bool:
        """Until the registry changed since the last wait (or `start`): True; or its
        connection was lost, or it was started again (the changes meanwhile unknown): True;
        or `timeout_s` passed with no change: False. A wait after a lost connection starts
        again first (and raises `StoreError` if it cannot)."""
        ...

    @property
    def listening(self) -> bool:
        """Started, and its connection not lost since."""
        ...

    async def close(self) -> None: ...


@runtime_checkable
class StateStore(Protocol):
    # -- decode reservations -------------------------------------------------------------
    async def set_capacity(self, worker_id: str, capacity_blocks: int) -> None:
        """Declare (or change) a decode worker's KV capacity in blocks. Written where the store
        has none (missing or 0) by a store object that wrote it before — the store lost it, or
        the worker was deleted and registered again — it starts a hold-back: no new
        reservation on the worker for the longest renewal round any replica published plus a
        margin, so the live reservations' put-backs land first (state/holdback.py)."""

    async def reserve(
        self,
        worker_id: str,
        reservation_id: str,
        blocks: int,
        lease_s: float,
        overbook_blocks: int = 0,
        intent: StrandIntent | None = None,
    ) -> Reserved:
        """Atomically: drop expired leases, then hold `blocks` if free + overbook >= blocks
        and no hold-back runs on the worker (`set_capacity`; refused as no room now).

        Idempotent per id. `overbook_blocks` (prediction-based admission) lets a reservation
        count on blocks forecast to free before its prefill ends; 0 = only room free now.
        `intent`: also record the prefill's stranded KV, pending, in the same round trip (see
        `Reserved.stranded` for where it may differ from the reservation's outcome)."""

    async def renew(self, worker_id: str, reservation_id: str, lease_s: float) -> bool:
        """Extend a live reservation's lease. False if it no longer exists (expired or released)."""

    async def resize(
        self, worker_id: str, reservation_id: str, blocks: int, *, force: bool = False
    ) -> bool:
        """Grow or shrink a live reservation to `blocks`. Growth needs free room and no
        hold-back running (False if not) unless `force`: the answer already occupies that room,
        so the count follows use."""

    async def renew_many(
        self, worker_id: str, reservations: Mapping[str, int], lease_s: float
    ) -> list[str]:
        """Extend the leases of `reservations` ({id: blocks}) on one worker in one call; an id
        the store no longer holds (it lost it: expired while unreachable, or restarted empty)
        is put back at its blocks, over capacity if need be, because its sequence really
        occupies the worker. Returns the ids that were put back."""

    async def release(self, worker_id: str, reservation_id: str) -> int:
        """Drop a reservation; returns the blocks it held (0 if it was already gone)."""

    async def decode_usage(self, worker_ids: Iterable[str]) -> dict[str, DecodeUsage]:
        """Capacity and live reserved blocks per worker (expired leases not counted)."""

    # -- stranded KV ledger --------------------------------------------------------------
    async def strand(
        self, prefill_id: str, request_id: str, nbytes: int, ready_in_s: float = 0.0
    ) -> None:
        """Record KV built on a prefill worker that no decode has accepted yet, ready at
        now + `ready_in_s` (negative: ready that long ago; positive: pending, ready by then at
        the latest). A repeated call updates the size and keeps the first time."""

    async def mark_ready(self, prefill_id: str, request_id: str, age_s: float = 0.0) -> bool:
        """The prefill answered `age_s` ago: a pending entry's KV lease counts from then.
        Never creates an entry: marking one already unstranded (a late or reordered call)
        does nothing and returns False, so it cannot leave a stale entry behind."""

    async def unstrand(self, prefill_id: str, request_id: str) -> int:
        """Decode accepted (or the request ended): returns the bytes cleared, 0 if absent."""

    async def stranded_bytes(self, prefill_ids: Iterable[str]) -> dict[str, int]: ...

    async def reap_stranded(self, prefill_id: str, older_than_s: float) -> list[StrandedEntry]:
        """Remove and return entries older than `older_than_s` seconds (the KV lease). A
        pending entry's age counts from its ready-by time, so it outlives its prefill."""

    # -- the end of a request ---------------------------------------------------------------
    async def finish(
        self,
        release: tuple[str, str] | None = None,
        unstrand: tuple[str, str] | None = None,
        record: tuple[Sequence[str], int] | None = None,
    ) -> Finished:
        """The end-of-request bookkeeping in one round trip, each step independent of the
        others: release `(decode worker, reservation id)`, unstrand `(prefill worker, request
        id)`, record `(class keys, bucket)`. A step that fails is None/False in the result;
        raises StoreError only when the store could not be reached at all."""

    # -- retry budget ----------------------------------------------------------------------
    async def note_request(self, count: int = 1) -> None:
        """Count `count` first attempts toward the budget's window."""

    async def try_retry(self, policy: RetryBudgetPolicy) -> bool:
        """Atomically spend one retry if the cluster-wide budget allows it."""

    # -- output-length statistics ----------------------------------------------------------
    async def record_output(self, class_keys: Sequence[str], bucket: int) -> None:
        """Count one completed request's true output length (as a bucket) under each class."""

    async def output_histograms(self, class_keys: Sequence[str]) -> dict[str, Mapping[int, int]]:
        """{class key: {bucket: count}} for the keys asked (missing keys map to {})."""

    # -- worker registry (dynamic pools, shared by every replica) ---------------------------
    async def register_worker(self, worker_id: str, spec_json: str) -> None: ...

    async def unregister_worker(self, worker_id: str) -> bool:
        """Forget `worker_id` entirely: its registration and every key kept under its id (a
        decode worker's capacity, reservations and leases; a prefill worker's stranded
        ledger; its drain mark; its role). True if it was registered. A request still on it
        finishes: its release finds nothing to release."""

    async def registered_workers(self) -> dict[str, str]: ...

    # -- drained workers (no new placements; shared by every replica) -----------------------
    async def set_drained(self, worker_id: str, drained: bool) -> bool:
        """Mark `worker_id` drained (True) or back in use (False); True if that changed it
        (then its `DrainMark` records the change at the store's clock)."""

    async def drained_workers(self) -> set[str]:
        """The ids of every drained worker."""

    async def drain_marks(self) -> dict[str, DrainMark]:
        """Every worker's last drain change: the drained ones and those undrained since."""

    # -- roles of `both` workers (shared by every replica) ------------------------------------
    async def worker_roles(self) -> dict[str, WorkerRole]:
        """Every `both` worker's current role (workers never given one are absent)."""

    async def set_role(
        self, worker_id: str, role: str, expect_version: int, broken: str = ""
    ) -> WorkerRole | None:
        """Set `worker_id`'s role to `role` (one of ROLE_STATES), with its `broken` mark ("":
        none), if its version is still `expect_version` (0: it has none yet); returns the new
        record, or None when another change came first (nothing written)."""

    async def forget_role(self, worker_id: str) -> bool:
        """Drop `worker_id`'s role (it left the pools); True if it had one."""

    async def hold_lease(self, name: str, holder: str, ttl_s: float) -> bool:
        """Take the lease `name` for `holder`, or extend it if `holder` has it already; False
        while another holder's lease is live. One replica decides roles at a time."""

    async def release_lease(self, name: str, holder: str) -> bool:
        """Give the lease back if `holder` has it (True), so another replica need not wait."""

    # -- every replica's demand, for the role manager's leader (shared by every replica) -------
    async def publish_demand(self, replica: str, payload: str, max_age_s: float) -> None:
        """Set `replica`'s demand entry to `payload` (the caller's encoding), stamped with the
        store's clock; entries older than `max_age_s` are dropped."""

    async def replica_demands(self, max_age_s: float) -> dict[str, str]:
        """Every replica's demand entry no older than `max_age_s` (older ones are dropped)."""

    # -- after a store loss ---------------------------------------------------------------
    async def restore_registry(
        self, drains: Mapping[str, DrainMark], roles: Mapping[str, WorkerRole]
    ) -> None:
        """Put back a replica's last-known drain marks and roles after the store lost them.
        Every replica calls this with its own view, so the store keeps the freshest: a mark is
        written only where the store has none or an older one (earlier `since_s`), a role only
        where it has none or a lower version. A replica's stale "drained" thus never undoes
        another's later undrain, whichever puts back first."""

    # -- tenants' API keys (shared by every replica; router/tenants.py) ------------------------
    async def put_tenant_key(
        self, key_id: str, tenant: str, digest_hex: str, source: str = "admin", replaces: str = ""
    ) -> int:
        """Set `key_id` to the key of digest `digest_hex`, of `tenant`, in one atomic change:
        the digest the id held before (if another) and `replaces` (if given: a rotated
        configured key's) are revoked with it. Returns the table's new version, or 0 when
        `digest_hex` itself is revoked (nothing written: a revoked key never comes back)."""

    async def revoke_tenant_key(self, key_id: str, digest_hex: str = "") -> int:
        """Revoke the key `key_id` holds (and `digest_hex`, if given: a configured key's, which
        the table does not hold) and drop the id. Returns the table's new version."""

    async def tenant_keys(self) -> TenantKeys:
        """The whole table in one consistent read (one script on Redis)."""

    async def restore_tenant_keys(
        self, keys: Mapping[str, TenantKey], revoked: Iterable[str], known_version: int
    ) -> int:
        """After a store loss, put back a replica's last-known table. Every replica calls this
        with its own, so the store keeps their union, revocations first: every digest in
        `revoked` is revoked (and an id holding one dropped), then a key is written where its id
        is free and its digest not revoked. If that changed anything the version becomes
        max(the store's, `known_version`) + 1, so every replica reads the table again. Returns
        the version."""

    # -- tenants' quotas (state/quotas.py: the rules) -------------------------------------------
    async def take_quota(
        self,
        tenant: str,
        quota: Quota,
        hold_id: str,
        tokens: int,
        blocks: int,
        lease_s: float,
        ends_in_s: float,
    ) -> QuotaTaken:
        """Atomically, for `tenant` under `quota`: one request, `tokens` tokens and (where
        blocks are limited) a hold of `blocks` under `hold_id` for `lease_s`, expected to end in
        `ends_in_s` — all of them, or nothing and the limit that refused with when to retry."""

    async def settle_quota(
        self,
        tenant: str,
        quota: Quota,
        hold_id: str,
        correction: int,
        refund_request: bool = False,
    ) -> int:
        """A request of `tenant` ended: drop its hold (`hold_id`; "" for none), correct its
        tokens by `correction` (actual − charged) and, with `refund_request`, give back the
        request it took (the cluster refused it). Returns the blocks the hold had (0: gone)."""

    async def resize_quota_hold(
        self,
        tenant: str,
        quota: Quota,
        hold_id: str,
        blocks: int,
        lease_s: float,
        force: bool = False,
    ) -> QuotaTaken:
        """Atomically: the hold `hold_id` of `tenant` becomes `blocks` (its request's
        reservation grew, or a new try holds another), unless that takes the tenant past
        `max_reserved_blocks` (not granted, nothing changed; `force` grants it anyway: the
        blocks are held on the worker). A lost hold is put back. The rules: state/quotas.py."""

    async def renew_quota_holds(
        self, tenant: str, holds: Mapping[str, int], lease_s: float
    ) -> list[str]:
        """Extend the leases of `tenant`'s holds `holds` ({id: blocks}) in one call; one the
        store lost is put back. Returns the ids put back."""

    # -- the cluster's fair share (state/fair_shares.py: the steps) -------------------------------
    async def fair_sync(
        self,
        replica: str,
        charges: Mapping[FairSlot, float],
        waiting: Mapping[FairSlot, tuple[int, float]],
        lease_s: float,
        holding: Mapping[FairSlot, int] | None = None,
    ) -> FairView:
        """One replica's share of the fairness state, once a sync period: add its `charges`
        ({(class, tenant): units / weight} since its last call; a tenant that was waiting nowhere
        lifted to its class's floor first), register its `waiting` ({(class, tenant): (requests,
        oldest's age s)}) and `holding` ({(class, tenant): decode blocks}), replacing its
        previous ones, for `lease_s`, and read back the floors, the counters of the tenants
        waiting anywhere and of those named, every live waiter and the blocks each tenant holds
        over the replicas. One script on Redis (one slot)."""

    async def fair_claim(
        self, wanted: Mapping[str, tuple[int, int]], owner: str, ttl_s: float
    ) -> dict[str, int]:
        """Before a take-back: for each waiter line `name` -> (its requests waiting, how many of
        them `owner` means to make room for), claim up to that many of its requests for `ttl_s`
        — the first ones no replica claimed in that time. Returns the requests claimed per
        line: two replicas that read the same waiter preempt for it once, not once each. One
        script on Redis (the `{fair}` slot)."""
        ...

    async def fair_nudge(self, replica: str, line: FairSlot | None = None) -> None:
        """Tell `replica` that room was left for its waiters (router/fair_share.py's hand-off),
        so that it reads the store now rather than at its next refresh; `line` (class, tenant):
        the waiters a take-back made the room for, whom `replica` wakes before its order's next.
        Best effort: a nudge nobody hears costs the waiter one refresh period, nothing more."""

    def fair_nudges(self, replica: str) -> AsyncIterator[FairSlot | None]:
        """The nudges sent to `replica`, one item each (its line, or None), as they come, until
        the caller stops reading (closing the iterator unsubscribes). StoreError when the store
        is down."""
        ...

    # -- lifecycle ------------------------------------------------------------------------
    def advertise_renewal(self, renew_within_s: float) -> None:
        """This replica lets at most `renew_within_s` pass between two renewal rounds of its
        live leases (router/leases.py). Published with every marker check; the store keeps the
        longest any replica published and sizes its hold-backs on it (`set_capacity`). No I/O."""

    async def check_marker(self, ttl_s: float) -> bool:
        """Keep a marker key alive for `ttl_s`; True when it was missing (first use, or the
        store lost its data: a Redis restarted empty) or, on Redis, when another replica has
        re-created it since this store object last looked. So every replica learns of a loss
        within one check and puts back what it holds (capacities, registrations, drains,
        roles, reservations, stranded entries), not only the first to look."""

    async def ping(self) -> bool: ...

    async def close(self) -> None: ...

    def registry_feed(self, longest_wait_s: float) -> RegistryFeed:
        """A wait for the next change to what `registry_view` reads (state/registry_feed.py):
        every store call that changes it also feeds it, so a quiet replica can wait for that
        instead of reading the registry every `registry_refresh_s`. On Redis it holds a
        connection of its own (blocking reads of up to `longest_wait_s`); no I/O until
        `start`."""
        ...

    # -- one read for the registry sync (router/workers/registry.py) -------------------------------
    async def registry_view(self, marker_ttl_s: float) -> RegistryView:
        """`check_marker(marker_ttl_s)`, `registered_workers()`, `drain_marks()` and
        `worker_roles()` in one store call (one round trip on Redis: the keys share the
        registry's hash tag): (data lost, registrations, drain marks, roles), with the tenant
        keys' version as `keys_version`. A busy replica reads this every `registry_refresh_s`, a
        quiet one when `registry_feed` moves, and the key table only when that version
        changed."""

    # -- one read for the state refresher (router/workers/refresher.py) ----------------------------
    async def usage_view(
        self, decode_ids: Iterable[str], prefill_ids: Iterable[str]
    ) -> tuple[dict[str, DecodeUsage], dict[str, int]]:
        """`decode_usage(decode_ids)` and `stranded_bytes(prefill_ids)` in one store call (one
        pipeline on Redis: one round trip on one server, one per node on a cluster). A replica
        reads this every `state_refresh_s` while busy; while quiet, with the registry sync's reads
        (`registry_and_usage_view`)."""
        ...

    # -- one read for a quiet beat (router/workers/registry.py carries the refresher's read) -------
    async def registry_and_usage_view(
        self, marker_ttl_s: float, decode_ids: Iterable[str], prefill_ids: Iterable[str]
    ) -> tuple[RegistryView, UsageView]:
        """`registry_view(marker_ttl_s)` and `usage_view(decode_ids, prefill_ids)` in one store
        call: what a quiet replica reads when it reads (its registry sync and its state
        refresher together). On one Redis server one script, so one round trip; on a cluster
        one pipeline, a round trip per node that holds the keys (the registry's ``{reg}`` tag
        and each worker's own tag are different slots, so no one script can read them all)."""
        ...
