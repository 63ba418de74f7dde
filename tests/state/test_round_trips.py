"""The store round trips on a request's critical path (issue 12), counted on the wire.

A real Redis (this test's own key prefix) and simulated workers, all in this process: every
Redis round trip is one `send_packed_command` of redis-py (a pipeline is one) or one
`LeanRedis.execute` (the store's hot path, state/lean_redis.py), timestamped and tagged with
the task that sent it; the simulated workers timestamp each generation request's
arrival and answer. For one streaming request (vLLM NIXL pull: prefill, then decode):

- before the prefill is sent: one round trip (the reservation, with the stranded-KV intent);
- between the prefill's answer and the decode request arriving at the decode worker: none
  that the request waits for (the old awaited `strand` was one);
- the request's own task makes two in all (that reservation, and the end's one `finish`).

Then the leak checks of the entry written before the prefill: whatever ends the request
(success, a failed prefill, a failed decode, the client gone mid-prefill or mid-stream), no
reservation and no stranded byte is left.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest
import redis.asyncio as aioredis
from aiohttp import web
from redis.asyncio.connection import AbstractConnection

import disagg_tools.sim.worker
from disagg_tools.sim.worker_state import WORKER
from router.request.holdings import READY_MARK_AFTER_S
from state.keys import Keys
from state.lean_redis import Arg, LeanRedis, encode_commands
from state.redis_scripts import RESERVE_SCRIPT
from tests.conftest import MODEL, REDIS_URL, SimCluster, sim_cluster
from tests.router.request.test_faults import assert_quiet, body_for, call, set_faults

CHAT = "/v1/chat/completions"
# Background loops slowed down so that, within one request, only the request's own traffic and
# its background jobs are on the wire (the retry-budget tally is tagged as background too).
QUIET = {
    "loops": {
        "state_refresh_s": 30.0,
        "registry_refresh_s": 30.0,
        "histogram_refresh_s": 30.0,
        "stranded_reap_s": 30.0,
        "load_poll_s": 0,
    },
}
FAST_RETRY = {"backoff_base_s": 0.005, "backoff_max_s": 0.02}


@dataclass(frozen=True)
class Send:
    at: float
    data: bytes
    task: asyncio.Task[Any] | None
    background: bool  # sent by one of the router's background loops or jobs

    @property
    def scripts(self) -> int:
        return self.data.count(b"EVALSHA")


@dataclass(frozen=True)
class Upstream:
    at: float
    event: str  # "arrive" or "answer"
    worker: str


class Wire:
    """Every Redis round trip under `prefix`, and every generation request a worker got."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix.encode()
        self.sends: list[Send] = []
        self.upstream: list[Upstream] = []
        self.background: Callable[[asyncio.Task[Any] | None], bool] = lambda _t: False

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        real_send = AbstractConnection.send_packed_command
        real_execute = LeanRedis.execute
        wire = self

        def record(data: bytes) -> None:
            if wire.prefix in data:
                task = asyncio.current_task()
                # Told when sent: a finished job leaves the router's set of tasks.
                send = Send(time.monotonic(), data, task, wire.background(task))
                wire.sends.append(send)

        async def send(
            conn: AbstractConnection, command: bytes | str | Iterable[bytes], *a: Any, **k: Any
        ) -> None:
            if isinstance(command, str):
                command = command.encode()
            if not isinstance(command, bytes):
                command = list(command)  # an iterable is read once: keep it for the real send
            record(command if isinstance(command, bytes) else b"".join(command))
            await real_send(conn, command, *a, **k)

        async def execute(lean: LeanRedis, commands: Sequence[Sequence[Arg]]) -> list[Any]:
            # Recorded in the calling task: the write itself happens later, in a loop callback.
            record(encode_commands(commands))
            return await real_execute(lean, commands)

        real_handler = disagg_tools.sim.worker.handle_generation

        async def handler(request: web.Request) -> web.StreamResponse:
            wid = request.app[WORKER].config.worker_id
            wire.upstream.append(Upstream(time.monotonic(), "arrive", wid))
            try:
                return await real_handler(request)
            finally:
                wire.upstream.append(Upstream(time.monotonic(), "answer", wid))

        monkeypatch.setattr(AbstractConnection, "send_packed_command", send)
        monkeypatch.setattr(LeanRedis, "execute", execute)
        # create_worker_app looks the handler up when it builds each worker's app.
        monkeypatch.setattr(disagg_tools.sim.worker, "handle_generation", handler)

    def watch_router(self, c: SimCluster) -> None:
        tasks = c.parts.tasks
        self.background = lambda t: t in tasks._jobs or t in tasks._loops

    def when(self, event: str, worker: str, after: float) -> float:
        return min(
            u.at for u in self.upstream if (u.event, u.worker) == (event, worker) and u.at >= after
        )

    def waited(self, start: float, end: float) -> list[Send]:
        """Round trips sent in [start, end] by a task that is not the router's background."""
        return [s for s in self.sends if start <= s.at <= end and not s.background]


@pytest.fixture
def wire(redis_prefix: str, monkeypatch: pytest.MonkeyPatch) -> Wire:
    w = Wire(redis_prefix)
    w.install(monkeypatch)
    return w


async def _stream(c: SimCluster, body: dict[str, Any]) -> bytes:
    async with aiohttp.ClientSession() as s:
        async with s.post(c.router_url + CHAT, json={**body, "stream": True}) as r:
            assert r.status == 200, await r.text()
            return await r.read()


async def test_one_streaming_request_waits_for_one_round_trip_before_the_prefill_and_none_after(
    redis_prefix: str, wire: Wire
) -> None:
    async with sim_cluster(redis_prefix=redis_prefix, **QUIET) as c:
        wire.watch_router(c)
        body = {"model": MODEL, "messages": [{"role": "user", "content": "count me"}]}
        await _stream(c, {**body, "max_tokens": 4})  # warm: scripts loaded, statistics cached
        await asyncio.sleep(0.1)
        start = time.monotonic()
        raw = await _stream(c, {**body, "max_tokens": 16})
        assert raw.endswith(b"data: [DONE]\n\n")
        await asyncio.sleep(0.1)  # the end's `finish` runs as the handler unwinds
        end = time.monotonic()

        prefill_sent = wire.when("arrive", "p0", start)
        prefill_answered = wire.when("answer", "p0", start)
        decode_arrived = wire.when("arrive", "d0", start)
        assert start < prefill_sent < prefill_answered < decode_arrived < end

        before = wire.waited(start, prefill_sent)
        assert len(before) == 1, before
        (reserve,) = before
        # One script holds the decode room and writes the prefill's stranded-KV intent.
        assert reserve.scripts == 1, reserve
        assert hashlib.sha1(RESERVE_SCRIPT.encode()).hexdigest().encode() in reserve.data
        assert b"{d:d0}" in reserve.data and b"{p:p0}" in reserve.data, reserve

        between = wire.waited(prefill_answered, decode_arrived)
        assert between == [], between

        # The request's round trips, start to end, but for its background jobs: the
        # reservation and the end's one call (release + statistics; it runs in a shielded task
        # of its own, so it is told apart by what it sends, not by its task).
        own = wire.waited(start, end)
        assert len(own) == 2, own
        finish = own[1]
        assert finish.scripts == 1 and b"HINCRBY" in finish.data, finish
        assert b"{d:d0}" in finish.data and b"{p:p0}" not in finish.data, finish
        # The entry went at the decode's first event, in the background; the decode took the
        # KV at once, so no ready mark was sent either.
        ledger = [s for s in wire.sends if start <= s.at <= end and b"{p:p0}" in s.data]
        assert [s.background for s in ledger] == [False, True], ledger
        assert ledger[1].at > decode_arrived
        await assert_quiet(c)


async def _stranded_while(c: SimCluster, cond: Callable[[], Awaitable[bool]]) -> int:
    """The stranded bytes in the store once `cond` holds (bounded wait)."""
    for _ in range(200):
        if await cond():
            return sum((await c.stranded()).values())
        await asyncio.sleep(0.01)
    raise AssertionError("the condition never held")


async def test_the_intent_is_in_the_ledger_while_the_prefill_runs(redis_prefix: str) -> None:
    """Written with the reservation: the prefill worker's KV counts before its prefill answers,
    and a client that leaves mid-prefill leaves nothing behind."""
    bounded = {"prefill_s": 5.0, "idle_s": 5.0}  # a missed disconnect fails, never hangs
    async with sim_cluster(redis_prefix=redis_prefix, timeouts=bounded, **QUIET) as c:
        await set_faults(c, "p0", hang=True, count=1)
        body = body_for(1)
        task = asyncio.create_task(call(c, body, True))

        async def prefill_arrived() -> bool:
            return len(await c.worker_requests("p0")) == 1

        stranded = await _stranded_while(c, prefill_arrived)
        (entry,) = c.parts.leases.strands.values()  # the attempt's, with its reservation
        assert stranded == entry.nbytes > 0
        task.cancel()  # the client goes away while the prefill hangs
        with pytest.raises(asyncio.CancelledError):
            await task
        await assert_quiet(c)
        assert c.parts.leases.strands == {}


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
@pytest.mark.parametrize(
    ("worker", "fault", "status"),
    [
        (None, {}, 200),
        ("p0", {"prefill_fail": True}, 503),
        ("p0", {"error_rate": 1.0, "error_status": 500}, 503),
        ("d0", {"decode_fail_before_first": True}, 503),
        ("d0", {"error_rate": 1.0, "error_status": 500}, 503),
    ],
    ids=["success", "prefill-fails", "prefill-500", "decode-fails", "decode-500"],
)
async def test_nothing_is_left_whatever_ends_the_request(
    redis_prefix: str, worker: str | None, fault: dict[str, Any], status: int, stream: bool
) -> None:
    """Every try fails the same way (retries included): each try's entry, written before its
    prefill, is cleared by its release; the request ends in a 503 with nothing held."""
    retry = {**FAST_RETRY, "max_attempts": 2}
    async with sim_cluster(redis_prefix=redis_prefix, retry=retry, **QUIET) as c:
        if worker is not None:
            await set_faults(c, worker, **fault)
        got, result = await call(c, body_for(2), stream)
        assert got == status, result
        if status != 200:
            assert set(result["error"]) == {"message", "type", "param", "code"}
        await assert_quiet(c)
        assert c.parts.leases.strands == {}
        assert c.parts.leases.owed == 0


async def test_client_gone_mid_stream_leaves_nothing(redis_prefix: str) -> None:
    async with sim_cluster(redis_prefix=redis_prefix, **QUIET) as c:
        async with aiohttp.ClientSession() as s:
            body = {**body_for(3, max_tokens=2000), "stream": True}
            async with s.post(c.router_url + CHAT, json=body) as r:
                assert r.status == 200
                await r.content.readline()  # the first event: the decode took the KV
        await assert_quiet(c)
        assert c.parts.leases.strands == {}


async def test_kv_that_sits_unaccepted_is_marked_ready_in_the_background(
    redis_prefix: str,
) -> None:
    """A decode that has not shown it took the KV `READY_MARK_AFTER_S` after the prefill's
    answer: the entry's time moves from the prefill's ready-by bound to the answer (the KV
    lease counts from there), without the request waiting for it."""
    bounded = {"prefill_s": 5.0, "idle_s": 5.0}  # a missed disconnect fails, never hangs
    async with sim_cluster(redis_prefix=redis_prefix, timeouts=bounded, **QUIET) as c:
        await set_faults(c, "d0", hang=True, count=1)
        client = aioredis.from_url(REDIS_URL)
        keys = Keys(redis_prefix)
        try:
            task = asyncio.create_task(call(c, body_for(4), True))

            async def decode_arrived() -> bool:
                return len(await c.worker_requests("d0")) == 1

            assert await _stranded_while(c, decode_arrived) > 0
            (entry_id,) = c.parts.leases.strands
            since_key = keys.stranded_since("p0")
            pending = await client.zscore(since_key, entry_id)
            (server_now, _) = await client.time()
            assert pending > server_now + 3  # the ready-by bound: the prefill's timeout ahead
            await asyncio.sleep(READY_MARK_AFTER_S + 0.5)
            marked = await client.zscore(since_key, entry_id)
            (server_now, _) = await client.time()
            assert server_now - READY_MARK_AFTER_S - 2 < marked <= server_now + 1
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await assert_quiet(c)
            assert await client.zscore(since_key, entry_id) is None
        finally:
            await client.aclose()


async def test_an_answer_the_decode_prefills_itself_writes_no_intent(
    redis_prefix: str, wire: Wire
) -> None:
    """n > 1 in front of vLLM goes whole to the decode worker (no prefill leg, no KV handoff):
    its reservation carries no stranded-KV entry, so nothing counts on the prefill worker."""
    async with sim_cluster(redis_prefix=redis_prefix, **QUIET) as c:
        wire.watch_router(c)
        start = time.monotonic()
        body = {**body_for(5, max_tokens=6), "n": 3, "stream": True}
        async with aiohttp.ClientSession() as s, s.post(c.router_url + CHAT, json=body) as r:
            assert r.status == 200
            await r.read()
        assert await c.worker_requests("p0") == []
        reserve = wire.waited(start, time.monotonic())[0]
        assert b"{d:d0}" in reserve.data and b"{p:p0}" not in reserve.data, reserve
        # Nothing wrote an entry in the prefill worker's ledger (its sum is still read by the
        # state refresh, in the same pipeline as the decode workers' usage scripts).
        assert not [s for s in wire.sends if s.at >= start and b"{p:p0}:bytes" in s.data]
        await assert_quiet(c)


async def test_a_client_gone_while_its_reservation_is_answered_leaves_nothing(
    redis_prefix: str,
) -> None:
    """The reservation's script ran (room held, entry written) but the client left before its
    answer came back: the request is cancelled inside the store call. What the script may
    have written is owed and cleared within a tick, not left to the lease (30 s) and the
    reaper (the prefill's timeout + the KV lease)."""
    async with sim_cluster(redis_prefix=redis_prefix, **QUIET) as c:
        store = c.parts.store
        real = store.reserve
        ran = asyncio.Event()

        async def answer_in_flight(*args: Any, **kwargs: Any) -> Any:
            reserved = await real(*args, **kwargs)
            ran.set()
            await asyncio.sleep(30.0)  # the answer is still on its way when the client leaves
            return reserved

        store.reserve = answer_in_flight
        task = asyncio.create_task(call(c, body_for(6), True))
        await asyncio.wait_for(ran.wait(), 10.0)
        assert sum((await c.reserved_blocks()).values()) > 0
        assert sum((await c.stranded()).values()) > 0
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await assert_quiet(c)
        assert c.parts.leases.owed == 0
        assert await c.worker_requests("p0") == []  # no prefill without a reservation in hand


async def test_a_retry_on_another_prefill_worker_moves_the_entry_with_it(
    redis_prefix: str, wire: Wire
) -> None:
    """Each try writes its own entry with its own reservation (the id is the request's and the
    reservation's): the failed try's on p0 is cleared by its release, the retry's lands on p1."""
    async with sim_cluster(redis_prefix=redis_prefix, prefill=2, retry=FAST_RETRY, **QUIET) as c:
        wire.watch_router(c)
        await set_faults(c, "p0", prefill_fail=True)  # every time
        retries = c.parts.metrics.retries.labels(side="prefill")
        for i in range(8):  # until placement has tried p0 first once
            start = time.monotonic()
            got, result = await call(c, body_for(10 + i), True)
            assert got == 200, result
            if retries._value.get() > 0:
                break
        else:
            pytest.fail("placement never tried p0")
        sha = hashlib.sha1(RESERVE_SCRIPT.encode()).hexdigest().encode()
        reserves = [s for s in wire.waited(start, time.monotonic()) if sha in s.data]
        ledgers = [b"{p:p0}" in s.data for s in reserves]
        assert ledgers == [True, False], reserves  # its entry on p0, then the retry's on p1
        await assert_quiet(c)
        assert c.parts.leases.strands == {} and c.parts.leases.owed == 0
