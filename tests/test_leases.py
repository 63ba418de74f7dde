"""The lease keeper against a real Redis: renewal, and a lease lost under a live request."""

from __future__ import annotations

from router.leases import LeaseKeeper
from state import open_store
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
