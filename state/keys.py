"""Every Redis key name and TTL the state stores use, in one place.

Keys are built by a `Keys` value object from a prefix (default ``"dr:"``), so tests and
several deployments can share one Redis without touching each other's keys.

Hash tags (the ``{...}`` part) decide the Redis Cluster slot. Every Lua script touches the keys
of one tag only, so each script runs on one node. The one exception is for one server only: the
reservation with its stranded-KV intent (a ``{d:...}`` and a ``{p:...}`` worker in one script);
on a cluster the two are separate scripts sent at once (state/redis_store.py):

=============================  ======  =============================================================
key                            type    meaning
=============================  ======  =============================================================
``<p>{d:<worker>}:cap``        string  decode worker's KV capacity in blocks
``<p>{d:<worker>}:res``        hash    reservation id -> blocks held
``<p>{d:<worker>}:lease``      zset    reservation id -> lease expiry (unix s)
``<p>{d:<worker>}:sum``        string  sum of the ``:res`` values, kept exact by the scripts
``<p>{d:<worker>}:hold``       string  no new reservation before this (unix s; state/holdback.py)
``<p>{p:<worker>}:bytes``      hash    request id -> stranded KV bytes on that prefill worker
``<p>{p:<worker>}:since``      zset    request id -> when its KV was (pending: will be) ready
``<p>{p:<worker>}:sum``        string  sum of the ``:bytes`` values
``<p>{rb}:req``                hash    unix second -> first attempts counted in that second
``<p>{rb}:retry``              hash    unix second -> retries spent in that second
``<p>{os:<class>}``            hash    output-length bucket -> completed requests of that class
``<p>{reg}:workers``           hash    worker id -> its registration (JSON), shared by replicas
``<p>{reg}:marker``            string  present while the store keeps its data (TTL, refreshed)
``<p>{reg}:renewal``           string  longest gap between renewal rounds any replica published, TTL
``<p>{reg}:drained``           set     ids of drained workers: no new placements, shared by replicas
``<p>{reg}:drained_at``        hash    worker id -> when it was last drained or undrained (unix s)
``<p>{reg}:roles``             hash    `both` worker id -> "role|version|since[|broken]" (its role)
``<p>{reg}:lease:<name>``      string  holder of a lease (one replica runs the role manager), TTL
``<p>{reg}:tkeys``             hash    API key id -> "tenant|sha256 hex|source" (never a key)
``<p>{reg}:tkeys:revoked``     set     sha256 hex of every key revoked or rotated out
``<p>{reg}:tkeys:version``     string  the key table's version, +1 on every change
``<p>{reg}:demand``            hash    replica -> "when|its demand" for the role manager (pruned)
``<p>{reg}:feed``              stream  an entry per registry change (capped), for quiet replicas
``<p>{t:<tenant>}:q``          hash    a tenant's quota buckets (levels, when) (state/quotas.py)
``<p>{t:<tenant>}:holds``      hash    quota hold id -> "blocks|expected end" (blocks limited)
``<p>{t:<tenant>}:hexp``       zset    quota hold id -> lease expiry (unix s)
``<p>{t:<tenant>}:hsum``       string  sum of the ``:holds`` blocks
``<p>{fair}:vtc``              hash    "<class>|<tenant>" -> its virtual counter (fair_shares.py)
``<p>{fair}:wait``             hash    "<replica>|<class>|<tenant>" -> "count|since|expires"
``<p>{fair}:floor``            hash    class -> its floor (a tenant that starts to wait is lifted)
=============================  ======  =============================================================

Every key that names a worker (its ``{d:..}`` and ``{p:..}`` keys, its field in the ``{reg}``
hashes and set) is listed by `Keys.worker_keys` / `Keys.registry_fields`, which is what
`unregister_worker` deletes.

The retry-budget hashes keep one field per second; the scripts drop fields older than
`RETRY_RETENTION_S` and give both hashes a TTL a bit over it, so a quiet cluster leaves nothing
behind. A policy's window must therefore fit in the retention.

The tenant-key table (router/tenants.py) is under the registry's tag too: each change is one
script on one slot, and the registry sync reads its version in the registry's own round trip.
It has no TTL: the revoked set grows by one digest per revocation or rotation (64 bytes each).

Reservation and ledger hashes/zsets need no TTL: Redis deletes a hash or zset when its last field
goes, and the scripts drop expired leases on every call.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from state.base import ROLE_STATES, TENANT_KEY_SOURCES, RetryBudgetPolicy

__all__ = [
    "Keys",
    "check_id",
    "check_count",
    "check_lease",
    "check_policy",
    "check_digest",
    "check_tenant_key",
    "RETRY_RETENTION_S",
    "RETRY_TTL_S",
    "DEFAULT_PREFIX",
]

DEFAULT_PREFIX = "dr:"

# The longest retry-budget window a policy may ask for: per-second buckets older than this are
# pruned. Finagle's default window is 10 s; a minute leaves room without letting the hash grow.
RETRY_RETENTION_S = 60

# TTL of the retry-budget hashes, refreshed on every write: a bit over the retention so a bucket
# still inside the window never vanishes early, and a quiet cluster's budget state goes away.
RETRY_TTL_S = RETRY_RETENTION_S + 5


def check_id(kind: str, value: str) -> str:
    """Reject ids that would break a hash tag (or be empty); returns the id unchanged.

    A ``{`` or ``}`` inside an id would move the tag boundary, so two keys of one worker could
    land in different cluster slots and a script touching both would fail on a cluster.
    """
    if not value:
        raise ValueError(f"{kind} must be a non-empty string")
    if "{" in value or "}" in value:
        raise ValueError(f"{kind} must not contain '{{' or '}}': {value!r}")
    return value


# Argument checks shared by both stores, so they reject the same calls the same way.
def check_count(name: str, value: int) -> None:
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")


def check_role(role: str) -> None:
    if role not in ROLE_STATES:
        raise ValueError(f"role must be one of {', '.join(ROLE_STATES)}, not {role!r}")


def check_lease(lease_s: float) -> None:
    if not lease_s > 0 or math.isinf(lease_s):
        raise ValueError(f"lease_s must be a positive finite number, got {lease_s}")


_HEX = frozenset("0123456789abcdef")


def check_tenant_key(key_id: str, tenant: str, digest_hex: str, source: str = "admin") -> None:
    """A tenant-key record's fields: a digest is 64 lowercase hex digits (so no plain key can
    be stored by mistake: a key of ours is longer, and not hex), no '|' (the record's separator)
    in the tenant, a known source."""
    check_digest(digest_hex)
    check_id("key_id", key_id)
    if not tenant or "|" in tenant:
        raise ValueError(f"tenant must be a non-empty name without '|': {tenant!r}")
    if source not in TENANT_KEY_SOURCES:
        raise ValueError(f"source must be one of {', '.join(TENANT_KEY_SOURCES)}")


def check_quota_take(hold_id: str, tokens: int, blocks: int, lease_s: float) -> None:
    """`take_quota`'s arguments, checked alike by both stores."""
    check_id("hold_id", hold_id)
    check_count("tokens", tokens)
    check_count("blocks", blocks)
    check_lease(lease_s)


def check_digest(digest_hex: str) -> str:
    if len(digest_hex) != 64 or not _HEX.issuperset(digest_hex):
        raise ValueError("a key digest must be 64 lowercase hex digits (sha256)")
    return digest_hex


def check_policy(policy: RetryBudgetPolicy) -> None:
    if not 0 < policy.window_s <= RETRY_RETENTION_S:
        raise ValueError(
            f"retry budget window_s must be in (0, {RETRY_RETENTION_S}], got {policy.window_s}"
        )
    if policy.ratio < 0 or policy.min_per_s < 0:
        raise ValueError(f"retry budget ratio and min_per_s must be >= 0: {policy!r}")


@dataclass(frozen=True, slots=True)
class Keys:
    """Key names of one deployment, all under `prefix`."""

    prefix: str = DEFAULT_PREFIX

    def __post_init__(self) -> None:
        # A brace in the prefix would become the hash tag of every key, pinning everything to
        # one slot (and breaking the per-worker tags).
        if "{" in self.prefix or "}" in self.prefix:
            raise ValueError(f"key prefix must not contain braces: {self.prefix!r}")

    # -- decode reservations -------------------------------------------------------------
    def _decode(self, worker_id: str) -> str:
        return f"{self.prefix}{{d:{check_id('worker_id', worker_id)}}}"

    def decode_capacity(self, worker_id: str) -> str:
        return f"{self._decode(worker_id)}:cap"

    def decode_blocks(self, worker_id: str) -> str:
        return f"{self._decode(worker_id)}:res"

    def decode_leases(self, worker_id: str) -> str:
        return f"{self._decode(worker_id)}:lease"

    def decode_sum(self, worker_id: str) -> str:
        return f"{self._decode(worker_id)}:sum"

    def decode_hold(self, worker_id: str) -> str:
        """Until when the worker takes no new reservation (state/holdback.py)."""
        return f"{self._decode(worker_id)}:hold"

    def decode_worker(self, worker_id: str) -> list[str]:
        """The four keys of one decode worker, in the order the reservation scripts take them."""
        return [
            self.decode_capacity(worker_id),
            self.decode_blocks(worker_id),
            self.decode_leases(worker_id),
            self.decode_sum(worker_id),
        ]

    # -- stranded KV ledger --------------------------------------------------------------
    def _prefill(self, prefill_id: str) -> str:
        return f"{self.prefix}{{p:{check_id('prefill_id', prefill_id)}}}"

    def stranded_bytes(self, prefill_id: str) -> str:
        return f"{self._prefill(prefill_id)}:bytes"

    def stranded_since(self, prefill_id: str) -> str:
        return f"{self._prefill(prefill_id)}:since"

    def stranded_sum(self, prefill_id: str) -> str:
        return f"{self._prefill(prefill_id)}:sum"

    def stranded_worker(self, prefill_id: str) -> list[str]:
        """The three ledger keys of one prefill worker, in the order the scripts take them."""
        return [
            self.stranded_bytes(prefill_id),
            self.stranded_since(prefill_id),
            self.stranded_sum(prefill_id),
        ]

    # -- retry budget ----------------------------------------------------------------------
    @property
    def retry_requests(self) -> str:
        return f"{self.prefix}{{rb}}:req"

    @property
    def retry_retries(self) -> str:
        return f"{self.prefix}{{rb}}:retry"

    # -- output-length statistics ----------------------------------------------------------
    def output_stats(self, class_key: str) -> str:
        return f"{self.prefix}{{os:{check_id('class_key', class_key)}}}"

    # -- worker registry ---------------------------------------------------------------------
    @property
    def workers(self) -> str:
        return f"{self.prefix}{{reg}}:workers"

    @property
    def drained(self) -> str:
        return f"{self.prefix}{{reg}}:drained"

    @property
    def drained_at(self) -> str:
        return f"{self.prefix}{{reg}}:drained_at"

    @property
    def roles(self) -> str:
        return f"{self.prefix}{{reg}}:roles"

    def registry_fields(self) -> list[str]:
        """The registry's hashes and set that hold a field (member) per worker id."""
        return [self.workers, self.drained, self.drained_at, self.roles]

    def worker_keys(self, worker_id: str) -> list[list[str]]:
        """The keys named after `worker_id`, one list per hash tag (slot): its decode keys and
        its stranded ledger (a `both` worker has both), its hold-back with its decode keys."""
        return [
            [*self.decode_worker(worker_id), self.decode_hold(worker_id)],
            self.stranded_worker(worker_id),
        ]

    def lease(self, name: str) -> str:
        return f"{self.prefix}{{reg}}:lease:{check_id('lease', name)}"

    # -- tenants' API keys (digests only) ----------------------------------------------------
    @property
    def tenant_keys(self) -> list[str]:
        """The table, its revoked digests and its version, in the order the scripts take them."""
        return [
            f"{self.prefix}{{reg}}:tkeys",
            f"{self.prefix}{{reg}}:tkeys:revoked",
            f"{self.prefix}{{reg}}:tkeys:version",
        ]

    @property
    def demand(self) -> str:
        """Every replica's demand signals, one field each (router/workers/role_signals.py)."""
        return f"{self.prefix}{{reg}}:demand"

    # -- tenants' quotas ------------------------------------------------------------------
    def tenant_quota(self, tenant: str) -> list[str]:
        """A tenant's quota keys, in the order the quota scripts take them (one hash tag)."""
        base = f"{self.prefix}{{t:{check_id('tenant', tenant)}}}"
        return [f"{base}:q", f"{base}:holds", f"{base}:hexp", f"{base}:hsum"]

    # -- the cluster's fair share (state/fair_shares.py): one tag, one slot ------------------
    @property
    def fair(self) -> list[str]:
        """The counters, the waiters and the floors, in the order the script takes them."""
        base = f"{self.prefix}{{fair}}"
        return [f"{base}:vtc", f"{base}:wait", f"{base}:floor"]

    def fair_claims(self, line: str, units: int) -> list[str]:
        """The claim keys of a waiter line's `units` requests (state/base.py `fair_claim`)."""
        base = f"{self.prefix}{{fair}}:claim:{line}|"
        return [f"{base}{k}" for k in range(units)]

    def fair_nudge(self, replica: str) -> str:
        """The pub/sub channel on which `replica` hears that room was left for its waiters."""
        return f"{self.prefix}{{fair}}:nudge:{check_id('replica', replica)}"

    # -- store-loss marker: under the registry's tag, so the shard that would lose the
    # registrations is the shard whose loss it reveals.
    @property
    def marker(self) -> str:
        return f"{self.prefix}{{reg}}:marker"

    @property
    def feed(self) -> str:
        """The registry's change feed: every script that changes a registration, a drain mark, a
        role, the tenant keys or the marker appends to it (state/registry_feed.py)."""
        return f"{self.prefix}{{reg}}:feed"

    @property
    def renewal(self) -> str:
        """The longest renewal round any replica published, kept with the marker (its tag)."""
        return f"{self.prefix}{{reg}}:renewal"

    def __repr__(self) -> str:
        return f"Keys(prefix={self.prefix!r})"
