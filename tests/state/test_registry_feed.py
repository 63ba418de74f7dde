"""The registry's change feed (state/registry_feed.py): every store call that changes what the
registry sync reads reaches it, on `MemoryStore`, the session's real Redis and the private Redis
Cluster; calls that change nothing do not; a Redis connection that breaks ends a wait.

A quiet replica reads the registry only when its feed moves (router/workers/registry.py), so a
mutation that skipped the feed would go unseen by quiet replicas until the wait's bound: the
list below must name every public method of the registry half of the store (a new one fails
`test_every_registry_method_is_classified` until it is put on one side).
"""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import redis.asyncio as aioredis

from state import DrainMark, MemoryStore, RedisStore, StateStore, WorkerRole
from state.base import TenantKey
from state.redis_registry import RedisRegistry
from state.registry_feed import RedisRegistryFeed
from tests.conftest import REDIS_URL
from tests.state.test_state_registry_read import redis_cluster, store

__all__ = ["redis_cluster", "store"]  # fixtures, imported so the parametrized store finds them

TTL = 60.0
DIGEST = "a" * 64
OTHER_DIGEST = "b" * 64
REGISTRATION = '{"id": "d-new", "role": "decode"}'

Call = Callable[[StateStore], Awaitable[object]]

# Each registry change, after `_setup` (a registered worker, drained, with a role; a key).
MUTATIONS: dict[str, Call] = {
    "register_worker": lambda s: s.register_worker("d-other", REGISTRATION),
    "register_worker (changed)": lambda s: s.register_worker("d-new", REGISTRATION + " "),
    "unregister_worker": lambda s: s.unregister_worker("d-new"),
    "set_drained (undrain)": lambda s: s.set_drained("d-new", False),
    "set_drained (drain)": lambda s: s.set_drained("d-other", True),
    "set_role": lambda s: s.set_role("b0", "decode", 1),
    "forget_role": lambda s: s.forget_role("b0"),
    "restore_registry": lambda s: s.restore_registry({"d-x": _mark()}, {"b1": _role("prefill", 3)}),
    "put_tenant_key": lambda s: s.put_tenant_key("k2", "t", OTHER_DIGEST),
    "revoke_tenant_key": lambda s: s.revoke_tenant_key("k1"),
    "restore_tenant_keys": lambda s: s.restore_tenant_keys(
        {"k3": TenantKey("t", "c" * 64, "admin")}, [], 0
    ),
}

# Calls that change nothing the registry sync reads: no entry (no replica woken for nothing).
NO_CHANGE: dict[str, Call] = {
    "register_worker (same)": lambda s: s.register_worker("d-new", REGISTRATION),
    "set_drained (already)": lambda s: s.set_drained("d-new", True),
    "forget_role (none)": lambda s: s.forget_role("b-none"),
    "restore_registry (older)": lambda s: s.restore_registry({}, {"b0": _role("prefill", 1)}),
    "registry_view": lambda s: s.registry_view(TTL),
    "registry_and_usage_view": lambda s: s.registry_and_usage_view(TTL, ["d0"], ["p0"]),
    "check_marker": lambda s: s.check_marker(TTL),
    "tenant_keys": lambda s: s.tenant_keys(),
    "publish_demand": lambda s: s.publish_demand("r1", "{}", 5.0),
    "hold_lease": lambda s: s.hold_lease("roles", "me", 5.0),
}

# RedisRegistry's public methods that write nothing the registry sync reads, or only read.
NOT_REGISTRY_CHANGES = {
    "registered_workers",
    "drained_workers",
    "drain_marks",
    "worker_roles",
    "hold_lease",
    "release_lease",
    "publish_demand",
    "replica_demands",
    "tenant_keys",
    "advertise_renewal",
    "check_marker",  # feeds when it re-creates the marker: `test_a_recreated_marker_...`
    "registry_view",
    "registry_and_usage_view",
    "registry_feed",
}


def _mark() -> DrainMark:
    return DrainMark(True, 1.0)


def _role(role: str, version: int) -> WorkerRole:
    return WorkerRole(role, version, 1.0)


async def _setup(store: StateStore) -> None:
    await store.check_marker(TTL)
    await store.register_worker("d-new", REGISTRATION)
    await store.set_drained("d-new", True)
    assert await store.set_role("b0", "prefill", 0) is not None
    assert await store.put_tenant_key("k1", "t", DIGEST) > 0


def test_every_registry_method_is_classified() -> None:
    public = {
        name
        for name in vars(RedisRegistry)
        if not name.startswith("_") and callable(getattr(RedisRegistry, name))
    }
    fed = {name.split(" ")[0] for name in MUTATIONS}
    assert public == fed | NOT_REGISTRY_CHANGES, public ^ (fed | NOT_REGISTRY_CHANGES)


@pytest.mark.parametrize("what", list(MUTATIONS))
async def test_every_registry_change_reaches_the_feed(store: StateStore, what: str) -> None:
    await _setup(store)
    feed = store.registry_feed(30.0)
    await feed.start()
    try:
        await MUTATIONS[what](store)
        assert await feed.wait(10.0), f"{what} did not reach the feed"
        # Seen once: the next wait has nothing new.
        assert not await feed.wait(0.2)
    finally:
        await feed.close()


@pytest.mark.parametrize("what", list(NO_CHANGE))
async def test_a_call_that_changes_nothing_wakes_nobody(store: StateStore, what: str) -> None:
    await _setup(store)
    feed = store.registry_feed(30.0)
    await feed.start()
    try:
        await NO_CHANGE[what](store)
        assert not await feed.wait(0.3), f"{what} woke the feed"
    finally:
        await feed.close()


async def test_a_wait_ends_at_a_change_made_while_it_blocks(store: StateStore) -> None:
    await _setup(store)
    feed = store.registry_feed(30.0)
    await feed.start()
    try:
        waiting = asyncio.create_task(feed.wait(20.0))
        await asyncio.sleep(0.2)
        assert not waiting.done()
        await store.set_drained("d-new", False)
        assert await asyncio.wait_for(waiting, 10.0)
    finally:
        await feed.close()


async def test_a_recreated_marker_reaches_the_feed(store: StateStore) -> None:
    """A replica that finds the marker missing re-creates it: every quiet replica must read
    the new token (the store lost its data). The first use feeds too (nobody waits then)."""
    feed = store.registry_feed(30.0)
    await feed.start()
    try:
        assert await store.check_marker(TTL)
        assert await feed.wait(10.0)
        assert not await store.check_marker(TTL)
        assert not await feed.wait(0.2)
        if isinstance(store, RedisStore):
            await store._client.delete(store._keys.marker)  # lost, as after a FLUSHALL
        else:
            assert isinstance(store, MemoryStore)
            store._marker_until = 0.0  # lapsed
        assert await store.check_marker(TTL)
        assert await feed.wait(10.0)
    finally:
        await feed.close()


async def test_a_feed_closed_while_its_call_reconnects_leaves_no_connection_open(
    redis_prefix: str,
) -> None:
    """A replica shut down while its feed was connecting (the state machine's "unclosed
    transport"): the close disconnects the feed's connection under the call, redis-py connects
    it again for the call's next command, and that socket must not outlive the feed. The
    call here runs one command, waits until the feed is closed, then sends the next (redis-py
    connects again), as its handshake does."""
    name = f"feedtest-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    closed = asyncio.Event()

    async def connect() -> aioredis.Redis:
        client = aioredis.Redis.from_url(REDIS_URL, client_name=name)
        real = client.xread

        async def xread(*args: Any, **kwargs: Any) -> Any:
            await client.ping()  # connected, as a handshake's first command
            await closed.wait()  # the feed is closed meanwhile: the pool disconnected
            return await real(*args, **kwargs)  # the next command connects again

        client.xread = xread  # type: ignore[method-assign]
        return client

    async def ours_open() -> list[str]:
        listed = await probe.client_list()
        return [c["addr"] for c in listed if c.get("name") == name]

    probe = aioredis.Redis.from_url(REDIS_URL)
    feed = RedisRegistryFeed(connect, redis_prefix + "feed")
    try:
        await feed.start()
        waiting = asyncio.ensure_future(feed.wait(0.05))
        for _ in range(200):
            if await ours_open():
                break
            await asyncio.sleep(0.01)
        await feed.close()
        closed.set()
        await waiting
        for _ in range(100):  # Redis lists a closed client until it has read the close
            if not await ours_open():
                break
            await asyncio.sleep(0.02)
        assert await ours_open() == []
    finally:
        await feed.close()
        await probe.aclose()
