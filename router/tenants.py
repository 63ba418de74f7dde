"""Tenants and their API keys: who a request is for (issue 25).

A tenant has a name, a weight (its share of what is scarce, relative to the others'), a priority
class and limits (its quota, enforced by the store across replicas:
state/quotas.py, router/request/quota.py). The class (`priority:`, or `class:` as its alias) is a
name — interactive, default, batch — or an integer (policies/priority_classes.py: -1, 0, 1;
lower is more urgent); it is the *most urgent* class the tenant's requests may have: a request
may ask for a less urgent one, never a more urgent one (router/request/priority_class.py). An
API key belongs to one tenant. The configuration names them (`tenants:`, keys under each); the
old `api_keys` list is kept: each of its keys belongs to the `default` tenant. With no key at all
the router is open, as it always was: every request is the anonymous `default` tenant's.

Keys are kept hashed, never as they were written (the config may give a key or its hash
`sha256:<hex>`: a key is hashed when the settings load, and only the hash stays), so no
Settings, repr, log line or `/admin` answer can show one. A key is known by its id (given in the
config, or made here) and its fingerprint (the first 12 hex digits of its hash).

`Keyring` is the replica's key table: the configured keys (from the settings, at start-up) with
the shared table laid over them. The shared table (`StateStore.tenant_keys`: key id -> tenant
and digest, the revoked digests, a version) holds what the admin API made, rotated or revoked
on any replica: the admin route writes it to the store first (a store that is down: 503, and
nothing changes here), then applies it here at once. Every replica's registry sync reads the
table's version with the registry (router/workers/registry.py: no store call more while it is
unchanged) and, when it changed, the table (`adopt`): a key revoked or made on one replica is
refused or accepted on every replica within one `registry_refresh_s`. A configured key stays
valid unless its digest is revoked: revoked, it stays so across a replica's restart (the
revoked digests are in the store); rotated, its id carries the new key from the table. After
the store lost its data every replica puts its last-known table back
(router/workers/store_loss.py); the store keeps their union, revocations winning.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from policies.base import Tenant
from policies.priority_classes import class_name, parse_class
from state.base import TenantKey, TenantKeys
from state.quotas import LIMIT_NAMES, Quota

__all__ = [
    "ANONYMOUS",
    "DEFAULT_TENANT",
    "KEYRING",
    "KeySpec",
    "Keyring",
    "TenantLimits",
    "TenantSpec",
    "UnknownKey",
    "UnknownTenant",
    "hash_key",
    "parse_tenants",
]

DEFAULT_TENANT = "default"
HASH_PREFIX = "sha256:"
_HASH = re.compile(r"sha256:([0-9a-f]{64})")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")  # also a Prometheus label value and a path
_FINGERPRINT_HEX = 12
_LIMITS = LIMIT_NAMES


def hash_key(key: str) -> bytes:
    """The SHA-256 digest of a key.

    A fast hash is the right one here, not a password hash (bcrypt, argon2): API keys are long
    random strings (ours: 256 bits), so there is nothing to guess and nothing a slow hash would
    protect; a password hash would only cost ~50-100 ms of CPU a request, on every request.
    """
    return hashlib.sha256(key.encode()).digest()


# A tenant's limits are the store's `Quota` (state/quotas.py: what each means, how the store
# enforces it across replicas): requests_per_minute, tokens_per_minute, max_reserved_blocks.
TenantLimits = Quota


@dataclass(frozen=True, slots=True)
class TenantSpec:
    """A configured tenant. `tenant` is what the fairness policy is told (policies/base.py)."""

    name: str
    weight: float = 1.0
    priority: int = 0
    limits: TenantLimits = field(default_factory=TenantLimits)
    # The `default` tenant made up when none is configured: it bounds no request's priority
    # (a body's `priority` is taken as it is, as before tenants existed).
    implicit: bool = field(default=False, repr=False)
    tenant: Tenant = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME.fullmatch(self.name):
            raise ValueError(
                f"tenant name {self.name!r}: 1-64 letters, digits, '_', '.' or '-', "
                "starting with a letter or digit"
            )
        if isinstance(self.priority, bool) or not isinstance(self.priority, int):
            raise ValueError(f"tenant {self.name}: priority must be an integer")
        if isinstance(self.weight, bool) or not isinstance(self.weight, int | float):
            raise ValueError(f"tenant {self.name}: weight must be a number")
        object.__setattr__(self, "tenant", Tenant(self.name, float(self.weight), self.priority))


@dataclass(frozen=True, slots=True)
class KeySpec:
    """One API key, as its SHA-256 digest: never the key itself. Its repr shows the id and the
    fingerprint only."""

    key_id: str
    tenant: str
    digest: bytes = field(repr=False)
    source: str = "config"  # config | api_keys | admin

    @property
    def fingerprint(self) -> str:
        return HASH_PREFIX + self.digest.hex()[:_FINGERPRINT_HEX]

    def __repr__(self) -> str:
        return f"KeySpec({self.key_id}, tenant={self.tenant}, {self.fingerprint})"

    def describe(self) -> dict[str, str]:
        return {"id": self.key_id, "fingerprint": self.fingerprint, "source": self.source}


def _key_entry(raw: Any, tenant: str, where: str) -> KeySpec:
    """A `keys:` entry: a plain key or `sha256:<hex>`, alone or as {key|hash, id}. Only its hash
    is kept. (A plain key spelled exactly like a hash would be taken for one: give it as
    {key: ...} then.)"""
    key_id: Any = None
    if isinstance(raw, Mapping):
        unknown = set(raw) - {"key", "hash", "id"}
        if unknown or ("key" in raw) == ("hash" in raw):
            raise ValueError(f"{where}: a key entry is {{key: ...}} or {{hash: sha256:...}}, + id")
        key_id = raw.get("id")
        if "hash" in raw:
            match = _HASH.fullmatch(str(raw["hash"]).strip().lower())
            if match is None:
                raise ValueError(f"{where}: hash must be sha256:<64 hex digits>")
            digest = bytes.fromhex(match[1])
        else:
            digest = _plain_digest(raw["key"], where)
    elif isinstance(raw, str):
        match = _HASH.fullmatch(raw.strip().lower())
        digest = bytes.fromhex(match[1]) if match else _plain_digest(raw, where)
    else:
        raise ValueError(f"{where}: a key is a string or a mapping")
    if key_id is None:
        key_id = "k-" + digest.hex()[:_FINGERPRINT_HEX]
    if not isinstance(key_id, str) or not _NAME.fullmatch(key_id):
        raise ValueError(f"{where}: id must be 1-64 letters, digits, '_', '.' or '-'")
    return KeySpec(key_id, tenant, digest)


def _plain_digest(key: Any, where: str) -> bytes:
    if not isinstance(key, str) or not key.strip():
        raise ValueError(f"{where}: a key must be a non-empty string")  # never says which
    return hash_key(key.strip())


def _class_entry(entry: dict[str, Any], where: str) -> None:
    """`priority:` or its alias `class:` (not both), a class name or an integer, as the integer
    class in `priority` (the entry is the caller's copy)."""
    if "class" in entry:
        if "priority" in entry:
            raise ValueError(f"{where}: priority and class are the same setting: give one")
        entry["priority"] = entry.pop("class")
    if "priority" in entry:
        try:
            entry["priority"] = parse_class(entry["priority"])
        except ValueError as exc:
            raise ValueError(f"{where}.priority: {exc}") from exc


def parse_tenants(raw: Any) -> tuple[tuple[TenantSpec, ...], tuple[KeySpec, ...]]:
    """The `tenants:` section (a list of {name, weight, priority or class, limits..., keys}) as
    tenants and hashed keys (checked against each other by `Keyring`). Raises ValueError."""
    if raw is None:
        raw = []
    if not isinstance(raw, list):
        raise ValueError("tenants: a list of {name, weight, priority, ..., keys}")
    tenants: list[TenantSpec] = []
    keys: list[KeySpec] = []
    for i, entry in enumerate(raw):
        where = f"tenants[{i}]"
        if not isinstance(entry, Mapping):
            raise ValueError(f"{where}: a mapping")
        entry = dict(entry)
        unknown = set(entry) - {"name", "weight", "priority", "class", "keys", *_LIMITS}
        if unknown:
            raise ValueError(f"{where}: unknown fields {sorted(unknown)}")
        if "name" not in entry:
            raise ValueError(f"{where}: name is required")
        _class_entry(entry, where)
        limits = TenantLimits(**{k: entry.pop(k) for k in _LIMITS if k in entry})
        raw_keys = entry.pop("keys", None) or []
        if not isinstance(raw_keys, list):
            raise ValueError(f"{where}.keys: a list")
        spec = TenantSpec(limits=limits, **entry)
        tenants.append(spec)
        keys += [_key_entry(k, spec.name, f"{where}.keys[{j}]") for j, k in enumerate(raw_keys)]
    names = [t.name for t in tenants]
    if len(names) != len(set(names)):
        raise ValueError(f"tenants: duplicate names in {names}")
    return tuple(tenants), tuple(keys)


# The open mode's tenant, for a caller that names none (a test driving the request path).
ANONYMOUS = TenantSpec(DEFAULT_TENANT, implicit=True)


class UnknownTenant(KeyError):
    pass


class UnknownKey(KeyError):
    pass


class Keyring:
    """This replica's tenants and keys: which tenant a presented key is (`identify`), the admin
    API's changes (`mint` a key, `put` it, `drop` one; `create`, `rotate` and `revoke` do both
    steps) and the shared table (`adopt`, `shared_table`): the module docstring.

    Looking a key up does not tell by its timing which key matched, nor how close a guess came:
    the presented key is hashed first and the digest looked up in a dict. The dict's comparison
    of the digest is not constant-time, but what it can leak is how the SHA-256 of the caller's
    own guess relates to a stored digest: to steer that, the caller would have to choose inputs
    by their hashes, a preimage search, and a digest, even if learnt, does not give back the key.
    The found entry is then compared with `hmac.compare_digest` all the same (the check stays
    constant-time, should the lookup ever change)."""

    __slots__ = (
        "_tenants",
        "_configured",
        "_shared",
        "_revoked",
        "_by_digest",
        "_by_id",
        "closed",
        "version",
    )

    def __init__(
        self, tenants: Iterable[TenantSpec], keys: Iterable[KeySpec], api_keys: Iterable[str] = ()
    ) -> None:
        """`api_keys`: the old list, each key the `default` tenant's (hashed here: the settings
        keep that list as it was, for the log redactor, router/redact.py). Raises ValueError
        when two keys are the same or share an id, or a key names an unknown tenant."""
        self._tenants: dict[str, TenantSpec] = {t.name: t for t in tenants}
        self._tenants.setdefault(DEFAULT_TENANT, ANONYMOUS)
        self._by_digest: dict[bytes, KeySpec] = {}
        self._by_id: dict[str, KeySpec] = {}
        old = [_key_entry({"key": str.__str__(k)}, DEFAULT_TENANT, "api_keys") for k in api_keys]
        for key in (*keys, *(KeySpec(k.key_id, k.tenant, k.digest, "api_keys") for k in old)):
            if key.tenant not in self._tenants:
                raise ValueError(f"a key of tenant {key.tenant!r}, which is not configured")
            if key.digest in self._by_digest:
                raise ValueError(f"the same key is given twice ({key.fingerprint})")
            if key.key_id in self._by_id:
                raise ValueError(f"two keys have the id {key.key_id}")
            self._add(key)
        self._configured = tuple(self._by_id.values())
        # The shared table as this replica last knew it (`adopt`, or its own changes since).
        self._shared: dict[str, TenantKey] = {}
        self._revoked: set[str] = set()  # digests (hex)
        self.version: int | None = None  # the shared table's, as last read; None: never read
        # Decided by the configuration, once: a key made through the admin API in open mode
        # names its tenant, but does not lock everyone else out.
        self.closed = bool(self._by_id)

    def __repr__(self) -> str:
        mode = "closed" if self.closed else "open"
        return (
            f"Keyring({mode}, tenants={len(self._tenants)}, keys={len(self._by_id)}, "
            f"shared v{self.version})"
        )

    @property
    def default(self) -> TenantSpec:
        return self._tenants[DEFAULT_TENANT]

    @property
    def tenants(self) -> Mapping[str, TenantSpec]:
        return self._tenants

    def lookup(self, presented: str) -> KeySpec | None:
        """The key `presented` is, or None (the class docstring: no timing oracle)."""
        if not presented:
            return None
        digest = hash_key(presented)
        found = self._by_digest.get(digest)
        if found is None or not hmac.compare_digest(found.digest, digest):
            return None
        return found

    def identify(self, presented: str) -> TenantSpec | None:
        """The tenant of a request presenting `presented` ("" when none): its key's; in open
        mode an unknown key or none is the default tenant's; None: refuse it (401)."""
        key = self.lookup(presented)
        if key is not None:
            return self._tenants[key.tenant]
        return None if self.closed else self.default

    def keys_of(self, tenant: str) -> list[KeySpec]:
        self._tenant(tenant)
        return [k for k in self._by_id.values() if k.tenant == tenant]

    def create(self, tenant: str) -> tuple[KeySpec, str]:
        """A new key of `tenant`: its spec and the key itself, which is shown once and not kept.
        Here only: the admin API writes `mint`'s key to the store first, then `put`s it."""
        spec, plain = self.mint(tenant)
        self.put(spec)
        return spec, plain

    def rotate(self, tenant: str, key_id: str) -> tuple[KeySpec, str]:
        """A new key under the same id; the old one is refused from now on (here only)."""
        old = self.key(tenant, key_id)
        spec, plain = self.mint(tenant, key_id)
        self.put(spec, replaces=old)
        return spec, plain

    def revoke(self, tenant: str, key_id: str) -> KeySpec:
        old = self.key(tenant, key_id)
        self.drop(old)
        return old

    # -- the steps, for a caller that writes the store in between (router/edge/admin.py) ---------
    def mint(self, tenant: str, key_id: str | None = None) -> tuple[KeySpec, str]:
        """A new key of `tenant` (under `key_id`, which must be one of its keys: a rotation; or
        a fresh id), not yet in the keyring."""
        if key_id is not None:
            self.key(tenant, key_id)
        else:
            self._tenant(tenant)
            while True:
                key_id = "k-" + secrets.token_hex(6)
                if key_id not in self._by_id and key_id not in self._shared:
                    break
        plain = "sk-dr-" + secrets.token_urlsafe(32)  # 256 random bits
        return KeySpec(key_id, tenant, hash_key(plain), "admin"), plain

    def key(self, tenant: str, key_id: str) -> KeySpec:
        """`tenant`'s key `key_id`; raises UnknownTenant or UnknownKey."""
        self._tenant(tenant)
        key = self._by_id.get(key_id)
        if key is None or key.tenant != tenant:
            raise UnknownKey(key_id)
        return key

    def put(self, spec: KeySpec, replaces: KeySpec | None = None) -> None:
        """`spec` in, under its id, as the store's `put_tenant_key` did: what the id held before
        and `replaces` are revoked."""
        before = self._by_id.get(spec.key_id)
        for old in (before, replaces):
            if old is not None and old.digest != spec.digest:
                self._revoked.add(old.digest.hex())
        self._shared[spec.key_id] = TenantKey(spec.tenant, spec.digest.hex(), spec.source)
        self._rebuild()

    def drop(self, key: KeySpec) -> None:
        """`key` revoked, as the store's `revoke_tenant_key` did."""
        self._revoked.add(key.digest.hex())
        shared = self._shared.pop(key.key_id, None)
        if shared is not None:
            self._revoked.add(shared.digest_hex)
        self._rebuild()

    # -- the shared table ---------------------------------------------------------------------
    def adopt(self, table: TenantKeys) -> None:
        """Take the store's table as it is now (and its version)."""
        self._shared = dict(table.keys)
        self._revoked = set(table.revoked)
        self.version = table.version
        self._rebuild()

    def shared_table(self) -> tuple[dict[str, TenantKey], set[str], int]:
        """What this replica puts back after a store loss: the table and the revoked digests as
        it last knew them, and that table's version (0: never read)."""
        return dict(self._shared), set(self._revoked), self.version or 0

    def _rebuild(self) -> None:
        """The keys in force: the configured ones but those revoked or whose id the table took
        over (a rotated configured key), then the table's. A table entry of a tenant this
        replica does not know (configured on another replica only) is left out."""
        revoked, shared = self._revoked, self._shared
        by_digest: dict[bytes, KeySpec] = {}
        by_id: dict[str, KeySpec] = {}
        for key in self._configured:
            if key.digest.hex() not in revoked and key.key_id not in shared:
                by_digest[key.digest], by_id[key.key_id] = key, key
        for key_id, entry in shared.items():
            if entry.digest_hex in revoked or entry.tenant not in self._tenants:
                continue
            spec = KeySpec(key_id, entry.tenant, bytes.fromhex(entry.digest_hex), entry.source)
            if spec.digest not in by_digest:
                by_digest[spec.digest], by_id[key_id] = spec, spec
        self._by_digest, self._by_id = by_digest, by_id

    def describe(self) -> list[dict[str, Any]]:
        """Every tenant with its settings and its keys' ids and fingerprints: no secret."""
        return [
            {
                "name": t.name,
                "weight": t.weight,
                "priority": t.priority,
                "class": class_name(t.priority),
                "limits": {name: t.limits.limit(name) for name in _LIMITS},
                "keys": [k.describe() for k in self._by_id.values() if k.tenant == t.name],
            }
            for t in self._tenants.values()
        ]

    def _tenant(self, name: str) -> TenantSpec:
        spec = self._tenants.get(name)
        if spec is None:
            raise UnknownTenant(name)
        return spec

    def _add(self, key: KeySpec) -> None:
        self._by_digest[key.digest] = key
        self._by_id[key.key_id] = key


KEYRING = web.AppKey("keyring", Keyring)
