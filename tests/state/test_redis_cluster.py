"""`RedisStore` on a Redis Cluster beyond the conformance suite: the ``redis+cluster://`` URL, the
bounded wait for connections, calls that span nodes (one of them unreachable, or all of them
having lost their scripts), and a router serving requests through the cluster.

All on the private 3-node cluster of tests/redis_cluster.py, under a key prefix per test.
"""

from __future__ import annotations

import asyncio
import socket
import uuid
from collections.abc import AsyncIterator

import pytest
from openai import AsyncOpenAI
from openai.types.chat import ChatCompletionMessageParam
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from disagg_tools.sim.textgen import expected_answer
from state import DecodeUsage, Keys, RedisStore, StoreError, open_store
from tests.conftest import MODEL, sim_cluster
from tests.redis_cluster import PrivateRedisCluster, redis_cluster

__all__ = ["redis_cluster"]  # the session fixture

LONG = 60.0
CHAT = "/v1/chat/completions"


@pytest.fixture
async def cluster_prefix(redis_cluster: PrivateRedisCluster) -> AsyncIterator[str]:
    """A key prefix of this test's own on the cluster; its keys are deleted afterwards."""
    prefix = f"test:{uuid.uuid4().hex[:12]}:"
    yield prefix
    host, port = redis_cluster.seed
    client = RedisCluster(host=host, port=port)
    try:
        keys = [k async for k in client.scan_iter(match=prefix + "*", count=1000)]
        if keys:
            await client.delete(*keys)
    finally:
        await client.aclose()


@pytest.fixture
async def admin(redis_cluster: PrivateRedisCluster) -> AsyncIterator[RedisCluster]:
    """A plain cluster client, to look at where keys live."""
    host, port = redis_cluster.seed
    client = RedisCluster(host=host, port=port)
    try:
        yield client
    finally:
        await client.aclose()


async def _ids_by_node(client: RedisCluster, key_of: object, count: int = 60) -> dict[int, str]:
    """One id per node port: the first of w0, w1, ... whose key (`key_of(id)`) lives there."""
    await client.initialize()
    found: dict[int, str] = {}
    for i in range(count):
        wid = f"w{i}"
        node = client.get_node_from_key(key_of(wid))  # type: ignore[operator]
        assert node is not None
        found.setdefault(int(node.port), wid)
    return found


async def test_open_store_takes_a_cluster_url(
    redis_cluster: PrivateRedisCluster, cluster_prefix: str
) -> None:
    store = await open_store(redis_cluster.url, cluster_prefix)
    try:
        assert isinstance(store, RedisStore) and store.is_cluster
        assert "redis+cluster://127.0.0.1:" in repr(store)
        assert await store.ping()
        await store.set_capacity("d1", 10)
        assert await store.reserve("d1", "r1", 4, LONG)
        assert await store.decode_usage(["d1"]) == {"d1": DecodeUsage(10, 4, 1)}
    finally:
        await store.close()
    with pytest.raises(ValueError, match="db"):
        await open_store(redis_cluster.url + "/3", cluster_prefix)


async def test_a_burst_larger_than_the_pool_waits_on_a_cluster(
    redis_cluster: PrivateRedisCluster, cluster_prefix: str
) -> None:
    """The cluster client's per-node pool raises MaxConnectionsError past its cap; the store
    admits at most `max_connections` calls at once, so the burst queues and succeeds."""
    store = await open_store(redis_cluster.url, cluster_prefix, max_connections=3)
    try:
        workers = [f"d{i}" for i in range(6)]
        await asyncio.gather(*(store.set_capacity(w, 10_000) for w in workers))
        results = await asyncio.gather(
            *(store.reserve(workers[i % 6], f"r{i}", 1, LONG) for i in range(300)),
            *(store.decode_usage(workers) for _ in range(30)),
            *(store.finish(record=([f"c{i % 5}"], 1)) for i in range(30)),
        )
        assert all(results[:300])
        usage = await store.decode_usage(workers)
        assert sum(u.reserved_blocks for u in usage.values()) == 300
    finally:
        await store.close()


async def test_calls_spanning_every_node(
    redis_cluster: PrivateRedisCluster, cluster_prefix: str, admin: RedisCluster
) -> None:
    keys = Keys(cluster_prefix)
    decode = await _ids_by_node(admin, keys.decode_sum)
    prefill = await _ids_by_node(admin, keys.stranded_sum)
    classes = await _ids_by_node(admin, keys.output_stats)
    assert len(decode) == len(prefill) == len(classes) == 3  # one id on each node
    store = RedisStore(admin, keys)
    for w in decode.values():
        await store.set_capacity(w, 10)
        assert await store.reserve(w, "r", 3, LONG)
    for p in prefill.values():
        await store.strand(p, "q", 100)
    usage = await store.decode_usage(decode.values())
    assert usage == {w: DecodeUsage(10, 3, 1) for w in decode.values()}
    assert await store.stranded_bytes(prefill.values()) == {p: 100 for p in prefill.values()}
    await store.record_output(list(classes.values()), 4)
    hist = await store.output_histograms(list(classes.values()))
    assert hist == {c: {4: 1} for c in classes.values()}
    # The end of a request whose three steps live on three different nodes.
    ports = sorted(decode)
    done = await store.finish(
        (decode[ports[0]], "r"), (prefill[ports[1]], "q"), ([classes[ports[2]]], 4)
    )
    assert (done.released_blocks, done.unstranded_bytes, done.recorded) == (3, 100, True)


async def test_scripts_lost_on_every_node_are_loaded_again(
    cluster_prefix: str, admin: RedisCluster
) -> None:
    """A node restarted or failed over to a replica has no scripts: the single calls and the
    pipelined ones answer NOSCRIPT once, load them and run."""
    keys = Keys(cluster_prefix)
    decode = list((await _ids_by_node(admin, keys.decode_sum)).values())
    store = RedisStore(admin, keys)
    for w in decode:
        await store.set_capacity(w, 10)
    await admin.script_flush()
    assert await store.decode_usage(decode) == {w: DecodeUsage(10, 0, 0) for w in decode}
    await admin.script_flush()
    assert await store.reserve(decode[0], "r", 2, LONG)
    await store.strand("p1", "q", 5)
    await admin.script_flush()
    done = await store.finish((decode[0], "r"), ("p1", "q"), (["c"], 1))
    assert (done.released_blocks, done.unstranded_bytes, done.recorded) == (2, 5, True)


def _dead_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])  # closed again: nothing listens there


async def test_finish_with_a_node_unreachable_does_the_other_steps(
    redis_cluster: PrivateRedisCluster, cluster_prefix: str, admin: RedisCluster
) -> None:
    """On a cluster the steps of `finish` live on different nodes: one node that does not
    answer fails its own step only (the release still happens). The client is pointed at a
    dead port for one node (`address_remap`), so the shared cluster itself is never stopped."""
    keys = Keys(cluster_prefix)
    decode = await _ids_by_node(admin, keys.decode_sum)
    prefill = await _ids_by_node(admin, keys.stranded_sum)
    healthy, down = redis_cluster.ports[0], redis_cluster.ports[1]
    good = RedisStore(admin, keys)
    await good.set_capacity(decode[healthy], 10)
    assert await good.reserve(decode[healthy], "r", 7, LONG)
    await good.strand(prefill[down], "q", 50)

    dead = _dead_port()

    def remap(address: tuple[str, int]) -> tuple[str, int]:
        return (address[0], dead) if address[1] == down else address

    broken = RedisCluster(
        host="127.0.0.1",
        port=healthy,
        address_remap=remap,
        retry=Retry(NoBackoff(), 1),  # the default backs off for seconds before giving up
    )
    try:
        store = RedisStore(broken, keys)
        done = await store.finish((decode[healthy], "r"), (prefill[down], "q"))
        assert done.released_blocks == 7
        assert done.unstranded_bytes is None and not done.complete
        with pytest.raises(StoreError):  # nothing reachable: the call as a whole fails
            await store.finish(unstrand=(prefill[down], "q"))
    finally:
        await broken.aclose()
    assert await good.decode_usage([decode[healthy]]) == {decode[healthy]: DecodeUsage(10, 0, 0)}
    assert await good.unstrand(prefill[down], "q") == 50  # still there: owed by the caller


async def test_router_serves_requests_through_the_cluster(
    redis_cluster: PrivateRedisCluster, cluster_prefix: str, admin: RedisCluster
) -> None:
    cluster = sim_cluster(
        redis_prefix=cluster_prefix, store={"url": redis_cluster.url}, prefill=2, decode=2
    )
    async with (
        cluster as c,
        AsyncOpenAI(base_url=c.router_url + "/v1", api_key="k", max_retries=0, timeout=30) as ai,
    ):
        assert c.parts.store.is_cluster
        question = "How does a Redis Cluster place keys?"
        messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": question}]
        body = {"model": MODEL, "messages": messages, "max_tokens": 40}
        want, n_tokens, finish = expected_answer(CHAT, body)
        stream = await ai.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=40,
            stream=True,
        )
        pieces, finishes = [], []
        async for chunk in stream:
            for choice in chunk.choices:
                if choice.delta.content:
                    pieces.append(choice.delta.content)
                if choice.finish_reason:
                    finishes.append(choice.finish_reason)
        assert "".join(pieces) == want and len(pieces) == n_tokens
        assert finishes == [finish]

        async def whole(i: int) -> None:
            msgs: list[ChatCompletionMessageParam] = [
                {"role": "user", "content": f"question {i}: " + "why? " * i}
            ]
            b = {"model": MODEL, "messages": msgs, "max_tokens": 20 + i}
            resp = await ai.chat.completions.create(
                model=MODEL,
                messages=msgs,
                max_tokens=20 + i,
            )
            assert resp.choices[0].message.content == expected_answer(CHAT, b)[0]

        await asyncio.gather(*(whole(i) for i in range(12)))
        for _ in range(100):  # releases run as the handlers unwind
            if sum((await c.reserved_blocks()).values()) == 0:
                break
            await asyncio.sleep(0.05)
        assert await c.reserved_blocks() == {"d0": 0, "d1": 0}
        assert await c.stranded() == {"p0": 0, "p1": 0}
        # The router's keys are on the cluster, spread by their tags.
        keys = Keys(cluster_prefix)
        assert await admin.get(keys.decode_capacity("d0")) is not None
        assert await admin.exists(keys.decode_blocks("d0"), keys.decode_blocks("d1")) == 0
