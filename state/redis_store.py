"""`RedisStore`: the shared state of every router replica, kept in Redis (docs/design.md §5).

Every multi-key change is one Lua script below, registered once per store. Each script touches
the keys of one hash tag only (see `state.keys`), so it runs on Redis Cluster too — but for the
reservation with its stranded-KV intent on one server (`reserve(intent=...)`): one script over
both workers' keys there, the two scripts sent at once on a cluster. Calls that
span workers (usage of many decode workers, histograms of many classes, the end of a request)
are pipelines of single-slot commands, not transactions: on a cluster, one pipeline per node,
sent at once (for `finish`, one node after the other: see `_send`; docs/scaling.md §4).

One client or the other: `redis.asyncio.Redis` for one server, `redis.asyncio.RedisCluster` for
a cluster (a ``redis+cluster://`` URL, see `from_url`). Scripts inside a pipeline are sent as
``EVALSHA`` by hand, for both: redis-py's single-node pipeline would first ask ``SCRIPT EXISTS``
(one more round trip per call), and its cluster pipeline refuses `evalsha` outright because it
cannot load a missing script. Here a ``NOSCRIPT`` answer (a node restarted, or failed over to a
replica that never saw the script) loads the scripts (on every primary of a cluster) and sends
again just the commands that got it: a command that answered ``NOSCRIPT`` never ran.

Clocks: leases, ledger times and retry buckets use the Redis server's clock (`TIME`) inside the
scripts, so replicas whose clocks disagree still agree on which lease has expired. Every script
that reads the clock takes it as ``ARGV[1]``: an empty string means "use `TIME`"; a number (from
an injected `clock`, e.g. a simulator's) is used instead.

Lua numbers passed to ``redis.call`` are formatted with 14 significant digits, which would round
unix times to 0.1 ms; the scripts format scores themselves (``%.6f``) to keep microseconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import AsyncIterator, Callable, Coroutine, Iterable, Mapping, Sequence
from typing import Any, Concatenate, ParamSpec, TypeVar
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import redis.asyncio as aioredis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.commands.core import AsyncScript
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, RedisClusterException, RedisError

from state.base import (
    DecodeUsage,
    Finished,
    Reserved,
    RetryBudgetPolicy,
    StoreBusy,
    StoreError,
    StrandedEntry,
    StrandIntent,
    WorkerRole,
)
from state.keys import (
    DEFAULT_PREFIX,
    RETRY_RETENTION_S,
    RETRY_TTL_S,
    Keys,
    check_count,
    check_id,
    check_lease,
    check_policy,
    check_role,
)
from state.redis_scripts import (
    HOLD_LEASE_SCRIPT,
    MARK_READY_SCRIPT,
    NOTE_REQUEST_SCRIPT,
    REAP_SCRIPT,
    RELEASE_LEASE_SCRIPT,
    RELEASE_SCRIPT,
    RENEW_MANY_SCRIPT,
    RENEW_SCRIPT,
    RESERVE_SCRIPT,
    RESIZE_SCRIPT,
    SET_ROLE_SCRIPT,
    STRAND_SCRIPT,
    TRY_RETRY_SCRIPT,
    UNSTRAND_SCRIPT,
    USAGE_SCRIPT,
)

__all__ = ["CLUSTER_SCHEMES", "RedisStore", "StoreUnavailableError", "is_cluster_url", "redact_url"]

# A cluster is named by its URL: ``redis+cluster://host:port[,host:port...]`` (``rediss+`` for
# TLS), every listed node a seed the client may start from.
CLUSTER_SCHEMES = ("redis+cluster://", "rediss+cluster://")


class StoreUnavailableError(StoreError, ConnectionError):
    """The configured Redis did not answer; the message names the URL with the password hidden."""


# Connection sizing. redis-py's asyncio pool, unbounded in waiting, RAISES once its connection
# cap is reached: a burst of requests then fails with 500s. A blocking pool makes a burst queue
# for a connection instead, up to `pool_timeout_s`, after which the call is a StoreBusy (the
# router sheds it with 429: it is overloaded, the store is not down). Each call holds a
# connection for one round trip (~0.1 ms on a LAN), so a few dozen connections carry thousands
# of calls per second; the wait is long (10 s) because under a burst it is the event loop, not
# Redis, that returns connections late (docs/reliability.md measures it).
# redis-py's cluster client has no blocking pool: each node's pool raises past its cap. On a
# cluster the store itself admits at most `max_connections` calls at once (a call uses at most
# one connection per node), and a call waits up to `pool_timeout_s` for its turn: the same
# bound per node and the same wait as the single-node pool.
DEFAULT_MAX_CONNECTIONS = 64
DEFAULT_POOL_TIMEOUT_S = 10.0

# What the clients raise: RedisClusterException (no node reachable, slots not covered) is not a
# RedisError; OSError covers the sockets and TimeoutError.
_FAILURES = (RedisError, RedisClusterException, OSError)

_P = ParamSpec("_P")
_R = TypeVar("_R")


def _store_call(
    fn: Callable[Concatenate[RedisStore, _P], Coroutine[Any, Any, _R]],
) -> Callable[Concatenate[RedisStore, _P], Coroutine[Any, Any, _R]]:
    """Redis's and the socket's failures leave a store method as one `StoreError`, so callers
    (and the router's one error mapping) have a single thing to handle."""

    @functools.wraps(fn)
    async def call(self: RedisStore, /, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        try:
            if self._gate is None:  # one server: its blocking pool bounds the wait
                return await fn(self, *args, **kwargs)
            async with self._admitted():
                return await fn(self, *args, **kwargs)
        except StoreBusy:
            raise
        except _FAILURES as exc:
            if isinstance(exc, RedisConnectionError) and isinstance(exc.__cause__, TimeoutError):
                # The blocking pool's wait ran out ("No connection available."): nothing was
                # sent, the store is not at fault.
                raise StoreBusy(f"no Redis connection came free ({fn.__name__})") from exc
            raise StoreError(f"the state store failed ({fn.__name__}): {exc!r}") from exc

    return call


def is_cluster_url(url: str) -> bool:
    return url.startswith(CLUSTER_SCHEMES)


def _cluster_client(url: str, max_connections: int) -> RedisCluster:
    """A `RedisCluster` for ``redis+cluster://[user:pass@]h1:p1[,h2:p2...][/0][?options]``."""
    parts = urlsplit(url)
    scheme = parts.scheme.removesuffix("+cluster")
    userinfo, _, hosts = parts.netloc.rpartition("@")
    seeds = []
    for host in hosts.split(","):
        seed = urlsplit(f"{scheme}://{host}")
        if not seed.hostname:
            raise ValueError(f"no host in the cluster URL {redact_url(url)}")
        seeds.append((seed.hostname, seed.port or 6379))
    # The first seed and the options go through redis-py's own URL parsing (credentials, TLS,
    # ?socket_timeout=...); URL options override these defaults, as for one server.
    netloc = f"{userinfo}@{hosts.split(',')[0]}" if userinfo else hosts.split(",")[0]
    first = urlunsplit((scheme, netloc, parts.path, parts.query, ""))
    try:
        return RedisCluster.from_url(
            first,
            startup_nodes=[ClusterNode(host, port) for host, port in seeds[1:]],
            max_connections=max_connections,
            socket_connect_timeout=5.0,
            socket_timeout=10.0,
        )
    except RedisClusterException as exc:  # e.g. a database other than 0
        raise ValueError(f"bad cluster URL {redact_url(url)}: {exc}") from exc


def redact_url(url: str) -> str:
    """`url` with its password (userinfo or ``?password=``) replaced by ``***``."""
    parts = urlsplit(url)
    if parts.password is None and "password=" not in parts.query.lower():
        return url  # nothing to hide; urlunsplit would also turn unix:///p into unix:/p
    netloc = parts.netloc
    if parts.password is not None:
        user = parts.username or ""
        netloc = f"{user}:***@{netloc.rpartition('@')[2]}"
    query = parts.query
    if query:
        pairs = parse_qsl(query, keep_blank_values=True)
        query = urlencode(
            [(k, "***" if k.lower() == "password" else v) for k, v in pairs], safe="*"
        )
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class _Cmd:
    """One command of a pipeline, as sent; `script` is set for an ``EVALSHA`` (to load it
    again after ``NOSCRIPT``), `key` is the key that places it on a cluster node."""

    __slots__ = ("args", "key", "script")

    def __init__(self, args: tuple[Any, ...], key: str, script: AsyncScript | None = None):
        self.args = args
        self.key = key
        self.script = script

    @classmethod
    def run(cls, script: AsyncScript, keys: Sequence[str], args: Sequence[Any]) -> _Cmd:
        return cls(("EVALSHA", script.sha, len(keys), *keys, *args), keys[0], script)

    def __repr__(self) -> str:
        return f"_Cmd({self.args[0]} {self.key})"


def _raise_first(results: list[Any]) -> list[Any]:
    for row in results:
        if isinstance(row, Exception):
            raise row
    return results


class RedisStore:
    """The `StateStore` on Redis or Redis Cluster. Owns its client only when built by `from_url`."""

    def __init__(
        self,
        client: aioredis.Redis | RedisCluster,
        keys: Keys,
        clock: Callable[[], float] | None = None,
        *,
        _owns_client: bool = False,
        _url: str | None = None,
        _max_calls: int | None = None,
        _pool_timeout_s: float = DEFAULT_POOL_TIMEOUT_S,
    ) -> None:
        self._client = client
        self._keys = keys
        # None: the server's clock, the only one every replica agrees on. Injected clocks are
        # for simulations and tests that want to step time.
        self._clock = clock
        self._owns_client = _owns_client
        self._url = _url
        # The cluster client's bounded wait (see DEFAULT_MAX_CONNECTIONS); None: the client's
        # own pool does it.
        self._gate = None if _max_calls is None else asyncio.Semaphore(_max_calls)
        self._pool_timeout_s = _pool_timeout_s
        register = client.register_script
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
        self._set_role = register(SET_ROLE_SCRIPT)
        self._hold_lease = register(HOLD_LEASE_SCRIPT)
        self._release_lease = register(RELEASE_LEASE_SCRIPT)

    @classmethod
    def from_url(
        cls,
        url: str,
        prefix: str = DEFAULT_PREFIX,
        *,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        pool_timeout_s: float = DEFAULT_POOL_TIMEOUT_S,
    ) -> RedisStore:
        """A store on a client of its own (closed by `close`). Does no I/O: `ping` to check.

        At most `max_connections` connections (per node on a cluster); a call finding them all
        busy waits up to `pool_timeout_s` for one, then fails with StoreError.
        ``redis+cluster://`` and ``rediss+cluster://`` URLs name a Redis Cluster by one or more
        comma-separated seed nodes."""
        if is_cluster_url(url):
            cluster = _cluster_client(url, max_connections)
            return cls(
                cluster,
                Keys(prefix),
                _owns_client=True,
                _url=url,
                _max_calls=max_connections,
                _pool_timeout_s=pool_timeout_s,
            )
        # URL query options (e.g. ?socket_connect_timeout=1) override these defaults.
        pool = aioredis.BlockingConnectionPool.from_url(
            url,
            max_connections=max_connections,
            timeout=pool_timeout_s,
            socket_connect_timeout=5.0,
            socket_timeout=10.0,
        )
        client = aioredis.Redis.from_pool(pool)  # owns the pool: aclose() disconnects it
        return cls(client, Keys(prefix), _owns_client=True, _url=url)

    @property
    def is_cluster(self) -> bool:
        return isinstance(self._client, RedisCluster)

    @contextlib.asynccontextmanager
    async def _admitted(self) -> AsyncIterator[None]:
        if self._gate is None:
            yield
            return
        try:
            async with asyncio.timeout(self._pool_timeout_s):
                await self._gate.acquire()
        except TimeoutError:
            raise StoreBusy(
                f"no Redis connection came free within {self._pool_timeout_s} s"
            ) from None
        try:
            yield
        finally:
            self._gate.release()

    # -- pipelines ---------------------------------------------------------------------------
    async def _pipelined(self, cmds: Sequence[_Cmd], *, independent: bool = False) -> list[Any]:
        """The answers to `cmds` in order, an Exception in the place of a command that failed.

        `independent`: on a cluster, a node that cannot be reached fails its own commands only
        (the others' answers still count); raises only when no node answered."""
        results = await self._send(cmds, independent)
        lost = [i for i, row in enumerate(results) if isinstance(row, NoScriptError)]
        if lost:
            scripts = {id(cmds[i].script): cmds[i].script for i in lost}
            for script in scripts.values():
                if script is not None:
                    await self._client.script_load(script.script)
            again = await self._send([cmds[i] for i in lost], independent)
            for i, row in zip(lost, again, strict=True):
                results[i] = row
        return results

    async def _send(self, cmds: Sequence[_Cmd], independent: bool) -> list[Any]:
        client = self._client
        if not independent or not isinstance(client, RedisCluster):
            return await self._pipeline(cmds)
        # One pipeline per node, one node after the other: redis-py's cluster pipeline fails as
        # a whole when one node does not answer, and then closes every connection of the client,
        # which would cut a healthy node's pipeline sent alongside. In turn, each node's answer
        # counts on its own (a round trip per node all the same).
        await client.initialize()  # a no-op once the slots are known
        groups: dict[str, list[int]] = {}
        for i, cmd in enumerate(cmds):
            node = client.get_node_from_key(cmd.key)
            groups.setdefault(node.name if node else "", []).append(i)
        results: list[Any] = [None] * len(cmds)
        errors: list[Exception] = []
        for idx in groups.values():
            try:
                rows = await self._pipeline([cmds[i] for i in idx])
            except _FAILURES as exc:
                errors.append(exc)
                rows = [exc] * len(idx)
            for i, row in zip(idx, rows, strict=True):
                results[i] = row
        if len(errors) == len(groups):
            raise errors[0]
        return results

    async def _pipeline(self, cmds: Sequence[_Cmd]) -> list[Any]:
        async with self._client.pipeline(transaction=False) as pipe:
            for cmd in cmds:
                pipe.execute_command(*cmd.args)
            return list(await pipe.execute(raise_on_error=False))

    @property
    def keys(self) -> Keys:
        return self._keys

    def _now(self) -> str:
        return "" if self._clock is None else repr(float(self._clock()))

    # -- decode reservations -------------------------------------------------------------
    @_store_call
    async def set_capacity(self, worker_id: str, capacity_blocks: int) -> None:
        check_count("capacity_blocks", capacity_blocks)
        await self._client.set(self._keys.decode_capacity(worker_id), int(capacity_blocks))

    @_store_call
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
        keys = self._keys.decode_worker(worker_id)
        args: list[str | int] = [
            self._now(),
            reservation_id,
            int(blocks),
            repr(float(lease_s)),
            max(0, int(overbook_blocks)),
        ]
        if intent is None:
            return Reserved(bool(await self._reserve(keys=keys, args=args)))
        check_count("nbytes", intent.nbytes)
        ledger = self._keys.stranded_worker(intent.prefill_id)
        pending: list[str | int] = [
            intent.request_id,
            int(intent.nbytes),
            repr(float(intent.ready_within_s)),
        ]
        if not isinstance(self._client, RedisCluster):
            # One server: one script for both, the intent written only with the blocks held.
            held = bool(await self._reserve(keys=keys + ledger, args=args + pending))
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
        reserve = _Cmd.run(self._reserve, keys, args)
        strand = _Cmd.run(self._strand, ledger, [self._now(), *pending])
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

    @_store_call
    async def renew(self, worker_id: str, reservation_id: str, lease_s: float) -> bool:
        check_lease(lease_s)
        keys = self._keys.decode_worker(worker_id)
        args = [self._now(), reservation_id, repr(float(lease_s))]
        return bool(await self._renew(keys=keys, args=args))

    @_store_call
    async def resize(
        self, worker_id: str, reservation_id: str, blocks: int, *, force: bool = False
    ) -> bool:
        check_count("blocks", blocks)
        keys = self._keys.decode_worker(worker_id)
        args: list[str | int] = [self._now(), reservation_id, int(blocks), "1" if force else "0"]
        return bool(await self._resize(keys=keys, args=args))

    @_store_call
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
        back = await self._renew_many(keys=self._keys.decode_worker(worker_id), args=args)
        return [_text(rid) for rid in back]

    @_store_call
    async def release(self, worker_id: str, reservation_id: str) -> int:
        keys = self._keys.decode_worker(worker_id)
        return int(await self._release(keys=keys, args=[self._now(), reservation_id]))

    @_store_call
    async def decode_usage(self, worker_ids: Iterable[str]) -> dict[str, DecodeUsage]:
        ids = list(dict.fromkeys(worker_ids))
        if not ids:
            return {}
        now = self._now()
        cmds = [_Cmd.run(self._usage, self._keys.decode_worker(w), [now]) for w in ids]
        rows = _raise_first(await self._pipelined(cmds))
        return {
            worker_id: DecodeUsage(int(cap), int(reserved), int(count))
            for worker_id, (cap, reserved, count) in zip(ids, rows, strict=True)
        }

    # -- stranded KV ledger --------------------------------------------------------------
    @_store_call
    async def strand(
        self, prefill_id: str, request_id: str, nbytes: int, ready_in_s: float = 0.0
    ) -> None:
        check_count("nbytes", nbytes)
        keys = self._keys.stranded_worker(prefill_id)
        args: list[str | int] = [self._now(), request_id, int(nbytes), repr(float(ready_in_s))]
        await self._strand(keys=keys, args=args)

    @_store_call
    async def mark_ready(self, prefill_id: str, request_id: str, age_s: float = 0.0) -> bool:
        keys = self._keys.stranded_worker(prefill_id)
        args = [self._now(), request_id, repr(float(age_s))]
        return bool(await self._mark_ready(keys=keys, args=args))

    @_store_call
    async def unstrand(self, prefill_id: str, request_id: str) -> int:
        keys = self._keys.stranded_worker(prefill_id)
        return int(await self._unstrand(keys=keys, args=[request_id]))

    @_store_call
    async def stranded_bytes(self, prefill_ids: Iterable[str]) -> dict[str, int]:
        ids = list(dict.fromkeys(prefill_ids))
        if not ids:
            return {}
        keys = [self._keys.stranded_sum(p) for p in ids]
        sums = _raise_first(await self._pipelined([_Cmd(("GET", k), k) for k in keys]))
        return {p: int(s or 0) for p, s in zip(ids, sums, strict=True)}

    @_store_call
    async def reap_stranded(self, prefill_id: str, older_than_s: float) -> list[StrandedEntry]:
        keys = self._keys.stranded_worker(prefill_id)
        flat = await self._reap(keys=keys, args=[self._now(), repr(float(older_than_s))])
        return [
            StrandedEntry(prefill_id, _text(flat[i]), int(flat[i + 1]), float(flat[i + 2]))
            for i in range(0, len(flat), 3)
        ]

    # -- the end of a request ---------------------------------------------------------------
    @_store_call
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
        cmds: list[_Cmd] = []
        if release is not None:
            worker_id, reservation_id = release
            keys = self._keys.decode_worker(worker_id)
            cmds.append(_Cmd.run(self._release, keys, [self._now(), reservation_id]))
            steps.append("release")
        if unstrand is not None:
            prefill_id, request_id = unstrand
            keys = self._keys.stranded_worker(prefill_id)
            cmds.append(_Cmd.run(self._unstrand, keys, [request_id]))
            steps.append("unstrand")
        if record is not None:
            class_keys, bucket = record
            for class_key in class_keys:
                key = self._keys.output_stats(class_key)
                cmds.append(_Cmd(("HINCRBY", key, str(int(bucket)), 1), key))
                steps.append("record")
        rows = await self._pipelined(cmds, independent=True) if cmds else []
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
    @_store_call
    async def note_request(self, count: int = 1) -> None:
        check_count("count", count)
        if count == 0:
            return
        await self._note_request(
            keys=[self._keys.retry_requests],
            args=[self._now(), RETRY_RETENTION_S, RETRY_TTL_S, int(count)],
        )

    @_store_call
    async def try_retry(self, policy: RetryBudgetPolicy) -> bool:
        check_policy(policy)
        allowed = await self._try_retry(
            keys=[self._keys.retry_requests, self._keys.retry_retries],
            args=[
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
    @_store_call
    async def record_output(self, class_keys: Sequence[str], bucket: int) -> None:
        if not class_keys:
            return
        # One HINCRBY per class: each is atomic on its own and the classes live in different
        # slots, so a pipeline (not a transaction) is all that is needed.
        keys = [self._keys.output_stats(c) for c in class_keys]
        _raise_first(
            await self._pipelined([_Cmd(("HINCRBY", k, str(int(bucket)), 1), k) for k in keys])
        )

    @_store_call
    async def output_histograms(self, class_keys: Sequence[str]) -> dict[str, Mapping[int, int]]:
        keys = list(dict.fromkeys(class_keys))
        if not keys:
            return {}
        names = [self._keys.output_stats(c) for c in keys]
        rows = _raise_first(await self._pipelined([_Cmd(("HGETALL", k), k) for k in names]))
        return {
            class_key: {int(b): int(n) for b, n in row.items()}
            for class_key, row in zip(keys, rows, strict=True)
        }

    # -- worker registry ---------------------------------------------------------------------
    @_store_call
    async def register_worker(self, worker_id: str, spec_json: str) -> None:
        await self._client.hset(self._keys.workers, check_id("worker_id", worker_id), spec_json)

    @_store_call
    async def unregister_worker(self, worker_id: str) -> bool:
        return bool(await self._client.hdel(self._keys.workers, worker_id))

    @_store_call
    async def registered_workers(self) -> dict[str, str]:
        raw = await self._client.hgetall(self._keys.workers)
        return {
            k.decode() if isinstance(k, bytes) else k: v.decode() if isinstance(v, bytes) else v
            for k, v in raw.items()
        }

    # -- drained workers ----------------------------------------------------------------------
    @_store_call
    async def set_drained(self, worker_id: str, drained: bool) -> bool:
        wid = check_id("worker_id", worker_id)
        if drained:
            return bool(await self._client.sadd(self._keys.drained, wid))
        return bool(await self._client.srem(self._keys.drained, wid))

    @_store_call
    async def drained_workers(self) -> set[str]:
        raw = await self._client.smembers(self._keys.drained)
        return {m.decode() if isinstance(m, bytes) else m for m in raw}

    # -- roles of `both` workers ----------------------------------------------------------------
    @_store_call
    async def worker_roles(self) -> dict[str, WorkerRole]:
        raw = await self._client.hgetall(self._keys.roles)
        return {_text(k): _role(_text(v)) for k, v in raw.items()}

    @_store_call
    async def set_role(self, worker_id: str, role: str, expect_version: int) -> WorkerRole | None:
        check_role(role)
        wid = check_id("worker_id", worker_id)
        args: list[str | int] = [self._now(), wid, role, int(expect_version)]
        rec = await self._set_role(keys=[self._keys.roles], args=args)
        return None if not rec else _role(_text(rec))

    @_store_call
    async def forget_role(self, worker_id: str) -> bool:
        return bool(await self._client.hdel(self._keys.roles, worker_id))

    @_store_call
    async def hold_lease(self, name: str, holder: str, ttl_s: float) -> bool:
        check_lease(ttl_s)
        args: list[str | int] = [holder, max(1, int(ttl_s * 1000))]
        return bool(await self._hold_lease(keys=[self._keys.lease(name)], args=args))

    @_store_call
    async def release_lease(self, name: str, holder: str) -> bool:
        return bool(await self._release_lease(keys=[self._keys.lease(name)], args=[holder]))

    # -- lifecycle ------------------------------------------------------------------------
    @_store_call
    async def check_marker(self, ttl_s: float) -> bool:
        # SET ... GET answers the old value: None means the key was not there.
        old = await self._client.set(self._keys.marker, "1", ex=max(1, int(ttl_s)), get=True)
        return old is None

    async def ping(self) -> bool:
        try:
            async with self._admitted():
                return bool(await self._client.ping())
        except (*_FAILURES, StoreError):
            return False

    async def ensure_reachable(self) -> None:
        """Ping, raising `StoreUnavailableError` (URL shown, password hidden) if Redis is silent."""
        try:
            await self._client.ping()
        except _FAILURES as exc:
            where = redact_url(self._url) if self._url else _describe(self._client)
            raise StoreUnavailableError(f"Redis at {where} did not answer: {exc}") from exc

    async def close(self) -> None:
        if self._owns_client:
            await self._client.aclose()

    def __repr__(self) -> str:
        where = redact_url(self._url) if self._url else _describe(self._client)
        clock = "server" if self._clock is None else "injected"
        return (
            f"RedisStore({where}, prefix={self._keys.prefix!r}, clock={clock}, "
            f"owns_client={self._owns_client})"
        )


def _role(record: str) -> WorkerRole:
    role, version, since = record.split("|")
    return WorkerRole(role, int(version), float(since))


def _describe(client: aioredis.Redis | RedisCluster) -> str:
    if isinstance(client, RedisCluster):
        return "cluster:" + ",".join(n.name for n in client.startup_nodes)
    kwargs = getattr(getattr(client, "connection_pool", None), "connection_kwargs", {})
    if "path" in kwargs:
        return f"unix:{kwargs['path']}"
    return f"{kwargs.get('host', '?')}:{kwargs.get('port', '?')}"
