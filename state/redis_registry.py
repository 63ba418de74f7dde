"""`RedisRegistry`: the worker registry half of `RedisStore` — registrations, drains, the roles of
`both` workers, the role manager's lease, the store-loss marker, what a replica puts back
after a loss, and the tenants' key table (digests only). Every key here is under the registry's
hash tag ``{reg}`` (state/keys.py), so a whole registry read is one round trip, on one cluster
node; forgetting a worker also deletes its ``{d:..}`` and ``{p:..}`` keys (other slots: one
pipeline).

The marker (``{reg}:marker``) holds a token written by whoever finds it missing. Each store
object remembers the token it saw last: a different one means another replica has found the
marker missing since — the store lost its data — so every replica learns of a loss within one
check, not only the first to look (which alone saw it missing).
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.connection import AbstractConnection
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.commands.core import AsyncScript

from state.base import (
    DecodeUsage,
    DrainMark,
    RegistryFeed,
    RegistryView,
    StoreError,
    TenantKey,
    TenantKeys,
    UsageView,
    WorkerRole,
)
from state.holdback import RenewalHorizon
from state.keys import check_digest, check_id, check_lease, check_role, check_tenant_key
from state.redis_conn import Cmd, RedisConnection, hash_pairs, raise_first, store_call, text
from state.redis_scripts import (
    HOLD_LEASE_SCRIPT,
    RELEASE_LEASE_SCRIPT,
    SET_ROLE_SCRIPT,
    USAGE_SCRIPT,
)
from state.registry_feed import RedisRegistryFeed
from state.registry_scripts import (
    FORGET_ROLE_SCRIPT,
    FORGET_WORKER_SCRIPT,
    MARKER_SCRIPT,
    PUBLISH_DEMAND_SCRIPT,
    PUT_TENANT_KEY_SCRIPT,
    READ_DEMANDS_SCRIPT,
    READ_TENANT_KEYS_SCRIPT,
    REGISTER_WORKER_SCRIPT,
    REGISTRY_AND_USAGE_SCRIPT,
    RESTORE_REGISTRY_SCRIPT,
    RESTORE_TENANT_KEYS_SCRIPT,
    REVOKE_TENANT_KEY_SCRIPT,
    SET_DRAINED_SCRIPT,
)

__all__ = ["RedisRegistry"]


class RedisRegistry(RedisConnection):
    """The registry methods of the `StateStore` on Redis (the rest: `RedisStore`)."""

    # The marker token this store object saw last (None: it never looked).
    _epoch: str | None = None

    def _register_scripts(self, register: Callable[[str], AsyncScript]) -> None:
        # Not a script: this store object's side of the hold-back agreement (state/holdback.py),
        # made here because this is where a store object is set up.
        self._horizon = RenewalHorizon()
        self._set_role = register(SET_ROLE_SCRIPT)
        self._publish_demand = register(PUBLISH_DEMAND_SCRIPT)
        self._read_demands = register(READ_DEMANDS_SCRIPT)
        self._hold_lease = register(HOLD_LEASE_SCRIPT)
        self._release_lease = register(RELEASE_LEASE_SCRIPT)
        self._marker = register(MARKER_SCRIPT)
        self._set_drained = register(SET_DRAINED_SCRIPT)
        self._restore = register(RESTORE_REGISTRY_SCRIPT)
        self._forget = register(FORGET_WORKER_SCRIPT)
        self._register = register(REGISTER_WORKER_SCRIPT)
        self._forget_role = register(FORGET_ROLE_SCRIPT)
        self._registry_and_usage = register(REGISTRY_AND_USAGE_SCRIPT)
        # The decode usage script once more, under the registry's own name: a cluster's quiet
        # read pipelines it beside the registry's commands (`_registry_and_usage_pipelined`).
        self._usage_of = register(USAGE_SCRIPT)
        self._put_tkey = register(PUT_TENANT_KEY_SCRIPT)
        self._revoke_tkey = register(REVOKE_TENANT_KEY_SCRIPT)
        self._read_tkeys = register(READ_TENANT_KEYS_SCRIPT)
        self._restore_tkeys = register(RESTORE_TENANT_KEYS_SCRIPT)

    # -- worker registry ---------------------------------------------------------------------
    @store_call
    async def register_worker(self, worker_id: str, spec_json: str) -> None:
        keys = [self._keys.workers, self._keys.feed]
        await self._register(keys=keys, args=[check_id("worker_id", worker_id), spec_json])

    @store_call
    async def unregister_worker(self, worker_id: str) -> bool:
        k = self._keys
        wid = check_id("worker_id", worker_id)
        registry = k.registry_fields()
        cmds = [Cmd.run(self._forget, [*registry, k.feed], [wid])]
        cmds += [Cmd(("DEL", *keys), keys[0]) for keys in k.worker_keys(wid)]
        rows = raise_first(await self._pipelined(cmds))
        return bool(rows[0])

    @store_call
    async def registered_workers(self) -> dict[str, str]:
        raw = await self._client.hgetall(self._keys.workers)
        return {text(k): text(v) for k, v in raw.items()}

    # -- drained workers ----------------------------------------------------------------------
    @store_call
    async def set_drained(self, worker_id: str, drained: bool) -> bool:
        wid = check_id("worker_id", worker_id)
        keys = [self._keys.drained, self._keys.drained_at, self._keys.feed]
        return bool(await self._set_drained(keys=keys, args=[self._now(), wid, int(drained)]))

    @store_call
    async def drained_workers(self) -> set[str]:
        raw = await self._client.smembers(self._keys.drained)
        return {text(m) for m in raw}

    @store_call
    async def drain_marks(self) -> dict[str, DrainMark]:
        k = self._keys
        cmds = [Cmd(("SMEMBERS", k.drained), k.drained), Cmd(("HGETALL", k.drained_at), k.drained)]
        drained, times = raise_first(await self._pipelined(cmds))
        return _marks(drained, times)

    # -- roles of `both` workers ----------------------------------------------------------------
    @store_call
    async def worker_roles(self) -> dict[str, WorkerRole]:
        raw = await self._client.hgetall(self._keys.roles)
        return {text(k): _role(text(v)) for k, v in raw.items()}

    @store_call
    async def set_role(
        self, worker_id: str, role: str, expect_version: int, broken: str = ""
    ) -> WorkerRole | None:
        check_role(role)
        wid = check_id("worker_id", worker_id)
        args: list[str | int] = [self._now(), wid, role, int(expect_version), broken]
        rec = await self._set_role(keys=[self._keys.roles, self._keys.feed], args=args)
        return None if not rec else _role(text(rec))

    @store_call
    async def forget_role(self, worker_id: str) -> bool:
        keys = [self._keys.roles, self._keys.feed]
        return bool(await self._forget_role(keys=keys, args=[worker_id]))

    @store_call
    async def hold_lease(self, name: str, holder: str, ttl_s: float) -> bool:
        check_lease(ttl_s)
        args: list[str | int] = [holder, max(1, int(ttl_s * 1000))]
        return bool(await self._hold_lease(keys=[self._keys.lease(name)], args=args))

    @store_call
    async def release_lease(self, name: str, holder: str) -> bool:
        return bool(await self._release_lease(keys=[self._keys.lease(name)], args=[holder]))

    # -- every replica's demand ------------------------------------------------------------
    @store_call
    async def publish_demand(self, replica: str, payload: str, max_age_s: float) -> None:
        check_id("replica", replica)
        check_lease(max_age_s)
        args = [self._now(), replica, payload, repr(float(max_age_s))]
        await self._publish_demand(keys=[self._keys.demand], args=args)

    @store_call
    async def replica_demands(self, max_age_s: float) -> dict[str, str]:
        check_lease(max_age_s)
        flat = await self._read_demands(
            keys=[self._keys.demand], args=[self._now(), repr(float(max_age_s))]
        )
        return {text(flat[i]): text(flat[i + 1]) for i in range(0, len(flat), 2)}

    # -- after a store loss ---------------------------------------------------------------
    @store_call
    async def restore_registry(
        self, drains: Mapping[str, DrainMark], roles: Mapping[str, WorkerRole]
    ) -> None:
        if not drains and not roles:
            return
        args: list[str | int] = [len(drains)]
        for wid, mark in drains.items():
            args += [check_id("worker_id", wid), int(mark.drained), f"{mark.since_s:.6f}"]
        for wid, role in roles.items():
            check_role(role.role)
            args += [check_id("worker_id", wid), _record(role)]
        k = self._keys
        await self._restore(keys=[k.drained, k.drained_at, k.roles, k.feed], args=args)

    # -- tenants' API keys (digests only: `check_tenant_key` refuses anything else) ----------
    @store_call
    async def put_tenant_key(
        self, key_id: str, tenant: str, digest_hex: str, source: str = "admin", replaces: str = ""
    ) -> int:
        check_tenant_key(key_id, tenant, digest_hex, source)
        if replaces:
            check_digest(replaces)
        args = [key_id, f"{tenant}|{digest_hex}|{source}", digest_hex, replaces]
        return int(await self._put_tkey(keys=self._tenant_keys_fed(), args=args))

    @store_call
    async def revoke_tenant_key(self, key_id: str, digest_hex: str = "") -> int:
        check_id("key_id", key_id)
        if digest_hex:
            check_digest(digest_hex)
        keys = self._tenant_keys_fed()
        return int(await self._revoke_tkey(keys=keys, args=[key_id, digest_hex]))

    @store_call
    async def tenant_keys(self) -> TenantKeys:
        version, table, revoked = await self._read_tkeys(keys=self._keys.tenant_keys, args=[])
        keys = {}
        for key_id, record in hash_pairs(table):
            tenant, digest_hex, source = text(record).split("|")
            keys[text(key_id)] = TenantKey(tenant, digest_hex, source)
        return TenantKeys(int(version or 0), keys, frozenset(text(d) for d in revoked))

    @store_call
    async def restore_tenant_keys(
        self, keys: Mapping[str, TenantKey], revoked: Iterable[str], known_version: int
    ) -> int:
        digests = [check_digest(d) for d in revoked]
        args: list[str | int] = [int(known_version), len(digests), *digests]
        for key_id, key in keys.items():
            check_tenant_key(key_id, key.tenant, key.digest_hex, key.source)
            args += [key_id, f"{key.tenant}|{key.digest_hex}|{key.source}", key.digest_hex]
        return int(await self._restore_tkeys(keys=self._tenant_keys_fed(), args=args))

    def _tenant_keys_fed(self) -> list[str]:
        """The table's keys and the feed: what a script that changes the table takes."""
        return [*self._keys.tenant_keys, self._keys.feed]

    # -- the change feed (state/registry_feed.py) ------------------------------------------
    def registry_feed(self, longest_wait_s: float) -> RegistryFeed:
        return RedisRegistryFeed(lambda: self._feed_client(longest_wait_s), self._keys.feed)

    async def _feed_client(self, longest_wait_s: float) -> aioredis.Redis:
        """A connection of the feed's own, to the server (or cluster node) that holds it, as
        the store's own are made (address, credentials, TLS), with a read timeout past the
        longest wait and no retry: a connection Redis closed must end the wait, not be
        replaced under it."""
        client = self._client
        kind: type[AbstractConnection]
        if isinstance(client, RedisCluster):
            await client.initialize()
            node = client.get_node_from_key(self._keys.feed)
            if node is None:
                raise StoreError("no cluster node holds the registry feed's slot")
            kind, kwargs = node.connection_class, dict(node.connection_kwargs)
        else:
            pool = client.connection_pool
            kind, kwargs = pool.connection_class, dict(pool.connection_kwargs)
        kwargs.update(socket_timeout=longest_wait_s + 10.0, retry=Retry(NoBackoff(), 0))
        pool = aioredis.ConnectionPool(connection_class=kind, max_connections=1, **kwargs)
        return aioredis.Redis.from_pool(pool)

    # -- lifecycle ------------------------------------------------------------------------
    def advertise_renewal(self, renew_within_s: float) -> None:
        self._horizon.advertise(renew_within_s)

    def _renewal_args(self) -> list[str | int]:
        """What each marker check publishes: this replica's longest round, and the longest it
        remembers (published where the marker was missing)."""
        h = self._horizon
        return [repr(h.own_s), repr(h.carried())]

    def _marker_cmd(self, ttl_s: float) -> tuple[Cmd, str]:
        token = secrets.token_hex(8)  # fresh each time: a second loss must show as one too
        keys = [self._keys.marker, self._keys.renewal, self._keys.feed]
        args = [token, max(1, int(ttl_s)), *self._renewal_args()]
        return Cmd.run(self._marker, keys, args), token

    def _lost(self, answer: Any, token: str) -> bool:
        """The marker's answer ({marker found, longest round published}): was it missing (then
        it holds `token` now), or re-created by another replica since this store object last
        looked? A first look at a present marker knows of no loss. The longest round is
        remembered either way (`RenewalHorizon.read`)."""
        found, published = answer
        seen = self._epoch
        self._epoch = token if found is None else text(found)
        lost = found is None or (seen is not None and seen != self._epoch)
        self._horizon.read(float(published or 0), lost)
        return lost

    @store_call
    async def check_marker(self, ttl_s: float) -> bool:
        cmd, token = self._marker_cmd(ttl_s)
        # On the lean connection (a script's raw answer): a busy replica calls this about once
        # a second; ~65 us of CPU a call there against redis-py's ~180 (issue 36).
        return self._lost(raise_first(await self._hot_pipeline([cmd]))[0], token)

    # -- one read for the registry sync ---------------------------------------------------------
    @store_call
    async def registry_view(self, marker_ttl_s: float) -> RegistryView:
        cmds, token = self._registry_cmds(marker_ttl_s)
        # The registry sync's read while busy, once a second: on the lean connection as the
        # quiet beat's script is (raw answers: `_registry_rows` reads a hash as a flat list and
        # a set as a list); ~87 us of CPU a call there against redis-py's ~280 (issue 36).
        return self._registry_rows(raise_first(await self._hot_pipeline(cmds)), token)

    def _registry_cmds(self, marker_ttl_s: float) -> tuple[list[Cmd], str]:
        k = self._keys
        marker_cmd, token = self._marker_cmd(marker_ttl_s)
        cmds = [
            marker_cmd,
            Cmd(("HGETALL", k.workers), k.workers),
            Cmd(("SMEMBERS", k.drained), k.drained),
            Cmd(("HGETALL", k.drained_at), k.drained_at),
            Cmd(("HGETALL", k.roles), k.roles),
            Cmd(("GET", k.tenant_keys[2]), k.tenant_keys[2]),
        ]
        return cmds, token

    def _registry_rows(self, rows: Sequence[Any], token: str) -> RegistryView:
        """The registry view from the answers to `_registry_cmds` (hashes as dicts or, from a
        script, as flat lists)."""
        marker, workers, drained, times, roles, keys_version = rows
        return RegistryView(
            self._lost(marker, token),
            {text(wid): text(blob) for wid, blob in hash_pairs(workers)},
            _marks(drained, dict(hash_pairs(times))),
            {text(wid): _role(text(rec)) for wid, rec in hash_pairs(roles)},
            int(keys_version or 0),
        )

    # -- one read for a quiet beat --------------------------------------------------------------
    @store_call
    async def registry_and_usage_view(
        self, marker_ttl_s: float, decode_ids: Iterable[str], prefill_ids: Iterable[str]
    ) -> tuple[RegistryView, UsageView]:
        decode, prefill = list(dict.fromkeys(decode_ids)), list(dict.fromkeys(prefill_ids))
        if self.is_cluster:
            return await self._registry_and_usage_pipelined(marker_ttl_s, decode, prefill)
        # One server: one script, on the lean connection where the store has one (its answer
        # is read raw: hashes as flat lists). An idle replica makes this call once a second
        # (docs/benchmarks-overhead.md, "Idle with Redis").
        k = self._keys
        keys = [k.marker, *k.registry_fields(), k.tenant_keys[2], k.renewal, k.feed]
        for wid in decode:
            keys += k.decode_worker(wid)
        keys += [k.stranded_sum(pid) for pid in prefill]
        token = secrets.token_hex(8)
        args: list[str | int] = [self._now(), token, max(1, int(marker_ttl_s)), len(decode)]
        args += self._renewal_args()
        rows = await self._hot_script(self._registry_and_usage, keys, args)
        usage = _usage(decode, rows[5], prefill, rows[6])
        return self._registry_rows([*rows[:5], rows[7]], token), usage

    async def _registry_and_usage_pipelined(
        self, marker_ttl_s: float, decode: list[str], prefill: list[str]
    ) -> tuple[RegistryView, UsageView]:
        """On a cluster: one pipeline, a round trip per node holding the keys."""
        k = self._keys
        cmds, token = self._registry_cmds(marker_ttl_s)
        now = self._now()
        cmds += [Cmd.run(self._usage_of, k.decode_worker(wid), [now]) for wid in decode]
        cmds += [Cmd(("GET", key), key) for key in map(k.stranded_sum, prefill)]
        rows = raise_first(await self._pipelined(cmds))
        usage_rows, sums = rows[6 : 6 + len(decode)], rows[6 + len(decode) :]
        return self._registry_rows(rows[:6], token), _usage(decode, usage_rows, prefill, sums)


def _usage(
    decode: list[str], usage_rows: Sequence[Any], prefill: list[str], sums: Sequence[Any]
) -> UsageView:
    """`usage_view`'s answer from the usage script's rows and the ledger sums."""
    usage = {
        wid: DecodeUsage(int(cap), int(reserved), int(count))
        for wid, (cap, reserved, count) in zip(decode, usage_rows, strict=True)
    }
    return usage, {pid: int(s or 0) for pid, s in zip(prefill, sums, strict=True)}


def _marks(drained: Any, times: Any) -> dict[str, DrainMark]:
    """Drain marks from the drained set and the times hash. The set decides whether a worker
    is drained; a member with no time (written by an older router) counts as of time 0."""
    members = {text(m) for m in drained}
    since = {text(wid): float(t) for wid, t in times.items()}
    return {wid: DrainMark(wid in members, since.get(wid, 0.0)) for wid in members | set(since)}


def _role(record: str) -> WorkerRole:
    """A record: role, version and since, then the broken mark when its last switch left it
    broken (the mark last, split off once: it may hold '|' itself)."""
    role, version, since, *broken = record.split("|", 3)
    return WorkerRole(role, int(version), float(since), broken[0] if broken else "")


def _record(role: WorkerRole) -> str:
    mark = f"|{role.broken}" if role.broken else ""
    return f"{role.role}|{role.version}|{role.since_s:.6f}{mark}"
