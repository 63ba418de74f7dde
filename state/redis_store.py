"""`RedisStore`: the shared state of every router replica, kept in Redis (docs/design.md §5).

Every multi-key change is one Lua script (state/redis_scripts.py), registered once per store.
Each script touches the keys of one hash tag only (see `state.keys`), so it runs on Redis Cluster
too — but for the reservation with its stranded-KV intent on one server (`reserve(intent=...)`):
one script over both workers' keys there, the two scripts sent at once on a cluster. Calls that
span workers (usage of many decode workers, histograms of many classes, the end of a request)
are pipelines of single-slot commands, not transactions: on a cluster, one pipeline per node,
sent at once (for `finish`, one node after the other: see `_send`; docs/scaling.md §4).

The client (one server or a cluster), its bounded wait and the pipelines are
`state.redis_conn.RedisConnection`; the calls of a request and of the lease keeper go through
its `_hot_script` / `_hot_pipeline`, which use the lean connection (state/lean_redis.py) on a
single server the store connected to itself; the registry (workers, drains, roles, the store-loss
marker) is `state.redis_registry.RedisRegistry`; the Lua is `state.redis_scripts`.

Clocks: leases, ledger times and retry buckets use the Redis server's clock (`TIME`) inside the
scripts, so replicas whose clocks disagree still agree on which lease has expired. Every script
that reads the clock takes it as ``ARGV[1]``: an empty string means "use `TIME`"; a number (from
an injected `clock`, e.g. a simulator's) is used instead.

Lua numbers passed to ``redis.call`` are formatted with 14 significant digits, which would round
unix times to 0.1 ms; the scripts format scores themselves (``%.6f``) to keep microseconds.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from redis.asyncio.cluster import RedisCluster
from redis.commands.core import AsyncScript

from state.base import (
    DecodeUsage,
    Finished,
    Reserved,
    RetryBudgetPolicy,
    StrandedEntry,
    StrandIntent,
)
from state.keys import (
    RETRY_RETENTION_S,
    RETRY_TTL_S,
    check_count,
    check_lease,
    check_policy,
)
from state.redis_conn import (
    Cmd,
    hash_pairs,
    raise_first,
    store_call,
    text,
)
from state.redis_fair import RedisFair
from state.redis_quotas import RedisQuotas
from state.redis_registry import RedisRegistry
from state.redis_scripts import (
    MARK_READY_SCRIPT,
    NOTE_REQUEST_SCRIPT,
    REAP_SCRIPT,
    RELEASE_SCRIPT,
    RENEW_MANY_SCRIPT,
    RENEW_SCRIPT,
    RESERVE_SCRIPT,
    RESIZE_SCRIPT,
    SET_CAPACITY_SCRIPT,
    STRAND_SCRIPT,
    TRY_RETRY_SCRIPT,
    UNSTRAND_SCRIPT,
    USAGE_SCRIPT,
)

__all__ = ["RedisStore"]


class RedisStore(RedisRegistry, RedisQuotas, RedisFair):
    """The `StateStore` on Redis or Redis Cluster (see `RedisConnection` for the client; the
    registry, drains, roles and the store-loss marker are `RedisRegistry`'s, the tenants' quotas
    `RedisQuotas`')."""

    def _register_scripts(self, register: Callable[[str], AsyncScript]) -> None:
        """Each script once per client (redis-py loads it on a node at its first NOSCRIPT)."""
        super()._register_scripts(register)
        self._register_quota_scripts(register)
        self._register_fair_scripts(register)
        self._set_capacity = register(SET_CAPACITY_SCRIPT)
        self._reserve = register(RESERVE_SCRIPT)
        self._renew = register(RENEW_SCRIPT)
        self._renew_many = register(RENEW_MANY_SCRIPT)
        self._resize = register(RESIZE_SCRIPT)
        self._release = register(RELEASE_SCRIPT)
        self._usage = register(USAGE_SCRIPT)
        self._strand = register(STRAND_SCRIPT)
        self._mark_ready = register(MARK_READY_SCRIPT)
        self._unstrand = register(UNSTRAND_SCRIPT)
        self._reap = register(REAP_SCRIPT)
        self._note_request = register(NOTE_REQUEST_SCRIPT)
        self._try_retry = register(TRY_RETRY_SCRIPT)

    # -- decode reservations -------------------------------------------------------------
    @store_call
    async def set_capacity(self, worker_id: str, capacity_blocks: int) -> None:
        check_count("capacity_blocks", capacity_blocks)
        keys = [self._keys.decode_capacity(worker_id), self._keys.decode_hold(worker_id)]
        hold_s = self._horizon.hold_s(worker_id)  # state/holdback.py
        args: list[str | int] = [self._now(), int(capacity_blocks), repr(hold_s)]
        await self._set_capacity(keys=keys, args=args)

    @store_call
    async def reserve(
        self,
        worker_id: str,
        reservation_id: str,
        blocks: int,
        lease_s: float,
        overbook_blocks: int = 0,
        intent: StrandIntent | None = None,
    ) -> Reserved:
        check_count("blocks", blocks)
        check_lease(lease_s)
        keys = [*self._keys.decode_worker(worker_id), self._keys.decode_hold(worker_id)]
        args: list[str | int] = [
            self._now(),
            reservation_id,
            int(blocks),
            repr(float(lease_s)),
            max(0, int(overbook_blocks)),
        ]
        if intent is None:
            return Reserved(bool(await self._hot_script(self._reserve, keys, args)))
        check_count("nbytes", intent.nbytes)
        ledger = self._keys.stranded_worker(intent.prefill_id)
        pending: list[str | int] = [
            intent.request_id,
            int(intent.nbytes),
            repr(float(intent.ready_within_s)),
        ]
        if not isinstance(self._client, RedisCluster):
            # One server: one script for both, the intent written only with the blocks held.
            held = bool(await self._hot_script(self._reserve, keys + ledger, args + pending))
            return Reserved(held, stranded=held)
        return await self._reserve_beside_intent(self._client, keys, args, ledger, pending)

    async def _reserve_beside_intent(
        self,
        client: RedisCluster,
        keys: list[str],
        args: list[str | int],
        ledger: list[str],
        pending: list[str | int],
    ) -> Reserved:
        """On a cluster the intent's slot is not the reservation's: both scripts at once (one
        round trip of latency), the intent whatever the reservation's outcome. The
        reservation's failure is the call's; the intent's only says it is not written."""
        reserve = Cmd.run(self._reserve, keys, args)
        strand = Cmd.run(self._strand, ledger, [self._now(), *pending])
        await client.initialize()  # a no-op once the slots are known
        nodes = {getattr(client.get_node_from_key(k), "name", "") for k in (keys[0], ledger[0])}
        if len(nodes) == 1:
            # One node: one pipeline, one connection (a call holds at most one per node).
            held, written = await self._pipelined([reserve, strand])
        else:
            held, written = await asyncio.gather(
                self._pipelined([reserve]), self._pipelined([strand]), return_exceptions=True
            )
            held = held if isinstance(held, BaseException) else held[0]
            written = written if isinstance(written, BaseException) else written[0]
        if isinstance(held, BaseException):
            raise held
        return Reserved(bool(held), stranded=not isinstance(written, BaseException))

    @store_call
    async def renew(self, worker_id: str, reservation_id: str, lease_s: float) -> bool:
        check_lease(lease_s)
        keys = self._keys.decode_worker(worker_id)
        args = [self._now(), reservation_id, repr(float(lease_s))]
        return bool(await self._hot_script(self._renew, keys, args))

    @store_call
    async def resize(
        self, worker_id: str, reservation_id: str, blocks: int, *, force: bool = False
    ) -> bool:
        check_count("blocks", blocks)
        keys = [*self._keys.decode_worker(worker_id), self._keys.decode_hold(worker_id)]
        args: list[str | int] = [self._now(), reservation_id, int(blocks), "1" if force else "0"]
        return bool(await self._hot_script(self._resize, keys, args))

    @store_call
    async def renew_many(
        self, worker_id: str, reservations: Mapping[str, int], lease_s: float
    ) -> list[str]:
        check_lease(lease_s)
        if not reservations:
            return []
        args: list[str | int] = [self._now(), repr(float(lease_s))]
        for rid, blocks in reservations.items():
            check_count("blocks", blocks)
            args += [rid, int(blocks)]
        back = await self._hot_script(self._renew_many, self._keys.decode_worker(worker_id), args)
        return [text(rid) for rid in back]

    @store_call
    async def release(self, worker_id: str, reservation_id: str) -> int:
        keys = self._keys.decode_worker(worker_id)
        return int(await self._hot_script(self._release, keys, [self._now(), reservation_id]))

    @store_call
    async def decode_usage(self, worker_ids: Iterable[str]) -> dict[str, DecodeUsage]:
        return (await self._usage_view(worker_ids, ()))[0]

    @store_call
    async def usage_view(
        self, decode_ids: Iterable[str], prefill_ids: Iterable[str]
    ) -> tuple[dict[str, DecodeUsage], dict[str, int]]:
        return await self._usage_view(decode_ids, prefill_ids)

    async def _usage_view(
        self, decode_ids: Iterable[str], prefill_ids: Iterable[str]
    ) -> tuple[dict[str, DecodeUsage], dict[str, int]]:
        """One pipeline: a usage script per decode worker, a GET of each prefill's ledger sum."""
        decode, prefill = list(dict.fromkeys(decode_ids)), list(dict.fromkeys(prefill_ids))
        if not decode and not prefill:
            return {}, {}
        now = self._now()
        sums = [self._keys.stranded_sum(p) for p in prefill]
        cmds = [Cmd.run(self._usage, self._keys.decode_worker(w), [now]) for w in decode]
        cmds += [Cmd(("GET", k), k) for k in sums]
        rows = raise_first(await self._hot_pipeline(cmds))
        usage = {
            worker_id: DecodeUsage(int(cap), int(reserved), int(count))
            for worker_id, (cap, reserved, count) in zip(decode, rows[: len(decode)], strict=True)
        }
        stranded = {p: int(s or 0) for p, s in zip(prefill, rows[len(decode) :], strict=True)}
        return usage, stranded

    # -- stranded KV ledger --------------------------------------------------------------
    @store_call
    async def strand(
        self, prefill_id: str, request_id: str, nbytes: int, ready_in_s: float = 0.0
    ) -> None:
        check_count("nbytes", nbytes)
        keys = self._keys.stranded_worker(prefill_id)
        args: list[str | int] = [self._now(), request_id, int(nbytes), repr(float(ready_in_s))]
        await self._hot_script(self._strand, keys, args)

    @store_call
    async def mark_ready(self, prefill_id: str, request_id: str, age_s: float = 0.0) -> bool:
        keys = self._keys.stranded_worker(prefill_id)
        args = [self._now(), request_id, repr(float(age_s))]
        return bool(await self._hot_script(self._mark_ready, keys, args))

    @store_call
    async def unstrand(self, prefill_id: str, request_id: str) -> int:
        keys = self._keys.stranded_worker(prefill_id)
        return int(await self._hot_script(self._unstrand, keys, [request_id]))

    @store_call
    async def stranded_bytes(self, prefill_ids: Iterable[str]) -> dict[str, int]:
        return (await self._usage_view((), prefill_ids))[1]

    @store_call
    async def reap_stranded(self, prefill_id: str, older_than_s: float) -> list[StrandedEntry]:
        keys = self._keys.stranded_worker(prefill_id)
        flat = await self._reap(keys=keys, args=[self._now(), repr(float(older_than_s))])
        return [
            StrandedEntry(prefill_id, text(flat[i]), int(flat[i + 1]), float(flat[i + 2]))
            for i in range(0, len(flat), 3)
        ]

    # -- the end of a request ---------------------------------------------------------------
    @store_call
    async def finish(
        self,
        release: tuple[str, str] | None = None,
        unstrand: tuple[str, str] | None = None,
        record: tuple[Sequence[str], int] | None = None,
    ) -> Finished:
        # A pipeline, not a transaction: the steps touch different hash tags (slots), and one
        # step's error (say a key of the wrong type, or on a cluster a node that is down) must
        # not stop the others.
        steps: list[str] = []
        cmds: list[Cmd] = []
        if release is not None:
            worker_id, reservation_id = release
            keys = self._keys.decode_worker(worker_id)
            cmds.append(Cmd.run(self._release, keys, [self._now(), reservation_id]))
            steps.append("release")
        if unstrand is not None:
            prefill_id, request_id = unstrand
            keys = self._keys.stranded_worker(prefill_id)
            cmds.append(Cmd.run(self._unstrand, keys, [request_id]))
            steps.append("unstrand")
        if record is not None:
            class_keys, bucket = record
            for class_key in class_keys:
                key = self._keys.output_stats(class_key)
                cmds.append(Cmd(("HINCRBY", key, str(int(bucket)), 1), key))
                steps.append("record")
        rows = await self._hot_pipeline(cmds, independent=True) if cmds else []
        outcome: dict[str, Any] = {"record": True}
        for step, row in zip(steps, rows, strict=True):
            if step == "record":
                outcome["record"] = outcome["record"] and not isinstance(row, Exception)
            else:
                outcome[step] = None if isinstance(row, Exception) else int(row)
        return Finished(
            released_blocks=outcome.get("release", 0),
            unstranded_bytes=outcome.get("unstrand", 0),
            recorded=outcome["record"],
        )

    # -- retry budget ----------------------------------------------------------------------
    @store_call
    async def note_request(self, count: int = 1) -> None:
        check_count("count", count)
        if count == 0:
            return
        await self._hot_script(
            self._note_request,
            [self._keys.retry_requests],
            [self._now(), RETRY_RETENTION_S, RETRY_TTL_S, int(count)],
        )

    @store_call
    async def try_retry(self, policy: RetryBudgetPolicy) -> bool:
        check_policy(policy)
        allowed = await self._hot_script(
            self._try_retry,
            [self._keys.retry_requests, self._keys.retry_retries],
            [
                self._now(),
                RETRY_RETENTION_S,
                RETRY_TTL_S,
                repr(float(policy.ratio)),
                repr(float(policy.min_per_s)),
                repr(float(policy.window_s)),
            ],
        )
        return bool(allowed)

    # -- output-length statistics ----------------------------------------------------------
    @store_call
    async def record_output(self, class_keys: Sequence[str], bucket: int) -> None:
        if not class_keys:
            return
        # One HINCRBY per class: each is atomic on its own and the classes live in different
        # slots, so a pipeline (not a transaction) is all that is needed.
        keys = [self._keys.output_stats(c) for c in class_keys]
        raise_first(
            await self._hot_pipeline([Cmd(("HINCRBY", k, str(int(bucket)), 1), k) for k in keys])
        )

    @store_call
    async def output_histograms(self, class_keys: Sequence[str]) -> dict[str, Mapping[int, int]]:
        keys = list(dict.fromkeys(class_keys))
        if not keys:
            return {}
        names = [self._keys.output_stats(c) for c in keys]
        # The histogram cache's refresh, about once a second while busy: on the lean
        # connection (~60 us of CPU a call there against redis-py's ~185: issue 36).
        rows = raise_first(await self._hot_pipeline([Cmd(("HGETALL", k), k) for k in names]))
        return {
            class_key: {int(b): int(n) for b, n in hash_pairs(row)}
            for class_key, row in zip(keys, rows, strict=True)
        }
