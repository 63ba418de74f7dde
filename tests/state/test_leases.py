"""The lease keeper against a real Redis: renewal, and a lease lost under a live request."""

from __future__ import annotations

import contextlib
from typing import Any

from router.leases import LeaseKeeper
from state import MemoryStore, open_store
from state.base import StoreError, StrandIntent
from tests.conftest import REDIS_URL


async def test_a_lease_lost_under_a_live_request_is_put_back(redis_prefix: str) -> None:
    store = await open_store(REDIS_URL, redis_prefix)
    try:
        await store.set_capacity("d0", 100)
        assert await store.reserve("d0", "r1", 60, 30.0)
        keeper = LeaseKeeper(store, 30.0)
        keeper.hold("d0", "r1", 60)
        assert await keeper.renew_all() == 0

        # The store lost it (as when Redis was unreachable for a whole lease) and another
        # request took the room meanwhile: the live sequence still occupies 60 blocks.
        assert await store.release("d0", "r1") == 60
        assert await store.reserve("d0", "r2", 80, 30.0)
        assert await keeper.renew_all() == 1
        usage = (await store.decode_usage(["d0"]))["d0"]
        assert usage.reserved_blocks == 140  # over capacity, but true
        assert await keeper.renew_all() == 0  # back under renewal, no second warning

        # Grown reservations are put back at their grown size.
        await store.release("d0", "r2")
        assert await store.resize("d0", "r1", 70)
        keeper.resized("r1", 70)
        await store.release("d0", "r1")
        assert await keeper.renew_all() == 1
        assert (await store.decode_usage(["d0"]))["d0"].reserved_blocks == 70

        keeper.drop("r1")
        assert await store.release("d0", "r1") == 70
        assert await keeper.renew_all() == 0
    finally:
        await store.close()


async def test_an_intent_not_written_is_owed_then_marked_and_cleared(redis_prefix: str) -> None:
    """A cluster's ledger node failing beside a held reservation (`Reserved.stranded` False):
    the keeper writes the entry later, still pending; marking it ready and clearing it work as
    for one the reservation wrote, and a mark after the clear brings nothing back."""
    store = await open_store(REDIS_URL, redis_prefix)
    try:
        keeper = LeaseKeeper(store, 30.0, stranded_lease_s=30.0)
        keeper.stranded(StrandIntent("p0", "q/r1", 640, 120.0), written=False)
        assert keeper.owed == 1
        assert await store.stranded_bytes(["p0"]) == {"p0": 0}
        assert await keeper.settle_owed() == 0
        assert await store.stranded_bytes(["p0"]) == {"p0": 640}
        # Written pending: the reaper (KV lease 30 s) leaves it while its prefill may run.
        assert await store.reap_stranded("p0", 30.0) == []
        await keeper.kv_ready("p0", "q/r1", age_s=40.0)  # answered 40 s ago: past its lease
        (reaped,) = await store.reap_stranded("p0", 30.0)
        assert (reaped.request_id, reaped.nbytes) == ("q/r1", 640)
        await keeper.unstrand("p0", "q/r1")  # its attempt ends: gone already, nothing owed
        keeper.stranded(StrandIntent("p0", "q/r2", 64, 120.0), written=True)
        await store.strand("p0", "q/r2", 64, 120.0)  # as the reservation wrote it
        await keeper.unstrand("p0", "q/r2")
        await keeper.kv_ready("p0", "q/r2", age_s=0.0)  # late: nothing to mark
        assert await store.stranded_bytes(["p0"]) == {"p0": 0}
        assert keeper.strands == {} and keeper.owed == 0
    finally:
        await store.close()


async def test_a_store_that_lost_its_data_gets_pending_and_ready_entries_back_as_they_were(
    redis_prefix: str,
) -> None:
    store = await open_store(REDIS_URL, redis_prefix)
    try:
        keeper = LeaseKeeper(store, 30.0, stranded_lease_s=30.0)
        keeper.stranded(StrandIntent("p0", "pending", 10, 120.0), written=True)
        keeper.stranded(StrandIntent("p0", "ready", 20, 120.0), written=True)
        await keeper.kv_ready("p0", "ready", age_s=45.0)  # not in the store: only remembered
        assert await store.stranded_bytes(["p0"]) == {"p0": 0}
        await keeper.reassert()
        assert await store.stranded_bytes(["p0"]) == {"p0": 30}
        reaped = await store.reap_stranded("p0", 30.0)
        assert [e.request_id for e in reaped] == ["ready"]  # 45 s old; the other still pending
        assert await store.stranded_bytes(["p0"]) == {"p0": 10}
        await keeper.unstrand("p0", "pending")
        assert await store.stranded_bytes(["p0"]) == {"p0": 0}
    finally:
        await store.close()


async def test_an_owed_unstrand_of_a_pending_entry_is_kept_until_the_reaper_would_take_it() -> None:
    """A reservation whose answer was lost may have written its pending entry: the reaper takes
    that only a KV lease after its ready-by time, so the owed unstrand is kept that long (not a
    KV lease from now), and lands once the store answers."""
    now = [1000.0]
    store = MemoryStore()
    keeper = LeaseKeeper(store, 30.0, stranded_lease_s=30.0, clock=lambda: now[0])
    await store.strand("p0", "q/r1", 64, 120.0)  # the intent landed; its answer did not
    keeper.owe_unstrand("p0", "q/r1", 120.0)

    async def down(*args: Any, **kwargs: Any) -> Any:
        raise StoreError("down")

    store.finish = down  # type: ignore[method-assign]
    now[0] += 100.0  # past a KV lease from now, inside the pending entry's horizon
    assert await keeper.settle_owed() == 1
    del store.finish
    assert await keeper.settle_owed() == 0
    assert await store.stranded_bytes(["p0"]) == {"p0": 0}
    # Past the horizon (ready-by + the KV lease) an owed unstrand is dropped: reaped by then.
    keeper.owe_unstrand("p0", "q/r2", 120.0)
    now[0] += 151.0
    store.finish = down  # type: ignore[method-assign]
    assert await keeper.settle_owed() == 0


async def test_a_release_cancelled_mid_call_is_owed_and_lands(redis_prefix: str) -> None:
    """A request's task cancelled while its end-of-request call is on its way (its client
    left, its replica stops): the release is owed and retried, not left to its lease (found
    by the state machine: 190 blocks held for the rest of a 3 s lease with nothing live)."""
    import asyncio

    store = await open_store(REDIS_URL, redis_prefix)
    try:
        await store.set_capacity("d0", 100)
        assert await store.reserve("d0", "r1", 60, 30.0)
        keeper = LeaseKeeper(store, 30.0)
        keeper.hold("d0", "r1", 60)
        real_finish = store.finish
        started = asyncio.Event()

        async def slow_finish(*args: Any, **kwargs: Any) -> Any:
            started.set()
            await asyncio.sleep(10)  # cancelled here, before the script is sent
            return await real_finish(*args, **kwargs)

        store.finish = slow_finish  # type: ignore[method-assign]
        task = asyncio.ensure_future(keeper.finish(("d0", "r1"), None))
        await started.wait()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        del store.finish
        assert keeper.live == {} and set(keeper.owed_releases) == {"r1"}
        await keeper.settle_owed()
        assert keeper.owed_releases == {}
        assert (await store.decode_usage(["d0"]))["d0"].reserved_blocks == 0
    finally:
        await store.close()


async def test_a_put_back_of_a_released_reservation_is_owed_before_the_slowest_renewal_ends(
    redis_prefix: str,
) -> None:
    """A renewal on its way while its reservation is released puts it back; that is owed (and
    released again) as soon as that worker's renewal answers, not once every worker's has: a
    slow renewal elsewhere held the room meanwhile (found by the state machine's long run)."""
    import asyncio

    store = await open_store(REDIS_URL, redis_prefix)
    try:
        for wid in ("d0", "d1"):
            await store.set_capacity(wid, 100)
        assert await store.reserve("d0", "r0", 40, 30.0)
        assert await store.reserve("d1", "r1", 40, 30.0)
        keeper = LeaseKeeper(store, 30.0)
        keeper.hold("d0", "r0", 40)
        keeper.hold("d1", "r1", 40)
        real_renew = store.renew_many
        d0_renewed = asyncio.Event()
        release_d1 = asyncio.Event()

        async def renew(wid: str, reservations: Any, lease_s: float) -> Any:
            if wid == "d0":
                # r0's request ends while this renewal is on its way: released first.
                assert await store.release("d0", "r0") == 40
                keeper.drop("r0")
                out = await real_renew(wid, reservations, lease_s)
                d0_renewed.set()
                return out
            await release_d1.wait()  # d1's renewal is slow
            return await real_renew(wid, reservations, lease_s)

        store.renew_many = renew  # type: ignore[method-assign]
        tick = asyncio.ensure_future(keeper.renew_all())
        await d0_renewed.wait()
        await asyncio.sleep(0)  # the d0 answer's own processing
        assert "r0" in keeper.owed_releases  # owed while d1's renewal is still on its way
        release_d1.set()
        await tick
        del store.renew_many
        await keeper.settle_owed()
        usage = await store.decode_usage(["d0", "d1"])
        assert (usage["d0"].reserved_blocks, usage["d1"].reserved_blocks) == (0, 40)
        keeper.drop("r1")
        assert await store.release("d1", "r1") == 40
    finally:
        await store.close()
