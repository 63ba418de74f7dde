"""The pools' background loops while the replica is quiet (router/workers/: the prober, the load
poller, the registry sync and the state refresher, on router/loop_timing.py's cadence):
what an idle router does not do, and how the first placement brings the busy cadence back.

A real aiohttp server stands in for the workers and counts what it is asked (`/health`,
`/metrics`); the store is the in-process one (its call counts are the point, not its data).
Cadences are short so that every test ends in about a second; the assertions compare counts
with what the configured cadence would give, never wall-clock targets.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from router.admission import Admission, AdmissionSettings
from router.config import RetrySettings, Settings, settings_from_mapping
from router.loop_timing import LoopTiming
from router.retry_budget import RetryBudget
from router.workers.accounting import LocalAccounting
from router.workers.health_probe import HealthProber
from router.workers.load_poller import LoadPoller
from router.workers.membership import Membership
from router.workers.refresher import StateRefresher
from router.workers.registry import RegistrySync
from router.workers.store_loss import StoreLoss
from state import MemoryStore
from state.base import StateStore

MODEL = "llama-3-8b"
METRICS = "vllm:num_requests_running 0\nvllm:num_requests_waiting 0\n"


@contextlib.asynccontextmanager
async def counting_worker() -> AsyncIterator[tuple[str, Counter[str]]]:
    hits: Counter[str] = Counter()

    async def health(_: web.Request) -> web.Response:
        hits["health"] += 1
        return web.Response(text="ok")

    async def metrics(_: web.Request) -> web.Response:
        hits["metrics"] += 1
        return web.Response(text=METRICS)

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}", hits
    finally:
        await runner.cleanup()


def settings(url: str, **extra: Any) -> Settings:
    return settings_from_mapping(
        {
            "model": MODEL,
            "perf": {"model": MODEL, "gpu": "h100"},
            "workers": [
                {"id": "p0", "url": url, "role": "prefill", "adapter": "vllm"},
                {"id": "d0", "url": url, "role": "decode", "adapter": "vllm", "kv_blocks": 1000},
            ],
            **extra,
        }
    )


@dataclass
class Replica:
    """One replica's pool pieces, wired as router/edge/app.py wires them; `busy` stands in for its
    admission queue (requests in flight or waiting)."""

    store: StateStore
    members: Membership
    timing: LoopTiming
    accounting: LocalAccounting
    loss: StoreLoss
    prober: HealthProber
    registry: RegistrySync
    refresher: StateRefresher
    poller: LoadPoller


def replica(s: Settings, store: StateStore, busy: Callable[[], bool] = lambda: False) -> Replica:
    members = Membership(s)
    timing = LoopTiming(members.carrying_work, busy)
    accounting = LocalAccounting(members, timing)
    loss = StoreLoss(s, store, members)
    prober = HealthProber(members, timing, s)
    return Replica(
        store=store,
        members=members,
        timing=timing,
        accounting=accounting,
        loss=loss,
        prober=prober,
        registry=RegistrySync(s, store, members, loss, prober, timing),
        refresher=StateRefresher(s, store, members, accounting, loss, timing),
        poller=LoadPoller(s, members, timing),
    )


class CountingStore(MemoryStore):
    """The in-process store, counting the calls the loops make."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: Counter[str] = Counter()

    async def registry_view(self, marker_ttl_s: float) -> Any:
        self.calls["registry_view"] += 1
        return await super().registry_view(marker_ttl_s)

    async def usage_view(self, decode_ids: Any, prefill_ids: Any) -> Any:
        self.calls["usage_view"] += 1
        return await super().usage_view(decode_ids, prefill_ids)

    async def decode_usage(self, worker_ids: Any) -> Any:
        self.calls["decode_usage"] += 1
        return await super().decode_usage(worker_ids)

    async def stranded_bytes(self, prefill_ids: Any) -> Any:
        self.calls["stranded_bytes"] += 1
        return await super().stranded_bytes(prefill_ids)

    async def registered_workers(self) -> dict[str, str]:
        self.calls["registered_workers"] += 1
        return await super().registered_workers()

    async def drained_workers(self) -> set[str]:
        self.calls["drained_workers"] += 1
        return await super().drained_workers()

    async def check_marker(self, ttl_s: float) -> bool:
        self.calls["check_marker"] += 1  # also what MemoryStore.registry_view itself calls
        return await super().check_marker(ttl_s)


@contextlib.asynccontextmanager
async def loop_running(coro: Any) -> AsyncIterator[None]:
    task = asyncio.create_task(coro)
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def test_health_probes_back_off_while_quiet_and_come_back_at_the_first_placement() -> None:
    async with counting_worker() as (url, hits), aiohttp.ClientSession() as session:
        busy = [False]
        s = settings(url, loops={"health_interval_s": 0.05, "health_idle_interval_s": 0.4})
        r = replica(s, MemoryStore(), lambda: busy[0])
        async with loop_running(r.prober.run(session)):
            await asyncio.sleep(1.0)
            quiet = hits["health"]
            # Two workers, one probe each per round: at the busy cadence 1 s is ~40 probes;
            # doubling 0.1, 0.2, 0.4, 0.4 ... it is a handful of rounds.
            assert 2 <= quiet <= 2 * 6, quiet
            busy[0] = True
            r.accounting.note_pending("d0", 4)  # a placement: the prober wakes now, not in 0.4 s
            await asyncio.sleep(0.03)
            assert hits["health"] >= quiet + 2
            await asyncio.sleep(0.5)
            assert hits["health"] >= quiet + 2 * 5  # busy: every 0.05 s again (~10 rounds)


async def test_no_back_off_while_a_worker_fails_its_probes() -> None:
    async with counting_worker() as (url, hits), aiohttp.ClientSession() as session:
        s = settings(url, loops={"health_interval_s": 0.05, "health_idle_interval_s": 0.4})
        r = replica(s, MemoryStore())
        # d0 at a port nothing listens on: its probes fail, so the cadence stays the busy one.
        d0 = r.members.workers["d0"]
        d0.spec = replace(d0.spec, url="http://127.0.0.1:9")
        async with loop_running(r.prober.run(session)):
            await asyncio.sleep(0.6)
        assert hits["health"] >= 8  # p0's probes, every 0.05 s: ~12 in 0.6 s


async def test_a_worker_that_answered_a_request_lately_is_not_probed() -> None:
    """A real request that worked within the probe interval stands for the probe; once they stop
    working (or stop coming), the probes come back within one interval."""
    async with counting_worker() as (p_url, p_hits), counting_worker() as (d_url, d_hits):
        async with aiohttp.ClientSession() as session:
            s = settings(p_url, loops={"health_interval_s": 0.05})
            r = replica(s, MemoryStore(), lambda: True)
            d0 = r.members.workers["d0"]
            d0.spec = replace(d0.spec, url=d_url)
            # d0's breaker keeps its own time: its answer stays recent however slowly this
            # loaded machine runs the probe rounds, until the test moves the time on.
            now = [1000.0]
            d0.breaker.clock = lambda: now[0]
            d0.breaker.on_success()  # a stream it finished, just now
            async with loop_running(r.prober.run(session)):
                await asyncio.sleep(0.5)  # ~10 probe rounds
                serving = d_hits["health"]
                now[0] += 0.1  # two probe intervals since its last answer: probed again
                await asyncio.sleep(0.5)
            # p0 carried no request: probed every 0.05 s throughout (~20 in 1 s).
            assert p_hits["health"] >= 5, p_hits
            assert serving == 0, serving
            assert d_hits["health"] >= 3, d_hits
            # A request that failed after it, or a failed probe, ends the pass at once.
            d0.breaker.on_success()
            assert r.prober._answered_lately(d0)
            d0.breaker.on_failure()
            assert not r.prober._answered_lately(d0)
            d0.breaker.on_success()
            d0.consecutive_failures = 1
            assert not r.prober._answered_lately(d0)


async def test_load_polls_only_while_busy() -> None:
    async with counting_worker() as (url, hits), aiohttp.ClientSession() as session:
        busy = [False]
        r = replica(settings(url, loops={"load_poll_s": 0.05}), MemoryStore(), lambda: busy[0])
        async with loop_running(r.poller.run(session)):
            await asyncio.sleep(0.5)
            assert hits["metrics"] == 2  # the start-up round only (two workers)
            busy[0] = True
            r.accounting.note_pending("d0", 4)
            await asyncio.sleep(0.03)
            assert hits["metrics"] >= 4  # the first placement polls at once (quiet: never)
            await asyncio.sleep(0.3)
            assert hits["metrics"] >= 4 + 2 * 4
            busy[0] = False
            r.accounting.note_pending("d0", -4)  # the placement's blocks are reserved or given back
            await asyncio.sleep(0.1)
            settled = hits["metrics"]
            await asyncio.sleep(0.3)
            assert hits["metrics"] == settled


async def test_registry_sync_is_one_store_call() -> None:
    store = CountingStore()
    r = replica(settings("http://127.0.0.1:9"), store)
    for _ in range(3):
        await r.registry.sync()
    assert store.calls["registry_view"] == 3
    assert store.calls["registered_workers"] == store.calls["drained_workers"] == 0


async def test_a_state_refresh_is_one_store_call() -> None:
    """Reservations and stranded KV read together: the refresher runs 10 times a second while
    busy, so each refresh is one round trip, not one per kind of state."""
    store = CountingStore()
    r = replica(settings("http://127.0.0.1:9"), store)
    await store.set_capacity("d0", 1000)
    assert (await store.reserve("d0", "r1", 10, 30.0)).held
    await store.strand("p0", "q1", 2048)
    for _ in range(3):
        await r.refresher.refresh(check_marker=False)
    assert store.calls["usage_view"] == 3
    assert store.calls["decode_usage"] == store.calls["stranded_bytes"] == 0
    assert r.members.workers["d0"].reserved_blocks == 10
    assert r.members.workers["p0"].stranded_bytes == 2048


async def test_a_store_that_lost_its_data_is_put_back_and_read_again() -> None:
    """The registry view finds the marker gone (after the first use): the dynamic workers are
    registered again, then the registry is read again, so none of them looks removed."""
    store = CountingStore()
    r = replica(settings("http://127.0.0.1:9"), store)
    await r.registry.sync()  # first use: the marker is set
    spec = '{"id": "d-new", "url": "http://127.0.0.1:9", "role": "decode", "kv_blocks": 10}'
    await store.register_worker("d-new", spec)
    await r.registry.sync()
    assert "d-new" in r.members.workers
    store._registry.clear()  # the store lost its data: registrations and marker
    store._marker_until = None
    await r.registry.sync()
    assert "d-new" in r.members.workers  # put back, and still in the pools
    assert "d-new" in await store.registered_workers()


async def test_the_quiet_refresher_leaves_the_marker_to_the_registry_sync() -> None:
    store = CountingStore()
    r = replica(
        settings("http://127.0.0.1:9", loops={"state_refresh_s": 0.02}), store, busy=lambda: False
    )
    async with loop_running(r.refresher.run()):
        await asyncio.sleep(0.5)
    # Quiet from the start: the first refresh checks the marker, the backed-off ones do not
    # (at the busy cadence 0.5 s would be ~25 checks).
    assert store.calls["check_marker"] == 1


@pytest.mark.parametrize("period", [0.05, 0.2])
async def test_beats_fall_on_multiples_of_the_period(period: float) -> None:
    """Loops that sleep to the beat wake together: at the same phase of the period."""
    timing = LoopTiming()
    loop = asyncio.get_running_loop()
    phases = []
    for _ in range(3):
        await timing.beat(period)
        phases.append((loop.time() - timing.phase) % period)
    # Each wake-up is just after a multiple of the period (timers fire late, never early).
    assert all(p < 0.02 or p > period - 0.002 for p in phases), phases


async def test_the_reaper_waits_while_nothing_is_stranded() -> None:
    r = replica(settings("http://127.0.0.1:9"), MemoryStore())
    waiter = asyncio.create_task(r.accounting.stranded_somewhere())
    await asyncio.sleep(0.05)
    assert not waiter.done()
    r.accounting.note_stranded("p0", 4096)
    await asyncio.wait_for(waiter, 1.0)
    await asyncio.wait_for(r.accounting.stranded_somewhere(), 0.1)  # at once while some is held


async def test_the_retry_tally_waits_while_nothing_is_counted() -> None:
    """router/retry_budget.py: the flushing loop sleeps in `counted()` until a request is
    counted, returns at once while a tally is owed, and sleeps again once it is flushed."""
    store = MemoryStore()
    budget = RetryBudget(store, RetrySettings())
    waiter = asyncio.create_task(budget.counted())
    await asyncio.sleep(0.05)
    assert not waiter.done()
    budget.note_request()
    await asyncio.wait_for(waiter, 1.0)
    await asyncio.wait_for(budget.counted(), 0.1)  # still untallied: at once
    await budget.flush()
    again = asyncio.create_task(budget.counted())
    await asyncio.sleep(0.05)
    assert not again.done()  # flushed: nothing owed, asleep again
    again.cancel()


def _refresher_alone(
    s: Settings,
    store: StateStore,
    members: Membership,
    timing: LoopTiming,
    queue_waits: Callable[[], bool],
) -> StateRefresher:
    """A state refresher of a replica that reserves nothing: alone after its first read."""
    return StateRefresher(
        s,
        store,
        members,
        LocalAccounting(members, timing),
        StoreLoss(s, store, members),
        timing,
        own_reservations=lambda: {},
        queue_waits=queue_waits,
    )


async def test_a_busy_replica_alone_sits_out_without_waking_and_a_room_wait_ends_it() -> None:
    """Busy and alone in the store, the refresher backs off to one read a second, and between
    reads it does not wake on every beat to look (at one stream those looks were ~20 wake-ups
    a second); a request that starts waiting for room ends the sit-out at once."""
    store = CountingStore()
    s = settings("http://127.0.0.1:9", loops={"state_refresh_s": 0.05})
    members = Membership(s)
    looks = [0]
    waiting = [False]

    def busy() -> bool:
        looks[0] += 1
        return True

    refresher = _refresher_alone(s, store, members, LoopTiming(busy), lambda: waiting[0])
    async with loop_running(refresher.run()):
        await asyncio.sleep(1.2)
        reads = store.calls["usage_view"]
        # Sit-outs of 0.1, 0.2, 0.4 and 0.5 s: a handful of reads and looks. Looking on every
        # 0.05 s beat would be ~24 looks; a loaded machine only makes fewer.
        assert 2 <= reads <= 6, reads
        assert looks[0] <= 14, looks[0]
        waiting[0] = True
        refresher.room_wait()
        await asyncio.sleep(0.02)
        assert store.calls["usage_view"] >= reads + 1  # read at once, not after the sit-out
        await asyncio.sleep(0.3)
        assert store.calls["usage_view"] >= reads + 4  # and on the busy cadence while it waits


class _TimedUsageStore(CountingStore):
    """Also notes on the loop's clock when each usage read came."""

    def __init__(self) -> None:
        super().__init__()
        self.read_at: list[float] = []

    async def usage_view(self, decode_ids: Any, prefill_ids: Any) -> Any:
        self.read_at.append(asyncio.get_running_loop().time())
        return await super().usage_view(decode_ids, prefill_ids)


async def test_a_busy_replica_alone_backed_off_to_a_second_reads_on_the_seconds_beat() -> None:
    """Backed off to one read a second, the busy, alone refresher reads on the second's beat,
    where the registry sync, the load polls and the lease keeper wake: its read goes out in
    their loop turn instead of waking the replica once more a second (issue 36). Before, it
    ended each sit-out on a `state_refresh_s` beat, wherever in the second that fell. The
    first read on the beat comes within half a second of when it was due, then a second
    apart."""
    store = _TimedUsageStore()
    s = settings("http://127.0.0.1:9", loops={"state_refresh_s": 0.1})
    members = Membership(s)
    timing = LoopTiming(lambda: True, phase=0.5)
    refresher = _refresher_alone(s, store, members, timing, lambda: False)
    async with loop_running(refresher.run()):
        await asyncio.sleep(5.2)  # sit-outs of 0.2, 0.4, 0.8, then a second each
    at = store.read_at
    gaps = [b - a for a, b in zip(at, at[1:], strict=False)]
    on_beat = [t for t, gap in zip(at[1:], gaps, strict=False) if gap > 0.9]
    assert len(on_beat) >= 2, at
    # Each within the loop's lateness of the beat (phase 0.5 of every second), never early;
    # a read on a 0.1 s beat of its own would be off by up to 0.45 s.
    assert all((t - 0.5) % 1.0 < 0.15 for t in on_beat), [(t - 0.5) % 1.0 for t in on_beat]
    assert all(gap < 1.6 for gap in gaps), gaps


async def test_the_admission_queue_tells_when_a_request_starts_waiting_for_room() -> None:
    """What ends the refresher's sit-out (`on_room_wait`): once per request that starts waiting
    for decode room, not for a concurrency slot."""
    admission = Admission(AdmissionSettings())
    told: list[int] = []
    admission.on_room_wait = lambda: told.append(1)
    deadline = asyncio.get_running_loop().time() + 60
    slot = asyncio.create_task(admission.wait(0, 1, deadline, for_room=False))
    await asyncio.sleep(0)
    assert told == []
    room = asyncio.create_task(admission.wait(0, 2, deadline))
    await asyncio.sleep(0)
    assert told == [1]
    for task in (slot, room):
        task.cancel()
    await asyncio.gather(slot, room, return_exceptions=True)
    assert admission.waiting == 0
