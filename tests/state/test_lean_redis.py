"""The hot path's lean Redis connection (state/lean_redis.py, issue 24) against a real Redis.

- hundreds of concurrent calls pipelined on one connection, each given its own answers;
- a connection closed by Redis (``CLIENT KILL``) between calls and under a call: sent once more,
  on a fresh connection; a server that hangs up every time: sent twice, then an error;
- ``NOSCRIPT`` after ``SCRIPT FLUSH`` (a private server): the scripts loaded, only the commands
  that got it sent again;
- a command that never answers (``BLPOP`` on this connection only: nothing server-wide): a
  timeout, the connection torn down, the commands behind it sent again, never the timed-out one;
- a Redis that is not listening, and one that never answers the handshake: prompt StoreErrors
  that do not show the password; AUTH and SELECT from the URL; a unix socket;
- the conformance suite's store tests (tests/state/test_state_conformance.py) again on a store whose
  hot path is the lean connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import os
import shutil
import socket
import subprocess
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import pytest
import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from state import Keys, RedisStore, StoreError
from state.base import StateStore, StrandIntent
from state.lean_redis import ConnectionClosed, LeanRedis, encode_commands
from tests.conftest import REDIS_URL
from tests.redis_cluster import die_with_parent
from tests.redis_server import PrivateRedis
from tests.session_redis import port_of
from tests.state import test_state_conformance as conformance

LONG = 300.0


def _lean(**options: Any) -> LeanRedis:
    return LeanRedis(host="127.0.0.1", port=port_of(REDIS_URL), **options)


@contextlib.asynccontextmanager
async def _admin(url: str = REDIS_URL) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis.from_url(url)
    try:
        yield client
    finally:
        await client.aclose()


async def _client_id(lean: LeanRedis) -> int:
    (client_id,) = await lean.execute([("CLIENT", "ID")])
    return int(client_id)


@contextlib.asynccontextmanager
async def _closing(lean: LeanRedis) -> AsyncIterator[LeanRedis]:
    try:
        yield lean
    finally:
        await lean.close()


# -- framing and pipelining --------------------------------------------------------------------


def test_commands_are_encoded_as_resp_arrays() -> None:
    assert encode_commands([("SET", "k", b"v\r\n"), ("INCRBY", "n", 7)]) == (
        b"*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$3\r\nv\r\n\r\n*3\r\n$6\r\nINCRBY\r\n$1\r\nn\r\n$1\r\n7\r\n"
    )
    assert encode_commands([("ZADD", "z", 1.5, "m")]).count(b"$3\r\n1.5\r\n") == 1
    # Lengths in bytes, not characters, for text that is not ASCII.
    assert encode_commands([("SET", "é", 1)]) == b"*3\r\n$3\r\nSET\r\n$2\r\n\xc3\xa9\r\n$1\r\n1\r\n"
    # A float as its repr (what the scripts' tonumber reads back exactly); a command given as
    # a list encodes as the same tuple would.
    assert encode_commands([["ZADD", "z", 0.1 + 0.2, "m"]]) == encode_commands(
        [("ZADD", "z", "0.30000000000000004", "m")]
    )
    with pytest.raises(TypeError):
        encode_commands([("SET", "k", None)])  # type: ignore[list-item]
    with pytest.raises(TypeError):
        encode_commands([("SET", "k", True)])


async def test_hundreds_of_concurrent_calls_share_one_connection_and_get_their_answers(
    redis_prefix: str,
) -> None:
    name = f"lean-{uuid.uuid4().hex[:8]}"
    async with _closing(_lean(client_name=name)) as lean:

        async def call(i: int) -> list[Any]:
            key = f"{redis_prefix}k{i}"
            return await lean.execute([("SET", key, i), ("INCRBY", key, i), ("GET", key)])

        rows = await asyncio.gather(*(call(i) for i in range(600)))
        assert rows == [[b"OK", 2 * i, str(2 * i).encode()] for i in range(600)]
        # An error answer is an exception in its row; the rows around it are unaffected.
        ok, bad, ok2 = await lean.execute([("PING",), ("INCR", f"{redis_prefix}k1", 1), ("PING",)])
        assert (ok, ok2) == (b"PONG", b"PONG") and "wrong number" in str(bad)
        async with _admin() as admin:
            mine = [c for c in await admin.client_list() if c["name"] == name]
        assert len(mine) == 1, mine  # one connection carried all 600 calls


async def test_callers_cancelled_mid_flight_do_not_shift_the_others_answers(
    redis_prefix: str,
) -> None:
    async with _closing(_lean()) as lean:
        calls = [
            asyncio.ensure_future(lean.execute([("INCRBY", f"{redis_prefix}c{i}", i)]))
            for i in range(200)
        ]
        await asyncio.sleep(0)  # written, not answered yet
        for call in calls[::2]:
            call.cancel()
        await asyncio.gather(*calls, return_exceptions=True)
        assert [await c for c in calls[1::2]] == [[i] for i in range(1, 200, 2)]
        assert await lean.execute([("GET", f"{redis_prefix}c7")]) == [b"7"]


async def test_calls_in_flight_when_the_store_closes_fail_and_open_nothing(
    redis_prefix: str,
) -> None:
    name = f"lean-{uuid.uuid4().hex[:8]}"
    lean = _lean(client_name=name)
    stuck = asyncio.ensure_future(lean.execute([("BLPOP", f"{redis_prefix}never", 0)]))
    await asyncio.sleep(0.1)
    await lean.close()
    with pytest.raises(RedisConnectionError):
        await stuck
    await asyncio.sleep(0.1)
    async with _admin() as admin:
        assert not [c for c in await admin.client_list() if c["name"] == name]


async def test_the_store_reserves_exactly_its_capacity_under_a_burst(redis_prefix: str) -> None:
    store = RedisStore.from_url(REDIS_URL, redis_prefix)
    try:
        assert "lean=True" in repr(store)
        await store.set_capacity("d1", 150)
        held = await asyncio.gather(*(store.reserve("d1", f"r{i}", 1, LONG) for i in range(400)))
        assert sum(r.held for r in held) == 150
        usage = await store.decode_usage(["d1"])
        assert usage["d1"].reserved_blocks == 150
    finally:
        await store.close()


# -- closed connections ---------------------------------------------------------------------------


async def test_a_connection_killed_between_calls_is_replaced() -> None:
    async with _closing(_lean()) as lean, _admin() as admin:
        first = await _client_id(lean)
        assert await admin.client_kill_filter(_id=str(first)) == 1
        assert await lean.execute([("PING",)]) == [b"PONG"]
        assert await _client_id(lean) != first


async def test_a_call_whose_connection_closes_under_it_is_sent_once_more() -> None:
    async with _closing(_lean()) as lean:
        first = await _client_id(lean)
        # One write: the connection kills itself, then asks for its id. Redis answers the kill
        # and closes without reading on, so the second call finds its connection closed.
        kill = lean.execute([("CLIENT", "KILL", "ID", first, "SKIPME", "no")])
        again = lean.execute([("CLIENT", "ID")])
        killed, (second,) = await asyncio.gather(kill, again)
        assert killed == [1]
        assert second != first  # answered on a fresh connection


async def test_a_server_that_hangs_up_every_time_gets_two_tries() -> None:
    connections = 0

    async def hang_up(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        await reader.read(1)
        writer.close()

    server = await asyncio.start_server(hang_up, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        async with _closing(LeanRedis(port=port)) as lean:
            with pytest.raises(ConnectionClosed):
                await lean.execute([("PING",)])
        assert connections == 2
    finally:
        server.close()
        await server.wait_closed()


# -- NOSCRIPT -------------------------------------------------------------------------------------


async def test_noscript_after_a_script_flush_loads_and_resends_only_those() -> None:
    with PrivateRedis() as server:
        store = RedisStore.from_url(server.url, "t:")
        try:
            await store.set_capacity("d1", 10)
            assert (await store.reserve("d1", "r1", 4, LONG)).held
            async with _admin(server.url) as admin:
                await admin.script_flush()
                # The end of a request: two scripts (NOSCRIPT) and a HINCRBY (ran once).
                done = await store.finish(("d1", "r1"), ("p1", "q1"), (["c"], 2))
                assert (done.released_blocks, done.unstranded_bytes, done.recorded) == (4, 0, True)
                assert await admin.hgetall("t:{os:c}") == {b"2": b"1"}
                await admin.script_flush()
                assert (await store.reserve("d1", "r2", 3, LONG)).held
        finally:
            await store.close()


# -- timeouts -------------------------------------------------------------------------------------


async def test_a_timed_out_call_tears_the_connection_down_and_is_not_sent_again(
    redis_prefix: str,
) -> None:
    name = f"lean-{uuid.uuid4().hex[:8]}"
    async with _closing(_lean(timeout_s=0.5, client_name=name)) as lean:
        first = await _client_id(lean)
        # BLPOP with no timeout blocks this connection only; nothing server-wide is paused.
        stuck = asyncio.ensure_future(lean.execute([("BLPOP", f"{redis_prefix}never", 0)]))
        await asyncio.sleep(0.2)
        behind = asyncio.ensure_future(lean.execute([("PING",)]))  # written after it
        started = time.monotonic()
        with pytest.raises(RedisTimeoutError):
            await stuck
        assert time.monotonic() - started < 1.0
        assert await behind == [b"PONG"]  # its connection torn down: sent once more
        assert await _client_id(lean) != first
        await asyncio.sleep(0.1)
        async with _admin() as admin:
            blocked = [c for c in await admin.client_list() if c["name"] == name]
        assert all(c["cmd"] != "blpop" for c in blocked), blocked  # BLPOP was not resent


async def test_a_url_socket_timeout_reaches_the_lean_connection(redis_prefix: str) -> None:
    store = RedisStore.from_url(f"{REDIS_URL}?socket_timeout=0.4&socket_connect_timeout=0.3")
    try:
        lean = store._lean
        assert lean is not None
        with pytest.raises(RedisTimeoutError):
            await lean.execute([("BLPOP", f"{redis_prefix}never", 0)])
        assert await store.ping()
    finally:
        await store.close()


# -- Redis not there, credentials -------------------------------------------------------------


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])  # closed again: nothing listens there


async def test_a_redis_that_is_not_listening_fails_promptly_with_a_store_error() -> None:
    store = RedisStore.from_url(f"redis://:hunter2@127.0.0.1:{_closed_port()}/0")
    try:
        calls: list[Callable[[], Any]] = [
            lambda: store.reserve("d1", "r1", 1, LONG),
            lambda: store.mark_ready("p1", "q1"),
            lambda: store.finish(("d1", "r1"), ("p1", "q1"), (["c"], 1)),
            lambda: store.renew_many("d1", {"r1": 1}, LONG),
        ]
        for call in calls:
            started = time.monotonic()
            with pytest.raises(StoreError) as info:
                await call()
            assert time.monotonic() - started < 1.0
            assert "hunter2" not in str(info.value) and "hunter2" not in repr(info.value)
            assert isinstance(info.value.__cause__, RedisConnectionError)
    finally:
        await store.close()


async def test_a_server_silent_at_the_handshake_times_out_at_the_connect_timeout() -> None:
    # A socket that listens but never accepts: the kernel completes the TCP handshake, the AUTH
    # is written and nobody ever reads it.
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        port = listener.getsockname()[1]
        url = f"redis://u:hunter2@127.0.0.1:{port}/0?socket_connect_timeout=0.3"
        store = RedisStore.from_url(url)
        try:
            started = time.monotonic()
            with pytest.raises(StoreError) as info:
                await store.reserve("d1", "r1", 1, LONG)
            assert time.monotonic() - started < 1.5
            assert isinstance(info.value.__cause__, RedisTimeoutError)
            assert "hunter2" not in str(info.value) and "hunter2" not in repr(store._lean)
        finally:
            await store.close()


async def test_auth_and_select_come_from_the_url() -> None:
    with PrivateRedis() as server:
        async with _admin(server.url) as admin:
            await admin.acl_setuser("router", enabled=True, passwords=["+s3cret"], keys="*")
            await admin.execute_command("ACL", "SETUSER", "router", "+@all")
        port = server.port
        store = RedisStore.from_url(f"redis://router:s3cret@127.0.0.1:{port}/3", "t:")
        try:
            await store.set_capacity("d1", 10)
            assert (await store.reserve("d1", "r1", 4, LONG)).held
            async with _admin(f"redis://127.0.0.1:{port}/3") as db3:
                assert await db3.hget("t:{d:d1}:res", "r1") == b"4"
        finally:
            await store.close()
        wrong = RedisStore.from_url(f"redis://router:wr0ng@127.0.0.1:{port}/3", "t:")
        try:
            with pytest.raises(StoreError) as info:
                await wrong.reserve("d1", "r2", 1, LONG)
            assert "wr0ng" not in str(info.value) and "WRONGPASS" in str(info.value)
        finally:
            await wrong.close()


@contextlib.contextmanager
def _redis_on_a_unix_socket() -> Iterator[str]:
    """A private redis-server listening on a unix socket only; its path."""
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed")
    with tempfile.TemporaryDirectory(prefix="dr-lean-") as tmp:
        path = os.path.join(tmp, "redis.sock")
        args = ["--port", "0", "--unixsocket", path, "--save", "", "--dir", tmp]
        proc = subprocess.Popen(
            ["redis-server", *args],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=die_with_parent,
        )
        try:
            deadline = time.monotonic() + 10.0
            while not os.path.exists(path) and time.monotonic() < deadline:
                time.sleep(0.02)
            yield path
        finally:
            proc.kill()
            proc.wait(timeout=10)


async def test_a_unix_socket_url_runs_on_the_lean_connection() -> None:
    with _redis_on_a_unix_socket() as path:
        store = RedisStore.from_url(f"unix://{path}?db=2", "t:")
        try:
            assert store._lean is not None
            await store.set_capacity("d1", 10)
            assert (await store.reserve("d1", "r1", 4, LONG)).held
            assert (await store.finish(("d1", "r1"))).released_blocks == 4
        finally:
            await store.close()


# -- which stores use it -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "lean"),
    [
        ("redis://127.0.0.1:6379/0", "LeanRedis(127.0.0.1:6379, db=0, idle)"),
        ("redis://:pw@h:7000/2?socket_timeout=1", "LeanRedis(h:7000, db=2, idle)"),
        ("unix:///run/redis.sock?db=1", "LeanRedis(unix:/run/redis.sock, db=1, idle)"),
        ("rediss://h:6380/0", None),  # TLS: redis-py throughout
        ("redis://h/0?protocol=3", None),  # an option it does not implement
        ("redis+cluster://127.0.0.1:7000", None),
    ],
)
async def test_the_lean_connection_is_used_where_it_implements_the_url(
    url: str, lean: str | None
) -> None:
    store = RedisStore.from_url(url)
    try:
        assert (None if store._lean is None else repr(store._lean)) == lean
    finally:
        await store.close()


async def test_a_store_on_an_injected_client_keeps_redis_py(redis_prefix: str) -> None:
    async with _admin() as client:
        store = RedisStore(client, Keys(redis_prefix))
        assert store._lean is None
        await store.set_capacity("d1", 4)
        reserved = await store.reserve("d1", "r", 2, LONG, intent=StrandIntent("p1", "q", 9, 5))
        assert reserved.held and reserved.stranded


# -- the conformance suite on the lean path ---------------------------------------------------


@pytest.fixture
async def store(redis_prefix: str) -> AsyncIterator[StateStore]:
    lean_store = RedisStore.from_url(REDIS_URL, redis_prefix)
    assert lean_store._lean is not None
    try:
        yield lean_store
    finally:
        await lean_store.close()


@pytest.fixture
async def clocked(
    redis_prefix: str,
) -> AsyncIterator[tuple[StateStore, conformance.SteppedClock]]:
    clock = conformance.SteppedClock()
    lean_store = RedisStore.from_url(REDIS_URL, redis_prefix, clock=clock)
    try:
        yield lean_store, clock
    finally:
        await lean_store.close()


def _store_tests() -> dict[str, Any]:
    """The conformance tests that take only a `store` or a `clocked` store, under names of
    this module, so that this module's fixtures (a lean store) serve them."""
    found = {}
    for name, fn in vars(conformance).items():
        if name.startswith("test_") and inspect.iscoroutinefunction(fn):
            if set(inspect.signature(fn).parameters) in ({"store"}, {"clocked"}):
                found[f"test_lean_conformance_{name.removeprefix('test_')}"] = fn
    return found


globals().update(_store_tests())
