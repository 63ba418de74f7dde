"""API keys shared by every replica (issue 25: "revocation takes effect on every replica within
one refresh").

- The store's tenant-key table (`put_tenant_key`, `revoke_tenant_key`, `tenant_keys`,
  `restore_tenant_keys`, the version in `registry_view`), the same on `MemoryStore`, the
  session's real Redis and the private Redis Cluster (tests/redis_cluster.py).
- Two router replicas on one key prefix of the real Redis, in front of simulated workers, called
  with the official `openai` client: a key made on A is accepted on B within one refresh; revoked
  on A, refused on A at once and on B within one refresh; rotated, the old key refused and the
  new one accepted everywhere; a configured key revoked stays refused on a replica started
  afterwards; Redis losing every key gets the table put back; and no key is ever in Redis in
  plain text.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import openai
import pytest
import redis.asyncio as aioredis
from openai import AsyncOpenAI

from router.edge.app import SETTINGS
from router.tenants import KEYRING
from state import StateStore
from state.base import StoreError, TenantKey, TenantKeys
from tests.conftest import MODEL, REDIS_URL, SimCluster, running_router, sim_cluster
from tests.redis_dump import redis_dump
from tests.state.test_state_registry_read import redis_cluster, store
from tests.state.test_store_faults import fail_calls

__all__ = ["redis_cluster", "store"]  # fixtures, imported so the parametrized store finds them

TTL = 60.0
KEY_A = "sk-shared-a-5d1e9c0b7f3a2e6d4c8b"
ADMIN = "admin-token-shared-keys-3f9a"
ADMIN_HEADERS = {"Authorization": f"Bearer {ADMIN}"}
REFRESH_S = 1.0  # registry_refresh_s: the default
SLACK_S = 1.0  # a loaded CI machine's call latency on top of one refresh


def _hex(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


D1, D2, D3 = _hex("one"), _hex("two"), _hex("three")


# -- the store -------------------------------------------------------------------------------


async def test_an_empty_table_is_version_0(store: StateStore) -> None:
    assert await store.tenant_keys() == TenantKeys(0, {}, frozenset())
    assert (await store.registry_view(TTL)).keys_version == 0


async def test_put_rotate_revoke_bump_the_version_seen_with_the_registry(
    store: StateStore,
) -> None:
    assert await store.put_tenant_key("k1", "a", D1) == 1
    assert await store.tenant_keys() == TenantKeys(1, {"k1": TenantKey("a", D1)}, frozenset())
    assert (await store.registry_view(TTL)).keys_version == 1
    registry, _ = await store.registry_and_usage_view(TTL, [], [])
    assert registry.keys_version == 1
    # A rotation: the id takes the new key, what it held is revoked, and `replaces` too.
    assert await store.put_tenant_key("k1", "a", D2, "admin", replaces=D3) == 2
    table = await store.tenant_keys()
    assert table.keys == {"k1": TenantKey("a", D2)} and table.revoked == {D1, D3}
    # A revoked digest never comes back.
    assert await store.put_tenant_key("k9", "a", D1) == 0
    assert (await store.tenant_keys()).version == 2
    # Revoke: the id's key and the given digest (a configured key's) are revoked.
    digest_cfg = _hex("configured")
    assert await store.revoke_tenant_key("k1", digest_cfg) == 3
    table = await store.tenant_keys()
    assert table == TenantKeys(3, {}, frozenset({D1, D2, D3, digest_cfg}))
    assert (await store.registry_view(TTL)).keys_version == 3


async def test_only_digests_are_stored(store: StateStore) -> None:
    for bad in ("sk-dr-plain-key", D1.upper(), D1[:-1], "x" * 64):
        with pytest.raises(ValueError):
            await store.put_tenant_key("k1", "a", bad)
        with pytest.raises(ValueError):
            await store.revoke_tenant_key("k1", bad)
    with pytest.raises(ValueError):
        await store.put_tenant_key("k1", "a|b", D1)
    with pytest.raises(ValueError):
        await store.put_tenant_key("k1", "a", D1, source="elsewhere")
    assert (await store.tenant_keys()).version == 0


async def test_the_put_back_keeps_the_union_revocations_winning(store: StateStore) -> None:
    # A stale replica (k1 -> D1) puts back first, a fresh one (k1 rotated to D2, D1 revoked,
    # k2 made) second: the fresh one's revocation drops the stale key.
    stale = {"k1": TenantKey("a", D1)}
    fresh = {"k1": TenantKey("a", D2), "k2": TenantKey("b", D3)}
    v1 = await store.restore_tenant_keys(stale, [], 4)
    assert v1 == 5
    v2 = await store.restore_tenant_keys(fresh, [D1], 6)
    assert v2 == 7
    assert await store.tenant_keys() == TenantKeys(7, fresh, frozenset({D1}))
    # Putting back what the store already has changes nothing, nor the version.
    assert await store.restore_tenant_keys(stale, [], 9) == 7
    assert await store.restore_tenant_keys(fresh, [D1], 9) == 7


# -- two replicas ----------------------------------------------------------------------------


async def _accepted(url: str, key: str) -> bool:
    """Whether the router at `url` serves a request with `key` (False: a 401)."""
    client = AsyncOpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=30)
    async with client:
        try:
            await client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2
            )
        except openai.AuthenticationError:
            return False
    return True


async def _within(url: str, key: str, accepted: bool, timeout_s: float) -> float:
    """Seconds until `url` answers `key` as `accepted`; fails after `timeout_s`."""
    start = time.monotonic()
    while await _accepted(url, key) != accepted:
        if time.monotonic() - start > timeout_s:
            raise AssertionError(f"{url}: key still {'refused' if accepted else 'accepted'}")
        await asyncio.sleep(0.05)
    return time.monotonic() - start


@contextlib.asynccontextmanager
async def _two_replicas(redis_prefix: str) -> AsyncIterator[tuple[SimCluster, str, Any]]:
    """Replica A (with the simulated workers) and B, on one key prefix: (A, B's URL, A's
    settings)."""
    async with sim_cluster(
        redis_prefix=redis_prefix,
        tenants=[{"name": "a", "keys": [{"id": "a-cfg", "key": KEY_A}]}, {"name": "b"}],
        auth={"admin_token": ADMIN},
        loops={"registry_refresh_s": REFRESH_S},
    ) as c:
        settings = c.app[SETTINGS]
        async with running_router(settings) as (b, _):
            yield c, b, settings


async def _admin(s: aiohttp.ClientSession, method: str, url: str) -> dict[str, Any]:
    async with s.request(method, url, headers=ADMIN_HEADERS) as r:
        assert r.status in (200, 201), await r.text()
        answer: dict[str, Any] = await r.json()
        return answer


async def _redis_contents(prefix: str) -> list[bytes]:
    """Every key and value under `prefix`, as bytes."""
    return await redis_dump(REDIS_URL, prefix)


async def test_keys_made_rotated_revoked_on_one_replica_hold_on_every_replica(
    redis_prefix: str,
) -> None:
    plain_keys = [KEY_A]
    async with _two_replicas(redis_prefix) as (c, b, settings), aiohttp.ClientSession() as s:
        a = c.router_url
        assert await _accepted(a, KEY_A) and await _accepted(b, KEY_A)

        # Made on A: accepted on A at once, on B within one refresh.
        made = await _admin(s, "POST", f"{a}/admin/tenants/b/keys")
        new_b = made["key"]
        plain_keys.append(new_b)
        assert await _accepted(a, new_b)
        await _within(b, new_b, True, REFRESH_S + SLACK_S)

        # Rotated on B (a key made on A): the old key refused everywhere, the new one accepted.
        rotated = await _admin(s, "POST", f"{b}/admin/tenants/b/keys/{made['id']}/rotate")
        plain_keys.append(rotated["key"])
        assert not await _accepted(b, new_b) and await _accepted(b, rotated["key"])
        await _within(a, new_b, False, REFRESH_S + SLACK_S)
        await _within(a, rotated["key"], True, REFRESH_S + SLACK_S)

        # A configured key revoked on A: refused on A at once, on B within one refresh.
        await _admin(s, "DELETE", f"{a}/admin/tenants/a/keys/a-cfg")
        assert not await _accepted(a, KEY_A)
        await _within(b, KEY_A, False, REFRESH_S + SLACK_S)

        # A replica started afterwards, from the same configuration: still refused there.
        async with running_router(settings) as (third, app):
            assert not await _accepted(third, KEY_A)
            assert await _accepted(third, rotated["key"])
            assert app[KEYRING].version is not None

        # Nothing under the prefix holds a key in plain text: digests only.
        contents = await _redis_contents(redis_prefix)
        assert contents
        for plain in plain_keys:
            assert not any(plain.encode() in blob for blob in contents), "a key in plain text"
        assert any(_hex(KEY_A).encode() in blob for blob in contents)  # its digest: revoked


async def test_a_store_down_refuses_the_change_and_changes_nothing(redis_prefix: str) -> None:
    async with _two_replicas(redis_prefix) as (c, _, _), aiohttp.ClientSession() as s:
        a = c.router_url
        fail_calls(c.parts.store, "revoke_tenant_key")
        fail_calls(c.parts.store, "put_tenant_key")
        async with s.delete(f"{a}/admin/tenants/a/keys/a-cfg", headers=ADMIN_HEADERS) as r:
            assert r.status == 503 and "Retry-After" in r.headers
        async with s.post(f"{a}/admin/tenants/b/keys", headers=ADMIN_HEADERS) as r:
            assert r.status == 503 and "Retry-After" in r.headers
        assert await _accepted(a, KEY_A)
        async with s.get(f"{a}/admin/tenants", headers=ADMIN_HEADERS) as r:
            tenants = {t["name"]: t for t in (await r.json())["tenants"]}
        assert tenants["b"]["keys"] == [] and len(tenants["a"]["keys"]) == 1


async def test_the_table_is_put_back_after_redis_loses_every_key(redis_prefix: str) -> None:
    async with _two_replicas(redis_prefix) as (c, b, _), aiohttp.ClientSession() as s:
        a = c.router_url
        made = await _admin(s, "POST", f"{a}/admin/tenants/b/keys")
        await _admin(s, "DELETE", f"{a}/admin/tenants/a/keys/a-cfg")
        await _within(b, made["key"], True, REFRESH_S + SLACK_S)
        await _within(b, KEY_A, False, REFRESH_S + SLACK_S)

        client = aioredis.from_url(REDIS_URL)
        tkeys, revoked = f"{redis_prefix}{{reg}}:tkeys", f"{redis_prefix}{{reg}}:tkeys:revoked"
        try:
            keys = [k async for k in client.scan_iter(match=redis_prefix + "*", count=1000)]
            await client.delete(*keys)  # as a Redis restarted empty
            for url in (a, b):  # meanwhile, and after: never accepted again, the new key kept
                assert not await _accepted(url, KEY_A) and await _accepted(url, made["key"])
            deadline = time.monotonic() + 3 * REFRESH_S + SLACK_S
            while not (
                await client.hexists(tkeys, made["id"])
                and await client.sismember(revoked, _hex(KEY_A))
            ):
                assert time.monotonic() < deadline, "the key table was not put back"
                await asyncio.sleep(0.05)
        finally:
            await client.aclose()
        for url in (a, b):
            assert not await _accepted(url, KEY_A) and await _accepted(url, made["key"])


async def test_an_idle_replica_reads_the_table_only_when_it_changed(redis_prefix: str) -> None:
    async with _two_replicas(redis_prefix) as (c, b, _), aiohttp.ClientSession() as s:
        a = c.router_url
        await _admin(s, "POST", f"{a}/admin/tenants/b/keys")
        await asyncio.sleep(REFRESH_S + SLACK_S)  # B has adopted it
        client = aioredis.from_url(REDIS_URL)
        reads = 0
        try:
            async with client.monitor() as monitor:

                async def count() -> None:
                    nonlocal reads
                    while True:
                        cmd = (await monitor.next_command())["command"]
                        reads += redis_prefix in cmd and "}:tkeys " in cmd + " "

                task = asyncio.create_task(count())
                await asyncio.sleep(2.5 * REFRESH_S)
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, StoreError):
                    await task
        finally:
            await client.aclose()
        assert reads == 0  # the version, read with the registry, did not change
