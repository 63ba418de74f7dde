"""The Redis connection under `RedisStore` (state/redis_store.py): one server or a cluster, the
bounded wait for a connection, and pipelines of single-slot commands.

One client or the other: `redis.asyncio.Redis` for one server, `redis.asyncio.RedisCluster` for
a cluster (a ``redis+cluster://`` URL, see `from_url`). Scripts inside a pipeline are sent as
``EVALSHA`` by hand, for both: redis-py's single-node pipeline would first ask ``SCRIPT EXISTS``
(one more round trip per call), and its cluster pipeline refuses `evalsha` outright because it
cannot load a missing script. Here a ``NOSCRIPT`` answer (a node restarted, or failed over to a
replica that never saw the script) loads the scripts (on every primary of a cluster) and sends
again just the commands that got it: a command that answered ``NOSCRIPT`` never ran.

The hot path (the request's reservation, ledger and end-of-request calls, the renewals): on one
server, a store built by `from_url` also holds a `LeanRedis` (state/lean_redis.py), one
pipelining connection that costs a fraction of redis-py's CPU per call; `_hot_pipeline` and
`_hot_script` use it, and fall back to redis-py where there is none (a cluster, TLS, a URL
option it does not implement, an injected client). Everything else stays on redis-py: the
lean connection hands back Redis's answers as they come, without redis-py's reply callbacks
(HGETALL as a flat list, SMEMBERS as a list), so only commands whose raw answers the caller
reads go through it.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterable, Sequence
from typing import Any, Concatenate, ParamSpec, Self, TypeVar, cast
from urllib.parse import urlsplit, urlunsplit

import redis.asyncio as aioredis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.commands.core import AsyncScript
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, RedisClusterException, RedisError

from state.base import StoreBusy, StoreError
from state.keys import DEFAULT_PREFIX, Keys
from state.lean_redis import LeanRedis
from state.redact import mask_url, mask_urls

__all__ = [
    "CLUSTER_SCHEMES",
    "FAILURES",
    "Cmd",
    "RedisConnection",
    "StoreUnavailableError",
    "hash_pairs",
    "is_cluster_url",
    "raise_first",
    "redact_url",
    "store_call",
    "text",
]

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
# Redis, that returns connections late (docs/history/reliability.md measures it).
# redis-py's cluster client has no blocking pool: each node's pool raises past its cap. On a
# cluster the store itself admits at most `max_connections` calls at once (a call uses at most
# one connection per node), and a call waits up to `pool_timeout_s` for its turn: the same
# bound per node and the same wait as the single-node pool.
DEFAULT_MAX_CONNECTIONS = 64
DEFAULT_POOL_TIMEOUT_S = 10.0

# What the clients raise: RedisClusterException (no node reachable, slots not covered) is not a
# RedisError; OSError covers the sockets and TimeoutError.
FAILURES = (RedisError, RedisClusterException, OSError)

_P = ParamSpec("_P")
_R = TypeVar("_R")
_C = TypeVar("_C", bound="RedisConnection")


def store_call(
    fn: Callable[Concatenate[_C, _P], Coroutine[Any, Any, _R]],
) -> Callable[Concatenate[_C, _P], Coroutine[Any, Any, _R]]:
    """Redis's and the socket's failures leave a store method as one `StoreError`, so callers
    (and the router's one error mapping) have a single thing to handle."""

    @functools.wraps(fn)
    async def call(self: _C, /, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        try:
            if self._gate is None:  # one server: its blocking pool bounds the wait
                return await fn(self, *args, **kwargs)
            async with self._admitted():
                return await fn(self, *args, **kwargs)
        except StoreBusy:
            raise
        except FAILURES as exc:
            if isinstance(exc, RedisConnectionError) and isinstance(exc.__cause__, TimeoutError):
                # The blocking pool's wait ran out ("No connection available."): nothing was
                # sent, the store is not at fault.
                raise StoreBusy(f"no Redis connection came free ({fn.__name__})") from exc
            # Type and text, not repr(): redis-py 8's repr is its category alone
            # ("network:TimeoutError"), which hides what happened.
            problem = mask_urls(f"{type(exc).__name__}: {exc}")
            raise StoreError(f"the state store failed ({fn.__name__}): {problem}") from exc

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
        raise ValueError(f"bad cluster URL {redact_url(url)}: {mask_urls(str(exc))}") from None


# The one masking rule (state/redact.py), under the name state has always exported.
redact_url = mask_url


def _url_problem(url: str, exc: Exception) -> str:
    """What redis-py found wrong with `url`, unless the URL holds credentials: its messages
    quote pieces of the URL, and a password with an unescaped '#' or '/' is read as a port
    ("Port could not be cast to integer value as 'p4ss'")."""
    if mask_url(url) == url:
        return str(exc)
    return (
        "a port that is not a number, or a password with an unescaped '#', '/', '?' or '@' "
        "(percent-encode it)"
    )


def text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class Cmd:
    """One command of a pipeline, as sent; `script` is set for an ``EVALSHA`` (to load it
    again after ``NOSCRIPT``), `key` is the key that places it on a cluster node."""

    __slots__ = ("args", "key", "script")

    def __init__(self, args: tuple[Any, ...], key: str, script: AsyncScript | None = None):
        self.args = args
        self.key = key
        self.script = script

    @classmethod
    def run(cls, script: AsyncScript, keys: Sequence[str], args: Sequence[Any]) -> Cmd:
        return cls(("EVALSHA", script.sha, len(keys), *keys, *args), keys[0], script)

    def __repr__(self) -> str:
        return f"Cmd({self.args[0]} {self.key})"


def hash_pairs(answer: Any) -> Iterable[tuple[Any, Any]]:
    """A hash's fields and values: redis-py's HGETALL answers a dict; a script, or the lean
    connection's HGETALL (raw answers, state/lean_redis.py), a flat list."""
    if isinstance(answer, dict):
        return answer.items()
    return zip(answer[::2], answer[1::2], strict=True)


def raise_first(results: list[Any]) -> list[Any]:
    for row in results:
        if isinstance(row, Exception):
            raise row
    return results


class RedisConnection:
    """A Redis or Redis Cluster client with the store's bounded wait and pipelines. Owns its
    client only when built by `from_url`."""

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
        _lean: LeanRedis | None = None,
    ) -> None:
        self._client = client
        # The hot path's connection (see the module docstring); None: redis-py for everything.
        self._lean = _lean
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
        self._register_scripts(client.register_script)

    def _register_scripts(self, register: Callable[[str], AsyncScript]) -> None:
        """A subclass registers its Lua scripts here (`RedisStore`); a bare connection has none."""

    @classmethod
    def from_url(
        cls,
        url: str,
        prefix: str = DEFAULT_PREFIX,
        *,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        pool_timeout_s: float = DEFAULT_POOL_TIMEOUT_S,
        clock: Callable[[], float] | None = None,
        lean: bool = True,
    ) -> Self:
        """A store on a client of its own (closed by `close`). Does no I/O: `ping` to check.

        At most `max_connections` connections (per node on a cluster); a call finding them all
        busy waits up to `pool_timeout_s` for one, then fails with StoreError.
        ``redis+cluster://`` and ``rediss+cluster://`` URLs name a Redis Cluster by one or more
        comma-separated seed nodes.

        On one server the hot path runs on a `LeanRedis` of the same address, credentials,
        database and timeouts, unless `lean` is False or the URL asks for what it does not
        implement (``rediss://``, see `LeanRedis.for_pool`). `clock`: see `__init__`."""
        if is_cluster_url(url):
            cluster = _cluster_client(url, max_connections)
            return cls(
                cluster,
                Keys(prefix),
                clock,
                _owns_client=True,
                _url=url,
                _max_calls=max_connections,
                _pool_timeout_s=pool_timeout_s,
            )
        # URL query options (e.g. ?socket_connect_timeout=1) override these defaults.
        try:
            pool = aioredis.BlockingConnectionPool.from_url(
                url,
                max_connections=max_connections,
                timeout=pool_timeout_s,
                socket_connect_timeout=5.0,
                socket_timeout=10.0,
                # After Redis restarts, every pooled connection is dead until used: a call that
                # finds its connection closed is sent once more on a fresh one (at once),
                # instead of failing a request against a Redis that is back. Only a closed
                # connection: a timed-out command may have run, and is not sent twice.
                retry=Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,)),
            )
        except ValueError as exc:
            raise ValueError(f"bad Redis URL {mask_url(url)}: {_url_problem(url, exc)}") from None
        client = aioredis.Redis.from_pool(pool)  # owns the pool: aclose() disconnects it
        return cls(
            client,
            Keys(prefix),
            clock,
            _owns_client=True,
            _url=url,
            _lean=LeanRedis.for_pool(pool) if lean else None,
        )

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
    async def _pipelined(self, cmds: Sequence[Cmd], *, independent: bool = False) -> list[Any]:
        """The answers to `cmds` in order, an Exception in the place of a command that failed.

        `independent`: on a cluster, a node that cannot be reached fails its own commands only
        (the others' answers still count); raises only when no node answered."""
        results = await self._send(cmds, independent)
        if any(isinstance(row, NoScriptError) for row in results):
            await self._send_again_with_scripts(
                cmds,
                results,
                lambda again: self._send(again, independent),
                self._client.script_load,
            )
        return results

    async def _hot_pipeline(self, cmds: Sequence[Cmd], *, independent: bool = False) -> list[Any]:
        """`_pipelined` on the lean connection when the store has one. Only for commands whose
        raw answer the caller reads (scripts, GET, HINCRBY): no redis-py reply callbacks."""
        lean = self._lean
        if lean is None:
            return await self._pipelined(cmds, independent=independent)
        results = await lean.execute([cmd.args for cmd in cmds])
        if any(isinstance(row, NoScriptError) for row in results):
            await self._send_again_with_scripts(
                cmds,
                results,
                lambda again: lean.execute([cmd.args for cmd in again]),
                lambda script: lean.execute([("SCRIPT", "LOAD", script)]),
            )
        return results

    async def _hot_script(
        self, script: AsyncScript, keys: Sequence[str], args: Sequence[Any]
    ) -> Any:
        """One script's answer (raised when it is an error), on the lean connection when the
        store has one."""
        lean = self._lean
        if lean is None:
            return await script(keys=keys, args=args)
        # `_hot_pipeline`'s steps written out for one command: this is most of the store's calls.
        command = ("EVALSHA", script.sha, len(keys), *keys, *args)
        (row,) = await lean.execute((command,))
        if isinstance(row, NoScriptError):
            await lean.execute((("SCRIPT", "LOAD", cast(str, script.script)),))  # a str constant
            (row,) = await lean.execute((command,))
        if isinstance(row, Exception):
            raise row
        return row

    @staticmethod
    async def _send_again_with_scripts(
        cmds: Sequence[Cmd],
        results: list[Any],
        send: Callable[[list[Cmd]], Awaitable[list[Any]]],
        load: Callable[[Any], Awaitable[Any]],
    ) -> None:
        """After ``NOSCRIPT`` answers (the server restarted, or failed over, without the
        scripts): load each script missing, then send again just the commands that got it
        (they never ran), their new answers put in their places in `results`."""
        lost = [i for i, row in enumerate(results) if isinstance(row, NoScriptError)]
        scripts = {id(cmds[i].script): cmds[i].script for i in lost}
        for script in scripts.values():
            if script is not None:
                await load(script.script)
        again = await send([cmds[i] for i in lost])
        for i, row in zip(lost, again, strict=True):
            results[i] = row

    async def _send(self, cmds: Sequence[Cmd], independent: bool) -> list[Any]:
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
            except FAILURES as exc:
                errors.append(exc)
                rows = [exc] * len(idx)
            for i, row in zip(idx, rows, strict=True):
                results[i] = row
        if len(errors) == len(groups):
            raise errors[0]
        return results

    async def _pipeline(self, cmds: Sequence[Cmd]) -> list[Any]:
        async with self._client.pipeline(transaction=False) as pipe:
            for cmd in cmds:
                pipe.execute_command(*cmd.args)
            return list(await pipe.execute(raise_on_error=False))

    @property
    def keys(self) -> Keys:
        return self._keys

    def _now(self) -> str:
        return "" if self._clock is None else repr(float(self._clock()))

    async def ping(self) -> bool:
        try:
            async with self._admitted():
                return bool(await self._client.ping())
        except (*FAILURES, StoreError):
            return False

    async def ensure_reachable(self) -> None:
        """Ping, raising `StoreUnavailableError` (URL shown, password hidden) if Redis is silent."""
        try:
            await self._client.ping()
        except FAILURES as exc:
            where = redact_url(self._url) if self._url else _describe(self._client)
            raise StoreUnavailableError(
                f"Redis at {where} did not answer: {mask_urls(str(exc))}"
            ) from exc

    async def close(self) -> None:
        if self._lean is not None:
            await self._lean.close()
        if self._owns_client:
            await self._client.aclose()

    def __repr__(self) -> str:
        where = redact_url(self._url) if self._url else _describe(self._client)
        clock = "server" if self._clock is None else "injected"
        return (
            f"{type(self).__name__}({where}, prefix={self._keys.prefix!r}, clock={clock}, "
            f"owns_client={self._owns_client}, lean={self._lean is not None})"
        )


def _describe(client: aioredis.Redis | RedisCluster) -> str:
    if isinstance(client, RedisCluster):
        return "cluster:" + ",".join(n.name for n in client.startup_nodes)
    kwargs = getattr(getattr(client, "connection_pool", None), "connection_kwargs", {})
    if "path" in kwargs:
        return f"unix:{kwargs['path']}"
    return f"{kwargs.get('host', '?')}:{kwargs.get('port', '?')}"
