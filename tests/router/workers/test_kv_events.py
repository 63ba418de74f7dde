"""KV events: vLLM's wire format decoded, each worker's index kept equal to its cache.

Real ZeroMQ sockets on loopback, real simulated workers publishing their prefix cache's events
(disagg_tools/sim/kv_events.py), a real router subscribing (router/workers/kv_events.py) with a
real Redis behind it. Waits are on conditions with a deadline, never on time alone.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import aiohttp
import msgpack
import pytest

from disagg_tools.sim.worker import (
    WorkerConfig,
    add_worker_arguments,
    config_from_args,
    running_worker,
)
from policies.base import KVLayout
from policies.token_blocks import block_hashes
from router.config import settings_from_mapping
from router.worker_spec import ConfigError, KvEventsSpec, parse_worker
from router.workers.kv_events import KvEventHub
from router.workers.kv_index import KvIndex
from router.workers.kv_wire import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    WireError,
    decode_batch,
    decode_seq,
)
from tests.app_parts import AppParts, parts
from tests.conftest import MODEL, REDIS_URL, running_router
from tests.ports import free_port

BS = 16  # the sim's block size


# --- the wire format --------------------------------------------------------------------------


def test_decodes_map_shaped_events_of_vllm_0_32() -> None:
    payload = msgpack.packb(
        [
            1.5,
            [
                {
                    "type": "BlockStored",
                    "block_hashes": [2**64 - 1, b"\x01\x02"],
                    "parent_block_hash": None,
                    "token_ids": list(range(4)),
                    "block_size": 2,
                    "lora_id": None,
                    "medium": "GPU",
                    "lora_name": None,
                    "extra_keys": [None, None],
                    "group_idx": 0,
                    "kv_cache_spec_kind": "full_attention",
                },
                {"type": "BlockRemoved", "block_hashes": [7], "medium": "GPU"},
                {"type": "AllBlocksCleared"},
            ],
            0,
        ]
    )
    batch = decode_batch(payload)
    assert batch.ts == 1.5 and batch.data_parallel_rank == 0
    stored, removed, cleared = batch.events
    assert stored == BlockStored([2**64 - 1, b"\x01\x02"], None, [0, 1, 2, 3], 2, "GPU")
    assert removed == BlockRemoved([7], "GPU")
    assert cleared == AllBlocksCleared()


def test_decodes_array_shaped_events_of_older_releases() -> None:
    payload = msgpack.packb(
        [2.0, [["BlockStored", [1, 2], 9, [5, 6, 7, 8], 2, None], ["BlockRemoved", [1]]]]
    )
    batch = decode_batch(payload)
    assert batch.data_parallel_rank is None
    assert batch.events == (BlockStored([1, 2], 9, [5, 6, 7, 8], 2), BlockRemoved([1]))


@pytest.mark.parametrize(
    "payload",
    [
        b"\xc1",  # not msgpack
        msgpack.packb({"ts": 1.0}),
        msgpack.packb([1.0, [{"type": "Nope"}]]),
        msgpack.packb([1.0, [{"type": "BlockStored", "block_hashes": [1], "token_ids": "x"}]]),
    ],
)
def test_refuses_what_is_not_the_format(payload: bytes) -> None:
    with pytest.raises(WireError):
        decode_batch(payload)


def test_sequence_frames() -> None:
    assert decode_seq((5).to_bytes(8, "big")) == 5
    assert decode_seq((-1).to_bytes(8, "big", signed=True)) == -1
    with pytest.raises(WireError):
        decode_seq(b"\x00")


# --- the index --------------------------------------------------------------------------------


def test_index_names_blocks_by_the_routers_chained_hash() -> None:
    tokens = list(range(4 * BS))
    ours = block_hashes(tokens, BS)
    index = KvIndex()
    # The engine stores the prompt in two events, the second chained from the first's last.
    index.store([101, 102], None, tokens[: 2 * BS], BS)
    index.store([103, 104], 102, tokens[2 * BS :], BS)
    assert index.router_hashes == frozenset(ours)
    assert index.cached_prefix_blocks(ours) == 4
    index.remove([102])  # a hole: only the first block still serves as a prefix
    assert index.cached_prefix_blocks(ours) == 1
    index.store([999], 555, tokens[:BS], BS)  # parent unknown: cannot be named
    assert index.unchained == 1 and len(index) == 3
    index.clear()
    assert len(index) == 0 and index.cached_prefix_blocks(ours) == 0


def test_index_counts_duplicate_blocks_until_the_last_goes() -> None:
    tokens = list(range(BS))
    index = KvIndex()
    index.store([1], None, tokens, BS)
    index.store([2], None, tokens, BS)  # same tokens under another engine hash (a LoRA, a salt)
    index.store([1], None, tokens, BS)  # the same engine hash stored twice
    held = block_hashes(tokens, BS)
    for engine in (1, 2, 1):
        assert index.cached_prefix_blocks(held) == 1
        index.remove([engine])
    assert index.cached_prefix_blocks(held) == 0 and len(index) == 0


def test_index_overflow_drops_it() -> None:
    index = KvIndex(max_blocks=2)
    index.store([1, 2, 3], None, list(range(3 * BS)), BS)
    assert index.overflowed and len(index) == 0


def index_bytes(index: KvIndex) -> int:
    """What the index's tables and the ints they hold take (each int once: a router hash is
    the same object in both tables; the counts are small, shared ints)."""
    router_of, held = index._router_of, index._held
    ints = {id(x): sys.getsizeof(x) for x in router_of}
    ints.update({id(x): sys.getsizeof(x) for x in held})
    return (
        sys.getsizeof(router_of)
        + sys.getsizeof(held)
        + sys.getsizeof(index._copies)
        + sum(ints.values())
    )


def test_index_memory_per_block() -> None:
    """Bytes per block held (docs/kv-events.md quotes what this prints at 1 M blocks:
    KV_INDEX_BLOCKS=1000000 pytest tests/router/workers/test_kv_events.py -k memory -s; 200 k by
    default)."""
    n, per_event = int(os.environ.get("KV_INDEX_BLOCKS", "200000")), 64
    tokens = list(range(per_event * BS))
    index = KvIndex()
    for base in range(0, n, per_event):
        # Distinct prompts (parent None), distinct token ids: distinct router hashes; engine
        # hashes as vLLM's ints (up to 2**64).
        index.store(
            [2**63 + base + k for k in range(per_event)], None, [t + base for t in tokens], BS
        )
    per_block = index_bytes(index) / len(index)
    print(
        f"\nKvIndex: {len(index)} blocks, {index_bytes(index) / 2**20:.1f} MiB, "
        f"{per_block:.0f} B/block"
    )
    assert len(index) == -(-n // per_event) * per_event
    assert per_block < 200  # docs/kv-events.md


# --- live: sim workers publishing, the router subscribing -------------------------------------


class KvCluster:
    def __init__(self, urls: dict[str, str], configs: dict[str, WorkerConfig]) -> None:
        self.app: Any = None
        self.urls, self.configs = urls, configs
        self.stacks: dict[str, contextlib.AsyncExitStack] = {}

    @property
    def parts(self) -> AppParts:
        return AppParts(self.app)

    @property
    def hub(self) -> KvEventHub:
        hub = self.parts.pools.placement._kv  # the hub the app built
        assert isinstance(hub, KvEventHub)
        return hub

    def counter(self, metric: str, **labels: str) -> float:
        return float(getattr(self.parts.metrics, metric).labels(**labels)._value.get())

    async def start(self, wid: str) -> None:
        stack = self.stacks[wid] = contextlib.AsyncExitStack()
        self.urls[wid] = await stack.enter_async_context(running_worker(self.configs[wid]))

    async def restart(self, wid: str) -> None:
        """The worker's process ends and a new one starts on the same ports (a new engine)."""
        await self.stacks.pop(wid).aclose()
        self.configs[wid] = replace(self.configs[wid], engine_id=uuid.uuid4().hex)
        await self.start(wid)

    async def complete(self, wid: str, ids: list[int]) -> None:
        body = {"model": MODEL, "prompt": ids, "max_tokens": 1}
        async with aiohttp.ClientSession() as s:
            async with s.post(self.urls[wid] + "/v1/completions", json=body) as r:
                assert r.status == 200, await r.text()

    async def sim(self, wid: str, path: str, body: Any = None) -> Any:
        async with aiohttp.ClientSession() as s:
            if body is None:
                async with s.get(self.urls[wid] + path) as r:
                    assert r.status == 200, await r.text()
                    return await r.json()
            async with s.post(self.urls[wid] + path, json=body) as r:
                assert r.status in (200, 204), await r.text()
                return None

    async def cache(self, wid: str) -> frozenset[int]:
        return frozenset((await self.sim(wid, "/sim/kv_events"))["blocks"])

    def index(self, wid: str) -> frozenset[int]:
        return self.hub.subscribers[wid].index.router_hashes

    async def wait_equal(self, wid: str) -> None:
        async def equal() -> bool:
            sub = self.hub.subscribers.get(wid)
            if sub is None or sub.state == "connecting":
                return False
            return self.index(wid) == await self.cache(wid)

        await until(equal, f"{wid}'s index equals its cache")


async def until(cond: Callable[[], Awaitable[bool]], what: str, deadline_s: float = 15.0) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + deadline_s
    while not await cond():
        if loop.time() > end:
            raise AssertionError(f"not within {deadline_s} s: {what}")
        await asyncio.sleep(0.02)


def _worker_config(
    wid: str, kv_blocks: int, events: bool, role: str = "both", tokenizer: Path | None = None
) -> WorkerConfig:
    extra: dict[str, Any] = {} if tokenizer is None else {"tokenizer": str(tokenizer)}
    if events:
        extra |= {
            "port": free_port(),  # fixed ports: a restarted worker comes back on them
            "kv_events_endpoint": f"tcp://127.0.0.1:{free_port()}",
            "kv_events_replay_endpoint": f"tcp://127.0.0.1:{free_port()}",
        }
    return WorkerConfig(
        role=role,
        worker_id=wid,
        model=MODEL,
        kv_blocks=kv_blocks,
        time_scale=500.0,
        kv_lease_s=30.0 * 500,
        **extra,
    )


@contextlib.asynccontextmanager
async def kv_cluster(
    redis_prefix: str,
    *,
    workers: int = 1,
    kv_blocks: int = 4096,
    plain: int = 0,
    roles: dict[str, str] | None = None,
    tokenizer: Path | None = None,
) -> AsyncIterator[KvCluster]:
    """`workers` `both` sim workers publishing KV events (b0...), `plain` ones without, and a
    router; or `roles` (id -> role), each publishing. With `tokenizer`, the workers name text
    prompts' blocks by its ids and the router counts prompts with it (the demo's setup)."""
    configs = (
        {wid: _worker_config(wid, kv_blocks, True, role, tokenizer) for wid, role in roles.items()}
        if roles
        else {
            f"b{i}": _worker_config(f"b{i}", kv_blocks, events=i < workers)
            for i in range(workers + plain)
        }
    )
    c = KvCluster({}, configs)
    try:
        entries = []
        for wid, cfg in configs.items():
            await c.start(wid)
            entry: dict[str, Any] = {
                "id": wid,
                "url": c.urls[wid],
                "role": cfg.role,
                "adapter": "sim",
            }
            if cfg.role != "prefill":
                entry["kv_blocks"] = kv_blocks
            if cfg.kv_events_endpoint:
                entry["kv_events"] = {
                    "endpoint": cfg.kv_events_endpoint,
                    "replay_endpoint": cfg.kv_events_replay_endpoint,
                }
            entries.append(entry)
        raw: dict[str, Any] = {
            "model": MODEL,
            "perf": {"model": MODEL, "gpu": "h100"},
            "store": {"url": REDIS_URL, "key_prefix": redis_prefix},
            "loops": {"health_interval_s": 0.5, "state_refresh_s": 0.05},
            "workers": entries,
            "policy": "two_sided",
        }
        if tokenizer is not None:
            raw["estimates"] = {"tokenizers": {MODEL: str(tokenizer)}}
        async with running_router(settings_from_mapping(raw)) as (url, app):
            c.app = app
            c.router_url = url
            yield c
    finally:
        for stack in c.stacks.values():
            await stack.aclose()


def _prompt(seed: int, blocks: int) -> list[int]:
    """A prompt of `blocks` full blocks and a partial one, its ids drawn from `seed`."""
    return [(seed * 7919 + i * 31) % 32_000 for i in range(blocks * BS + 3)]


async def test_index_equals_each_workers_cache_after_a_run(redis_prefix: str) -> None:
    async with kv_cluster(redis_prefix, workers=2, kv_blocks=40, plain=1) as c:
        shared = _prompt(1, 6)[: 6 * BS]
        for i in range(8):  # shared prefixes, new tails, and enough to evict (40 blocks)
            await c.complete(f"b{i % 2}", shared + _prompt(100 + i, 3))
            await c.complete(f"b{i % 2}", _prompt(200 + i, 4))
        for wid in ("b0", "b1"):
            await c.wait_equal(wid)
            assert 30 <= len(c.index(wid)) <= 40  # it evicted: the cache holds 40 blocks
        assert c.counter("kv_events_batches", worker="b0") >= 8
        view = c.parts.pools.placement.prefix_cache
        assert view("b0")["source"] == "events" and view("b0")["kv_events"]["state"] == "synced"
        assert view("b2") == {"source": "estimated", "kv_events": None}
        # /admin/state says the same, worker by worker.
        async with aiohttp.ClientSession() as s, s.get(c.router_url + "/admin/state") as r:
            state = await r.json()
        modes = {w["id"]: w["prefix_cache"]["source"] for w in state["workers"]}
        assert modes == {"b0": "events", "b1": "events", "b2": "estimated"}


async def test_a_gap_is_recovered_by_replay(redis_prefix: str) -> None:
    async with kv_cluster(redis_prefix) as c:
        await c.complete("b0", _prompt(1, 3))
        await c.wait_equal("b0")
        await c.sim("b0", "/sim/kv_events/drop", {"batches": 2, "replay": True})
        await c.complete("b0", _prompt(2, 3))  # lost on the PUB, kept for replay
        await c.complete("b0", _prompt(2, 5))  # extends the lost one: chained through it
        await c.complete("b0", _prompt(3, 2))  # the gap shows here
        await c.wait_equal("b0")
        assert c.counter("kv_events_gaps", worker="b0") == 1
        assert c.counter("kv_events_replays", worker="b0", outcome="ok") == 1
        assert c.hub.subscribers["b0"].state == "synced"
        assert len(c.index("b0")) == 3 + 5 + 2


async def test_without_replay_the_index_is_dropped_and_rebuilt(redis_prefix: str) -> None:
    async with kv_cluster(redis_prefix) as c:
        await c.complete("b0", _prompt(1, 3))
        await c.wait_equal("b0")
        await c.sim("b0", "/sim/kv_events/drop", {"batches": 1, "replay": False})
        await c.complete("b0", _prompt(2, 3))  # lost for good
        await c.complete("b0", _prompt(4, 2))

        async def rebuilt() -> bool:
            sub = c.hub.subscribers["b0"]
            return sub.state == "rebuilding" and len(sub.index) == 2

        await until(rebuilt, "the index dropped and rebuilt from the next batch")
        assert c.counter("kv_events_replays", worker="b0", outcome="failed") == 1
        assert c.counter("kv_events_index_drops", worker="b0", reason="gap") == 1
        # Rebuilt from what came next: a subset of the cache, never a block it does not hold.
        assert c.index("b0") == frozenset(block_hashes(_prompt(4, 2), BS)) < await c.cache("b0")
        assert c.parts.pools.placement.prefix_cache("b0")["kv_events"]["state"] == "rebuilding"


async def test_all_blocks_cleared_empties_the_index(redis_prefix: str) -> None:
    async with kv_cluster(redis_prefix) as c:
        await c.complete("b0", _prompt(1, 4))
        await c.wait_equal("b0")
        assert len(c.index("b0")) == 4
        await c.sim("b0", "/reset_prefix_cache", {})

        async def cleared() -> bool:
            return c.counter("kv_events_index_drops", worker="b0", reason="cleared") == 1

        await until(cleared, "AllBlocksCleared applied")
        assert c.index("b0") == frozenset() == await c.cache("b0")
        await c.complete("b0", _prompt(1, 2))
        await c.wait_equal("b0")
        assert len(c.index("b0")) == 2


async def test_a_restarted_worker_is_indexed_afresh(redis_prefix: str) -> None:
    async with kv_cluster(redis_prefix) as c:
        for i in range(4):  # the old process publishes seq 0..3
            await c.complete("b0", _prompt(10 + i, 2))
        await c.wait_equal("b0")
        assert len(c.index("b0")) == 8
        await c.restart("b0")
        await c.complete("b0", _prompt(50, 3))  # the new process: seq 0 (may miss the SUB)
        await c.complete("b0", _prompt(51, 1))  # seq 1 < 4: the counter went back

        async def afresh() -> bool:
            return c.counter("kv_events_index_drops", worker="b0", reason="restart") == 1

        await until(afresh, "the restart seen")
        await c.wait_equal("b0")
        assert len(c.index("b0")) == 4  # the old process's blocks went with it


async def test_a_router_started_after_its_workers_learns_what_they_hold(
    redis_prefix: str,
) -> None:
    async with kv_cluster(redis_prefix) as c:
        await c.complete("b0", _prompt(1, 3))
        await c.wait_equal("b0")
        entries = [
            {
                "id": "b0",
                "url": c.urls["b0"],
                "role": "both",
                "adapter": "sim",
                "kv_blocks": 4096,
                "kv_events": {
                    "endpoint": c.configs["b0"].kv_events_endpoint,
                    "replay_endpoint": c.configs["b0"].kv_events_replay_endpoint,
                },
            }
        ]
        raw = {
            "model": MODEL,
            "perf": {"model": MODEL, "gpu": "h100"},
            "store": {"url": REDIS_URL, "key_prefix": redis_prefix + "late:"},
            "workers": entries,
        }
        async with running_router(settings_from_mapping(raw)) as (_, late):
            hub = parts(late).pools.placement._kv

            async def learned() -> bool:
                sub = hub.subscribers.get("b0")
                return sub is not None and sub.index.router_hashes == await c.cache("b0")

            await until(learned, "the late router replayed the worker's history")
            assert hub.subscribers["b0"].state == "synced"


async def test_placement_sees_the_exact_cached_prefix_of_each_worker(redis_prefix: str) -> None:
    async with kv_cluster(redis_prefix, workers=2, plain=1) as c:
        conversation = _prompt(7, 8)
        await c.complete("b1", conversation)
        await c.wait_equal("b1")
        await c.wait_equal("b0")
        follow_up = conversation + _prompt(8, 2)  # the next turn extends the prompt
        view = c.parts.pools.placement.snapshot(prompt_token_ids=follow_up)
        cached = {d.worker_id: d.cached_prefix_tokens for d in view.decode}
        # b1 holds the 8 full blocks of the first turn (its partial block is not cached).
        assert cached == {"b0": 0, "b1": 8 * BS, "b2": None}
        assert c.parts.pools.placement.snapshot().decode[0].cached_prefix_tokens is None


async def test_a_shared_prefix_is_placed_on_its_holder(redis_prefix: str) -> None:
    """Through the router (two_sided): the second turn is prefilled where the first turn's
    blocks are, and the prefill views carry each prefill worker's exact cached prefix."""
    roles = {"p0": "prefill", "p1": "prefill", "d0": "decode"}
    async with kv_cluster(redis_prefix, roles=roles) as c:
        first = _prompt(9, 60)  # 960 tokens: a prefill worth skipping
        async with aiohttp.ClientSession() as s:
            async with s.post(
                c.router_url + "/v1/completions",
                json={"model": MODEL, "prompt": first, "max_tokens": 1},
            ) as r:
                assert r.status == 200, await r.text()
            holders = [w for w in ("p0", "p1") if len(await c.cache(w)) == 60]
            assert len(holders) == 1
            for w in roles:
                await c.wait_equal(w)
            second = first + _prompt(10, 4)
            view = c.parts.pools.placement.snapshot(prompt_token_ids=second)
            assert {p.worker_id: p.cached_prefix_tokens for p in view.prefill} == {
                w: (60 * BS if w in holders else 0) for w in ("p0", "p1")
            }
            for w in ("p0", "p1"):
                async with s.delete(c.urls[w] + "/sim/requests") as r:
                    assert r.status == 204
            async with s.post(
                c.router_url + "/v1/completions",
                json={"model": MODEL, "prompt": second, "max_tokens": 1},
            ) as r:
                assert r.status == 200, await r.text()
        got = {w: await c.sim(w, "/sim/requests") for w in ("p0", "p1")}
        prefilled_on = [w for w, reqs in got.items() if reqs]
        assert prefilled_on == holders, (got, holders)


# --- configuration ------------------------------------------------------------------------------


def test_a_worker_entry_names_its_kv_event_endpoints() -> None:
    spec = parse_worker(
        {
            "id": "p0",
            "url": "http://127.0.0.1:8000",
            "role": "prefill",
            "kv_events": {"endpoint": "tcp://127.0.0.1:5557", "replay_endpoint": None},
        },
        None,
        KVLayout(),
    )
    assert spec.kv_events == KvEventsSpec("tcp://127.0.0.1:5557", None, "")
    plain = parse_worker({"id": "p1", "url": "http://h:1", "role": "prefill"}, None, KVLayout())
    assert plain.kv_events is None


@pytest.mark.parametrize(
    "kv_events",
    [
        "tcp://127.0.0.1:5557",
        {"replay_endpoint": "tcp://127.0.0.1:5558"},
        {"endpoint": "http://127.0.0.1:5557"},
        {"endpoint": "tcp://127.0.0.1:5557", "topics": "kv"},
        {"endpoint": "tcp://127.0.0.1:5557", "topic": 3},
    ],
)
def test_a_wrong_kv_events_entry_says_where(kv_events: Any) -> None:
    raw = {"id": "p0", "url": "http://h:1", "role": "prefill", "kv_events": kv_events}
    with pytest.raises(ConfigError, match="kv_events"):
        parse_worker(raw, None, KVLayout())


def test_the_sim_worker_cli_takes_its_kv_event_endpoints() -> None:
    parser = argparse.ArgumentParser()
    add_worker_arguments(parser)
    ns = parser.parse_args(
        [
            "--kv-events-endpoint",
            "tcp://127.0.0.1:5557",
            "--kv-events-replay-endpoint",
            "tcp://127.0.0.1:5558",
        ]
    )
    cfg = config_from_args(ns)
    assert (cfg.kv_events_endpoint, cfg.kv_events_replay_endpoint) == (
        "tcp://127.0.0.1:5557",
        "tcp://127.0.0.1:5558",
    )


async def test_a_restart_is_seen_when_the_new_counter_is_already_past_ours(
    redis_prefix: str,
) -> None:
    """The new process publishes more batches before the subscriber reconnects than the old one
    ever did: the counter does not go back, the reconnection's replay tells the restart."""
    async with kv_cluster(redis_prefix) as c:
        await c.complete("b0", _prompt(20, 2))  # the old process: seq 0
        await c.wait_equal("b0")
        await c.restart("b0")
        for i in range(5):  # the new one: seq 0..4, most before the SUB is back
            await c.complete("b0", _prompt(60 + i, 1))

        async def afresh() -> bool:
            return c.counter("kv_events_index_drops", worker="b0", reason="restart") == 1

        await until(afresh, "the restart seen")
        await c.wait_equal("b0")
        assert len(c.index("b0")) == 5


def test_what_the_events_cost_the_loop() -> None:
    """Prints the cost of applying a stored block and of naming a prompt in blocks
    (docs/kv-events.md quotes it: pytest tests/router/workers/test_kv_events.py -k cost -s);
    asserts only
    that every block was indexed."""
    per_batch, batches = 64, 500
    payloads = [
        msgpack.packb(
            [
                0.0,
                [
                    {
                        "type": "BlockStored",
                        "block_hashes": [2**63 + b * per_batch + k for k in range(per_batch)],
                        "parent_block_hash": None,
                        "token_ids": [(b * 1000 + i) % 32_000 for i in range(per_batch * BS)],
                        "block_size": BS,
                        "lora_id": None,
                        "medium": "GPU",
                        "lora_name": None,
                    }
                ],
                0,
            ]
        )
        for b in range(batches)
    ]
    index = KvIndex()
    start = time.perf_counter()
    for payload in payloads:
        for event in decode_batch(payload).events:
            assert isinstance(event, BlockStored)
            index.store(event.block_hashes, event.parent_block_hash, event.token_ids, BS)
    per_block = (time.perf_counter() - start) / len(index)
    prompt = list(range(8192))
    start = time.perf_counter()
    for _ in range(50):
        block_hashes(prompt, BS)
    per_prompt = (time.perf_counter() - start) / 50
    print(
        f"\nstored: {per_block * 1e6:.2f} us/block (decode + hash + index); "
        f"a request: {per_prompt * 1e3:.2f} ms per 8k-token prompt named in blocks of {BS}"
    )
    assert len(index) == per_batch * batches
