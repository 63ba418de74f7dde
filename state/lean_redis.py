"""`LeanRedis`: one persistent Redis connection for the store's hot path (issue 24).

redis-py's asyncio client spends most of the store's CPU on a request (~6 commands in 3 round
trips) in its machinery: the blocking pool's `asyncio.Condition`, a `Connection` per call, the
encoder, the command parser and the retry wrapper. Here there is one `asyncio.Protocol` on the
router's own loop: commands are encoded to RESP bytes, `hiredis.Reader` parses the answers, and
answers are matched to waiting futures in the order the commands were written (Redis answers a
connection's commands in order). Commands issued in one loop turn go out in one
`transport.write` (flushed by one `call_soon`): concurrent requests share syscalls and round
trips, with nothing to wait for but the loop turn itself.

Guarantees (docs/reliability.md, rows 1, 6, 7):

- A call is bounded by `timeout_s` (the store's ``socket_timeout``). One timer per connection
  watches the oldest unanswered command; when it runs out, FIFO matching is lost, so the
  connection is torn down: the commands whose time ran out raise `TimeoutError` and are never
  sent again (they may have run); the others written behind them fail as `ConnectionClosed`.
- A call whose connection closed under it (Redis restarted, ``CLIENT KILL``, a teardown after
  another command's timeout) is sent once more on a fresh connection, at once; a second close
  raises. Commands Redis had already read may have run: every hot-path script is idempotent by
  id, only the output histogram's ``HINCRBY`` and the retry budget's count may count twice.
- Connecting is bounded by `connect_timeout_s`; a Redis that is down fails the call at once (no
  retry of a refused connect). The next call connects again: nothing reconnects in the
  background.
- Error answers are exception objects in the reply rows (`NoScriptError` for ``NOSCRIPT``, else
  `ResponseError`), for the caller to load scripts and resend; connection failures raise
  redis-py's own exception types, so `state.redis_conn.store_call` maps both as before.
- No message or repr holds the password: errors name the address only.

Not handled here, on purpose: TLS (``rediss://``), RESP3 and every connection option but the
address, credentials, database, client name and the two timeouts; `LeanRedis.for_pool` answers
None for such a pool and the store keeps redis-py for everything.
"""

from __future__ import annotations

import asyncio
import collections
import socket
from collections.abc import Callable, Sequence
from typing import Any, Self, cast

import hiredis
from redis.asyncio.connection import ConnectionPool, SSLConnection, UnixDomainSocketConnection
from redis.exceptions import AuthenticationError, NoScriptError, ResponseError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

__all__ = ["Arg", "ConnectionClosed", "LeanRedis", "encode_commands"]

Arg = str | bytes | int | float

# Pool options the lean connection implements; a pool with any other option set keeps redis-py.
_IMPLEMENTED = frozenset(
    {
        "host",
        "port",
        "path",
        "db",
        "username",
        "password",
        "socket_timeout",
        "socket_connect_timeout",
        "client_name",
    }
)
# redis-py's own bookkeeping in a pool's connection kwargs (no behaviour asked for by the URL),
# and the store's `retry` (resend once on a closed connection), which `execute` does itself.
_INTERNAL_PREFIXES = ("himport_registry", "maint_notifications", "orig_")
_INTERNAL = frozenset({"retry"})

# hiredis's stub types the command as a 1-tuple; it takes any number of arguments.
_pack: Callable[[tuple[Arg, ...]], bytes] = cast(Any, hiredis.pack_command)
_MORE = object()  # hiredis's answer when the buffer holds no whole reply yet


class ConnectionClosed(RedisConnectionError):
    """The connection closed before these commands were answered: they are sent once more."""


def _reply_error(message: str) -> ResponseError:
    # Only NOSCRIPT needs telling apart (the caller loads the script and sends again).
    if message.startswith("NOSCRIPT"):
        return NoScriptError(message)
    return ResponseError(message)


def encode_commands(commands: Sequence[Sequence[Arg]]) -> bytes:
    """Commands as RESP arrays of bulk strings, one bytes object for one write: hiredis's C
    encoder (half the CPU of a Python one, every command of every request goes through here).
    It takes bytes, str (UTF-8), int and float (as repr), and refuses a bool or None with a
    TypeError, as redis-py does: such an argument is a bug in the caller, not a value."""
    if len(commands) == 1:
        (command,) = commands
        return _pack(command if type(command) is tuple else tuple(command))
    return b"".join([_pack(c if type(c) is tuple else tuple(c)) for c in commands])


class _Waiter:
    """`count` answers owed to `future`, which gets them as one list; `deadline` in loop time."""

    __slots__ = ("count", "deadline", "future", "rows")

    def __init__(self, future: asyncio.Future[list[Any]], count: int, deadline: float) -> None:
        self.future = future
        self.count = count
        self.deadline = deadline
        self.rows: list[Any] = []


class _RespProtocol(asyncio.Protocol):
    """One connection: writes batched per loop turn, answers matched in FIFO order, one timer
    for the oldest unanswered command. Once closed it stays closed (`closed` says why)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, timeout_s: float, where: str) -> None:
        self._loop = loop
        self._timeout_s = timeout_s
        self._where = where
        self._reader = hiredis.Reader(replyError=_reply_error, notEnoughData=_MORE)
        self._transport: asyncio.Transport | None = None
        self._waiting: collections.deque[_Waiter] = collections.deque()
        self._out: list[bytes] = []
        self._batch_deadline = 0.0  # shared by the commands of one loop turn
        self._timer: asyncio.TimerHandle | None = None
        self.closed: str | None = None
        self.lost: asyncio.Future[None] = loop.create_future()

    # -- asyncio.Protocol -------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports do not derive from asyncio.Transport: no isinstance check.
        self._transport = cast(asyncio.Transport, transport)
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            # Small requests answered at once: never wait for Nagle's acknowledgement.
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        reader, waiting = self._reader, self._waiting
        reader.feed(data)
        try:
            while (reply := reader.gets()) is not _MORE:
                waiter = waiting[0]
                waiter.rows.append(reply)
                if len(waiter.rows) == waiter.count:
                    waiting.popleft()
                    if not waiter.future.done():  # done: its caller was cancelled
                        waiter.future.set_result(waiter.rows)
        except (hiredis.ProtocolError, IndexError) as exc:
            # Garbage, or an answer nobody asked for: the order of answers means nothing now.
            reason = f"unreadable answer from {self._where} ({type(exc).__name__})"
            self._tear_down(reason, resend=False)

    def connection_lost(self, exc: Exception | None) -> None:
        self._tear_down(f"Redis at {self._where} closed the connection")
        if not self.lost.done():
            self.lost.set_result(None)

    # -- sending ----------------------------------------------------------------------------
    def send(self, payload: bytes, count: int) -> asyncio.Future[list[Any]]:
        """The `count` answers to the commands in `payload`, once they come."""
        if self.closed is not None:
            raise ConnectionClosed(self.closed)
        future = self._loop.create_future()
        if not self._out:  # the first command of this loop turn
            self._loop.call_soon(self._flush)
            self._batch_deadline = self._loop.time() + self._timeout_s
        self._out.append(payload)
        self._waiting.append(_Waiter(future, count, self._batch_deadline))
        if self._timer is None:
            self._timer = self._loop.call_at(self._batch_deadline, self._check_deadline)
        return future

    def _flush(self) -> None:
        if self._out and self.closed is None and self._transport is not None:
            self._transport.write(b"".join(self._out))
        self._out.clear()

    def _check_deadline(self) -> None:
        self._timer = None
        if not self._waiting:
            return  # the next send sets the timer again
        deadline = self._waiting[0].deadline
        if deadline > self._loop.time():
            self._timer = self._loop.call_at(deadline, self._check_deadline)
            return
        self._tear_down(f"a command before this one timed out on {self._where}", timed_out=True)

    # -- closing ----------------------------------------------------------------------------
    def close(self) -> None:
        # Not to be resent: a resend would open a connection the closing store never closes.
        self._tear_down(f"the connection to {self._where} was closed by the store", resend=False)

    def _tear_down(self, reason: str, *, timed_out: bool = False, resend: bool = True) -> None:
        """Fail every unanswered command and drop the connection. With `timed_out`, those whose
        deadline has passed raise TimeoutError (never sent again); the others fail as
        `ConnectionClosed` (sent once more) if `resend`, else as a plain ConnectionError."""
        if self.closed is not None:
            return
        self.closed = reason
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        now = self._loop.time()
        waiting, self._waiting = self._waiting, collections.deque()
        self._out.clear()
        for waiter in waiting:
            if waiter.future.done():
                continue
            if timed_out and waiter.deadline <= now:
                error: Exception = RedisTimeoutError(
                    f"Redis at {self._where} did not answer within {self._timeout_s} s"
                )
            elif resend:
                error = ConnectionClosed(reason)
            else:
                error = RedisConnectionError(reason)
            waiter.future.set_exception(error)
        if self._transport is not None:
            # abort, not close: unsent bytes must not reach Redis after their callers failed.
            self._transport.abort()


class LeanRedis:
    """A lazily (re)connected `_RespProtocol` with the resend-once rule and the handshake (AUTH,
    SELECT, CLIENT SETNAME). Lives on one event loop: the one of its first call."""

    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        port: int = 6379,
        path: str | None = None,
        db: int = 0,
        username: str | None = None,
        password: str | None = None,
        client_name: str | None = None,
        timeout_s: float = 10.0,
        connect_timeout_s: float = 5.0,
    ) -> None:
        self._host, self._port, self._path = host, port, path
        self._db = int(db)
        self._username, self._password = username, password
        self._client_name = client_name
        self._timeout_s = float(timeout_s)
        self._connect_timeout_s = float(connect_timeout_s)
        self._conn: _RespProtocol | None = None
        self._connecting: asyncio.Task[_RespProtocol] | None = None

    @classmethod
    def for_pool(cls, pool: ConnectionPool) -> Self | None:
        """A lean twin of `pool`'s connections (same address, credentials, database and
        timeouts), or None when they use something it does not implement (TLS, RESP3, ...)."""
        kind = pool.connection_class
        if issubclass(kind, SSLConnection):
            return None
        options = {
            name: value
            for name, value in pool.connection_kwargs.items()
            if name not in _INTERNAL and not name.startswith(_INTERNAL_PREFIXES)
        }
        if not options.keys() <= _IMPLEMENTED:
            return None
        if issubclass(kind, UnixDomainSocketConnection) != ("path" in options):
            return None
        timeout = options.pop("socket_timeout", None) or 10.0
        connect_timeout = options.pop("socket_connect_timeout", None) or timeout
        return cls(**options, timeout_s=timeout, connect_timeout_s=connect_timeout)

    @property
    def where(self) -> str:
        return f"unix:{self._path}" if self._path else f"{self._host}:{self._port}"

    def __repr__(self) -> str:
        state = "connected" if self._conn is not None and self._conn.closed is None else "idle"
        return f"LeanRedis({self.where}, db={self._db}, {state})"

    # -- calls --------------------------------------------------------------------------------
    async def execute(self, commands: Sequence[Sequence[Arg]]) -> list[Any]:
        """The answers to `commands`, pipelined with whatever else this loop turn sends; an
        error answer is an exception object in its row. Raises `ConnectionClosed` (closed twice),
        `TimeoutError` or `ConnectionError` (redis-py's) when there is no answer."""
        payload = encode_commands(commands)
        conn = await self._connection()
        try:
            return await conn.send(payload, len(commands))
        except ConnectionClosed:
            # Closed under the call (Redis restarted, the client killed): once more, fresh.
            conn = await self._connection()
            return await conn.send(payload, len(commands))

    async def close(self) -> None:
        """Drop the connection (a later call opens a new one), waiting until it is gone."""
        task, self._connecting = self._connecting, None
        if task is not None:
            task.cancel()
            await asyncio.wait([task])
            if not task.cancelled() and task.exception() is None:
                task.result().close()
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()
            await asyncio.wait([conn.lost], timeout=1.0)

    # -- connecting ---------------------------------------------------------------------------
    async def _connection(self) -> _RespProtocol:
        conn = self._conn
        if conn is not None and conn.closed is None:
            return conn
        if self._connecting is None:
            self._connecting = asyncio.get_running_loop().create_task(self._connect())
        # Shared by every call arriving meanwhile; shielded so that one caller's cancellation
        # does not cut the connect the others wait for.
        return await asyncio.shield(self._connecting)

    async def _connect(self) -> _RespProtocol:
        try:
            async with asyncio.timeout(self._connect_timeout_s):
                conn = await self._open()
                try:
                    await self._handshake(conn)
                except BaseException:
                    conn.close()
                    raise
        except TimeoutError:
            raise RedisTimeoutError(
                f"connecting to Redis at {self.where} timed out after {self._connect_timeout_s} s"
            ) from None
        except OSError as exc:
            raise RedisConnectionError(
                f"could not connect to Redis at {self.where}: {exc.strerror or exc}"
            ) from exc
        finally:
            self._connecting = None
        self._conn = conn
        return conn

    async def _open(self) -> _RespProtocol:
        loop = asyncio.get_running_loop()
        conn = _RespProtocol(loop, self._timeout_s, self.where)
        if self._path:
            await loop.create_unix_connection(lambda: conn, self._path)
        else:
            await loop.create_connection(lambda: conn, self._host, self._port)
        return conn

    async def _handshake(self, conn: _RespProtocol) -> None:
        """AUTH, SELECT and CLIENT SETNAME in one write; an error answer names the step only
        (never its arguments: AUTH's hold the password)."""
        steps: list[tuple[str, tuple[Arg, ...]]] = []
        if self._password:
            user = (self._username,) if self._username else ()
            steps.append(("AUTH", ("AUTH", *user, self._password)))
        if self._db:
            steps.append(("SELECT", ("SELECT", self._db)))
        if self._client_name:
            steps.append(("CLIENT SETNAME", ("CLIENT", "SETNAME", self._client_name)))
        if not steps:
            return
        rows = await conn.send(encode_commands([cmd for _, cmd in steps]), len(steps))
        for (step, _), row in zip(steps, rows, strict=True):
            if isinstance(row, ResponseError):
                kind = AuthenticationError if step == "AUTH" else RedisConnectionError
                raise kind(f"Redis at {self.where} refused {step}: {row}")
