"""Issue 22, "KV events" and "Placement on facts", on real vLLM engines with prefix caching and a
ZeroMQ `--kv-events-config` each (../shared/docs/design.md §9): two prefill engines (pa, pb) and
one decode engine (d0), NIXL between them, for this module only (the package's three-engine
cluster keeps prefix caching off: its tests count every prompt token as moved).

- The index: the router's own subscriber (router/workers/kv_events.py) on pa's publisher holds,
  after a run, exactly the full blocks of the prompts pa served, named by the router's chained
  hash of their token ids (policies/token_blocks.py, not the engine's seeded hash); a prompt that
  shares a block with an earlier one is a prefix-cache hit by vLLM's own counter, of exactly the
  shared block.
- Placed on the holder: a prefix cached on one prefill engine by a request the router never saw
  (another replica's, say) draws the router's next request that shares it to that engine, for
  either engine; vLLM's own counters show the hit there and no work on the other.
- Only the uncached blocks cross: a second turn extending a first one finds the first turn's
  blocks in the decode engine's own cache; its `external_kv_transfer` counter rises by the new
  tokens only, and both engines' hits are exactly the shared blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import shutil
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import zmq
import zmq.asyncio

from policies.token_blocks import block_hashes
from router.config import settings_from_mapping
from router.metrics import RouterMetrics
from router.worker_spec import KvEventsSpec
from router.workers.kv_events import KvEventSubscriber
from router.workers.kv_index import KvIndex
from tests.conftest import free_port, running_router
from tests.real_vllm.conftest import (
    BLOCK_SIZE,
    MODEL_DIR,
    SERVED,
    START_TIMEOUT_S,
    RealRouter,
    VllmCluster,
    VllmServer,
    chat_messages,
    missing_reason,
    nixl_handshake,
    router_settings,
    unique_prompt,
    wait_for,
)

pytestmark = pytest.mark.real_vllm

TOPIC = "kv"


@dataclass
class EventsServer(VllmServer):
    """A vLLM engine with prefix caching on and its KV events published on loopback ports
    (`*` makes the engine bind; the subscriber connects to 127.0.0.1)."""

    pub_port: int = field(default_factory=free_port)
    replay_port: int = field(default_factory=free_port)

    def command(self) -> list[str]:
        config = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://*:{self.pub_port}",
            "replay_endpoint": f"tcp://*:{self.replay_port}",
            "topic": TOPIC,
        }
        return [
            *super().command(),
            "--enable-prefix-caching",
            "--kv-events-config",
            json.dumps(config),
        ]

    @property
    def events(self) -> KvEventsSpec:
        return KvEventsSpec(
            f"tcp://127.0.0.1:{self.pub_port}", f"tcp://127.0.0.1:{self.replay_port}", TOPIC
        )


@dataclass
class EventsCluster:
    prefills: list[EventsServer]
    decode: EventsServer

    @property
    def servers(self) -> list[EventsServer]:
        return [*self.prefills, self.decode]


@pytest.fixture(scope="module")
def events_cluster() -> Iterator[EventsCluster]:
    reason = missing_reason()
    if reason is not None:
        pytest.skip(reason)
    workdir = Path(tempfile.mkdtemp(prefix="real-vllm-events-"))
    cluster = EventsCluster(
        prefills=[
            EventsServer("pa", "kv_producer", workdir),
            EventsServer("pb", "kv_producer", workdir),
        ],
        decode=EventsServer("d0", "kv_consumer", workdir),
    )
    t0 = time.monotonic()
    try:
        for s in cluster.servers:
            s.start()
        deadline = t0 + START_TIMEOUT_S
        for s in cluster.servers:
            s.wait_ready(deadline)
        for p in cluster.prefills:
            nixl_handshake(p, cluster.decode, deadline)
        print(f"\nreal vLLM: the events cluster is ready in {time.monotonic() - t0:.1f} s")
        yield cluster
    finally:
        for s in cluster.servers:
            s.stop()
        shutil.rmtree(workdir, ignore_errors=True)


def _prefix_cache_hits(server: VllmServer) -> float:
    """vLLM's prefix-cache hits counter (tokens)."""
    return sum(
        v
        for (name, _), v in server.metrics().items()
        if name.startswith("vllm:prefix_cache_hits") and not name.endswith("_created")
    )


def _tokens(n: int) -> list[int]:
    """A token-id prompt no other test shares a block with (the tiny model's vocabulary
    holds these ids)."""
    rng = random.Random(uuid.uuid4().int)
    return [rng.randrange(10, 1900) for _ in range(n)]


async def _complete(session: aiohttp.ClientSession, url: str, prompt: list[int]) -> None:
    body = {"model": SERVED, "prompt": prompt, "max_tokens": 1, "temperature": 0}
    async with session.post(url + "/v1/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()


def _indexed(r: RealRouter, worker_id: str) -> set[int]:
    """The router's hashes of the blocks the worker's events say it holds (looked up each
    time: a gap or a restart replaces the index)."""
    index: KvIndex | None = r.parts.pools.placement.kv_index(worker_id)
    return set() if index is None else set(index.router_hashes)


async def _wait_indexed(r: RealRouter, worker_id: str, hashes: set[int]) -> None:
    await wait_for(lambda: _indexed(r, worker_id) >= hashes, 30, f"{worker_id}'s blocks indexed")


# -- the index ---------------------------------------------------------------------------------


@pytest.fixture
async def subscriber(events_cluster: EventsCluster) -> AsyncIterator[KvEventSubscriber]:
    ctx = zmq.asyncio.Context()
    sub = KvEventSubscriber("pa", events_cluster.prefills[0].events, ctx, RouterMetrics())
    task = asyncio.create_task(sub.run())
    try:
        yield sub
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        ctx.term()


async def test_the_index_holds_exactly_the_engines_blocks_and_a_shared_block_is_a_hit(
    events_cluster: EventsCluster, subscriber: KvEventSubscriber
) -> None:
    # Token-id prompts: the blocks' tokens are known exactly. 2 full blocks and a partial one
    # each (plus one generated token: still 2 full blocks); b shares a's first block only.
    a = _tokens(2 * BLOCK_SIZE + 5)
    b = a[:BLOCK_SIZE] + _tokens(BLOCK_SIZE + 5)
    expected = set(block_hashes(a, BLOCK_SIZE)) | set(block_hashes(b, BLOCK_SIZE))
    assert len(expected) == 3

    engine = events_cluster.prefills[0]
    async with aiohttp.ClientSession() as session:
        await _complete(session, engine.url, a)
        hits_before = _prefix_cache_hits(engine)
        await _complete(session, engine.url, b)
        hits_after = _prefix_cache_hits(engine)

        # The events reach the index asynchronously: wait for the engine's batches, bounded.
        for _ in range(200):
            if subscriber.index.router_hashes >= expected:
                break
            await asyncio.sleep(0.05)
    # Exactly these: the handshake's prompt fills no block, and nothing else ran on pa since
    # this subscriber connected.
    assert subscriber.index.router_hashes == expected, subscriber.describe()
    assert subscriber.index.block_size == BLOCK_SIZE
    # b's first block was a's: vLLM served it from its prefix cache, and only it.
    assert hits_after - hits_before == BLOCK_SIZE


# -- the router, placing on the engines' facts -------------------------------------------------


@contextlib.asynccontextmanager
async def _router(cluster: EventsCluster, prefix: str) -> AsyncIterator[RealRouter]:
    # router_settings' shape for one prefill and one decode, then the second prefill and every
    # worker's events; the model's own tokenizer, so text prompts hash as the engines' tokens.
    pair = VllmCluster(prefill=cluster.prefills[0], decodes=[cluster.decode], workdir=Path("."))
    raw = router_settings(pair, prefix, estimates={"tokenizers": {SERVED: str(MODEL_DIR)}})
    second = dict(raw["workers"][0], id="pb", url=cluster.prefills[1].url)
    raw["workers"].insert(1, second)
    for w in raw["workers"]:
        w["kv_events"] = {
            "endpoint": next(s for s in cluster.servers if s.name == w["id"]).events.endpoint,
            "replay_endpoint": next(
                s for s in cluster.servers if s.name == w["id"]
            ).events.replay_endpoint,
            "topic": TOPIC,
        }
    async with running_router(settings_from_mapping(raw)) as (url, app):
        r = RealRouter(url=url, app=app, cluster=pair)
        placement = r.parts.pools.placement
        await wait_for(
            lambda: all(
                placement.prefix_cache(s.name)["source"] == "events" for s in cluster.servers
            ),
            30,
            "every worker's events subscribed",
        )
        yield r


def _by_source(servers: list[EventsServer]) -> dict[str, dict[str, float]]:
    return {s.name: s.prompt_tokens_by_source() for s in servers}


def _delta(
    after: dict[str, dict[str, float]], before: dict[str, dict[str, float]], name: str
) -> dict[str, float]:
    return {
        k: after[name].get(k, 0.0) - before[name].get(k, 0.0)
        for k in ("local_compute", "local_cache_hit", "external_kv_transfer")
    }


async def test_a_prefix_another_replica_cached_draws_the_request_to_its_holder(
    events_cluster: EventsCluster, redis_prefix: str
) -> None:
    """For each prefill engine in turn: its prefix was cached by a request sent to it
    directly (the router never saw it, so only the engine's events can tell); the router's
    next request sharing that prefix is prefilled there, from its cache."""
    prefills = events_cluster.prefills
    async with _router(events_cluster, redis_prefix) as r, aiohttp.ClientSession() as session:
        for holder in (prefills[1], prefills[0]):
            other = next(p for p in prefills if p is not holder)
            shared = _tokens(4 * BLOCK_SIZE)
            await _complete(session, holder.url, shared + _tokens(5))
            await _wait_indexed(r, holder.name, set(block_hashes(shared, BLOCK_SIZE)))

            before, hits = _by_source(prefills), _prefix_cache_hits(holder)
            prompt = shared + _tokens(40)
            body = {"model": SERVED, "prompt": prompt, "max_tokens": 4, "temperature": 0}
            async with session.post(r.url + "/v1/completions", json=body) as resp:
                answer = await resp.json()
                assert resp.status == 200, answer
            assert answer["usage"]["prompt_tokens"] == len(prompt)
            after = _by_source(prefills)

            on_holder = _delta(after, before, holder.name)
            assert on_holder["local_cache_hit"] == len(shared), (holder.name, on_holder)
            assert on_holder["local_compute"] == len(prompt) - len(shared), on_holder
            assert _prefix_cache_hits(holder) - hits == len(shared)
            assert set(_delta(after, before, other.name).values()) == {0.0}, other.name


async def test_a_second_turn_moves_only_the_blocks_the_decode_engine_lacks(
    events_cluster: EventsCluster, redis_prefix: str
) -> None:
    """Turn 1 through the router leaves its prompt's full blocks in the decode engine's own
    prefix cache (its events say so, and the router's index of d0 holds them); turn 2 extends
    turn 1's prompt: the decode engine finds those blocks locally and pulls only the rest
    (vLLM's NIXL consumer asks only for what its cache misses, design.md §9)."""
    decode = events_cluster.decode
    everyone = events_cluster.servers
    async with _router(events_cluster, redis_prefix) as r, aiohttp.ClientSession() as session:

        async def ask(prompt: list[int]) -> dict[str, Any]:
            body = {"model": SERVED, "prompt": prompt, "max_tokens": 4, "temperature": 0}
            async with session.post(r.url + "/v1/completions", json=body) as resp:
                answer: dict[str, Any] = await resp.json()
                assert resp.status == 200, answer
            return answer

        first = _tokens(4 * BLOCK_SIZE + 5)
        before = _by_source(everyone)
        await ask(first)
        after = _by_source(everyone)
        moved = _delta(after, before, decode.name)
        assert moved == {
            "local_compute": 0.0,
            "local_cache_hit": 0.0,
            "external_kv_transfer": float(len(first)),
        }, moved
        await _wait_indexed(r, decode.name, set(block_hashes(first, BLOCK_SIZE)))

        second = first + _tokens(2 * BLOCK_SIZE)
        cached = 4 * BLOCK_SIZE
        before = _by_source(everyone)
        answer = await ask(second)
        after = _by_source(everyone)
        assert answer["usage"]["prompt_tokens"] == len(second)
        moved = _delta(after, before, decode.name)
        assert moved == {
            "local_compute": 0.0,
            "local_cache_hit": float(cached),
            "external_kv_transfer": float(len(second) - cached),
        }, moved
        # The prefill side: turn 2 went where turn 1 was prefilled, and computed only the rest.
        prefilled = [_delta(after, before, p.name) for p in events_cluster.prefills]
        assert sorted(d["local_cache_hit"] for d in prefilled) == [0.0, float(cached)], prefilled
        assert sum(d["local_compute"] for d in prefilled) == len(second) - cached, prefilled


async def test_a_chat_follow_up_is_placed_on_the_engine_holding_its_history(
    events_cluster: EventsCluster, redis_prefix: str
) -> None:
    """Text, not token ids: the router renders the chat with the model's own template and
    tokenizer, so its block hashes are the engine's tokens'. A conversation's first turn,
    cached on pb by a request the router never saw, draws its second turn to pb."""
    holder, other = events_cluster.prefills[1], events_cluster.prefills[0]
    history = chat_messages(unique_prompt(300))
    async with _router(events_cluster, redis_prefix) as r, aiohttp.ClientSession() as session:
        first = {"model": SERVED, "messages": history, "max_tokens": 4, "temperature": 0}
        async with session.post(holder.url + "/v1/chat/completions", json=first) as resp:
            reply = await resp.json()
            assert resp.status == 200, reply
        full_blocks = reply["usage"]["prompt_tokens"] // BLOCK_SIZE
        assert full_blocks >= 4, reply["usage"]
        await wait_for(
            lambda: len(_indexed(r, holder.name)) >= full_blocks,
            30,
            "the first turn's blocks indexed",
        )

        turns = [
            *history,
            {"role": "assistant", "content": reply["choices"][0]["message"]["content"]},
            {"role": "user", "content": unique_prompt(40)},
        ]
        before = _by_source(events_cluster.prefills)
        body = {"model": SERVED, "messages": turns, "max_tokens": 4, "temperature": 0}
        async with session.post(r.url + "/v1/chat/completions", json=body) as resp:
            answer = await resp.json()
            assert resp.status == 200, answer
        after = _by_source(events_cluster.prefills)
    on_holder = _delta(after, before, holder.name)
    # At least the first turn's full prompt blocks (the template writes turn 1's prompt again,
    # then the answer), in whole blocks.
    assert on_holder["local_cache_hit"] >= full_blocks * BLOCK_SIZE, on_holder
    assert on_holder["local_cache_hit"] % BLOCK_SIZE == 0, on_holder
    assert set(_delta(after, before, other.name).values()) == {0.0}


async def test_a_router_started_after_the_engine_learns_what_it_holds_by_replay(
    events_cluster: EventsCluster, redis_prefix: str
) -> None:
    """The engine's PUB socket sends a subscriber nothing from before it connected: what pb
    cached before this router started reaches its index through pb's replay socket only."""
    holder = events_cluster.prefills[1]
    early = _tokens(3 * BLOCK_SIZE + 1)
    async with aiohttp.ClientSession() as session:
        await _complete(session, holder.url, early)
    async with _router(events_cluster, redis_prefix) as r:
        await _wait_indexed(r, holder.name, set(block_hashes(early, BLOCK_SIZE)))
        assert r.parts.metrics.kv_events_gaps.labels(worker=holder.name)._value.get() == 0


async def test_the_index_follows_an_engine_restart(
    events_cluster: EventsCluster, redis_prefix: str
) -> None:
    """pb restarts on the same ports (a new process: an empty cache, its batch counter from 0
    again): the router's index of pb forgets what the old process held and learns what the new
    one stores. The last test of the module: it leaves pb a fresh engine."""
    engine = events_cluster.prefills[1]
    before, after = _tokens(2 * BLOCK_SIZE + 3), _tokens(2 * BLOCK_SIZE + 3)
    async with _router(events_cluster, redis_prefix) as r, aiohttp.ClientSession() as session:
        await _complete(session, engine.url, before)
        await _wait_indexed(r, engine.name, set(block_hashes(before, BLOCK_SIZE)))

        engine.stop()
        engine.start()
        engine.wait_ready(time.monotonic() + START_TIMEOUT_S)
        await _complete(session, engine.url, after)
        new_blocks = set(block_hashes(after, BLOCK_SIZE))
        await wait_for(
            lambda: _indexed(r, engine.name) == new_blocks,
            60,
            "pb's index holds exactly the new process's blocks",
        )
        drops = r.parts.metrics.kv_events_index_drops.labels(worker=engine.name, reason="restart")
        assert drops._value.get() >= 1
        assert r.parts.pools.placement.prefix_cache(engine.name)["source"] == "events"
