"""Prefix caches per LoRA adapter (issue 35; docs/lora.md): KV events carrying `lora_name` /
`lora_id` go to the adapter's own name space in the worker's index, so a prompt under adapter A
never counts a base-model or adapter-B prefix hit, while under A a prefix is still a prefix."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import aiohttp
import msgpack

from disagg_tools.sim.lora import LoraConfig
from policies.loras import lora_prefixes, lora_root
from policies.token_blocks import ROOT_HASH, block_hashes
from router.workers.kv_index import KvIndex
from router.workers.kv_wire import BlockStored, decode_batch
from tests.conftest import sim_cluster
from tests.ports import free_port

BS = 4
TOKENS = list(range(100, 116))  # 4 blocks of 4


def _stored(**fields: object) -> dict[str, object]:
    base: dict[str, object] = {
        "type": "BlockStored",
        "block_hashes": [1, 2],
        "parent_block_hash": None,
        "token_ids": list(range(8)),
        "block_size": BS,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
    }
    return base | fields


def test_events_say_their_adapter_in_both_wire_shapes() -> None:
    batch = decode_batch(
        msgpack.packb(
            [
                1.0,
                [
                    _stored(lora_id=3, lora_name="sql"),
                    _stored(lora_id=4),  # an adapter whose name the event does not give
                    _stored(),
                    ["BlockStored", [1, 2], None, list(range(8)), BS, 5, "GPU", "chat-fr"],
                    ["BlockStored", [1, 2], None, list(range(8)), BS, None, None],
                ],
            ]
        )
    )
    assert [e.lora for e in batch.events if isinstance(e, BlockStored)] == [
        "sql",
        "lora-id:4",
        None,
        "chat-fr",
        None,
    ]


def _cached(index: KvIndex, adapter: str | None) -> int:
    return index.cached_prefix_blocks(block_hashes(TOKENS, BS, lora_root(adapter)))


def test_an_adapter_prompt_counts_only_its_own_adapter_s_blocks() -> None:
    index = KvIndex()
    # The same tokens cached under adapter A only (the engine's own hashes differ per adapter).
    index.store([11, 12, 13, 14], None, TOKENS, BS, lora="A")
    assert _cached(index, "A") == 4
    assert _cached(index, None) == 0  # the base model's prompt: no hit
    assert _cached(index, "B") == 0  # another adapter's: no hit
    # A child block chains from its parent, inside A's space.
    index.store([15], 14, list(range(200, 204)), BS)
    longer = TOKENS + list(range(200, 204))
    assert index.cached_prefix_blocks(block_hashes(longer, BS, lora_root("A"))) == 5
    # Now the base model caches the first two blocks: its prompt hits 2, A's still 4.
    index.store([21, 22], None, TOKENS[:8], BS)
    assert _cached(index, None) == 2 and _cached(index, "A") == 4
    index.remove([11])
    assert _cached(index, "A") == 0 and _cached(index, None) == 2


def test_roots_and_estimated_prefixes_are_apart_per_adapter() -> None:
    assert lora_root(None) == lora_root("") == ROOT_HASH
    assert len({lora_root(None), lora_root("A"), lora_root("B")}) == 3
    hashes = (1, 2, 3)
    assert lora_prefixes(hashes, None) == hashes
    a, b = lora_prefixes(hashes, "A"), lora_prefixes(hashes, "B")
    assert not set(a) & set(hashes) and not set(a) & set(b)
    assert lora_prefixes(hashes[:2], "A") == a[:2]  # a shared prefix stays shared under A


async def _until(cond: Callable[[], bool], what: str, deadline_s: float = 20.0) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + deadline_s
    while not cond():
        if loop.time() > end:
            raise AssertionError(f"not within {deadline_s} s: {what}")
        await asyncio.sleep(0.02)


async def test_live_a_prompt_cached_under_an_adapter_is_no_base_model_hit() -> None:
    """A simulated worker publishing vLLM's KV events (with lora_name) behind a live router: a
    prompt run under `sql` is an exact hit for `sql` and none for the base model or `fr`."""
    lora = LoraConfig(enabled=True, max_loras=4, modules=(("sql", "/l/sql"), ("fr", "/l/fr")))
    events = f"tcp://127.0.0.1:{free_port()}"
    sim_bs = 16
    async with sim_cluster(
        prefill=0,
        decode=0,
        both=1,
        redis_prefix=None,
        worker_overrides={"b0": {"lora": lora, "kv_events_endpoint": events}},
        entry_overrides={"b0": {"max_loras": 4, "kv_events": {"endpoint": events}}},
    ) as c:
        prompt = [(7919 + i * 31) % 32_000 for i in range(8 * sim_bs + 3)]
        async with aiohttp.ClientSession() as s:
            body = {"model": "sql", "prompt": prompt, "max_tokens": 1}
            async with s.post(c.router_url + "/v1/completions", json=body) as r:
                assert r.status == 200, await r.text()
        placement = c.parts.pools.placement

        def cached(lora_name: str) -> int | None:
            view = placement.snapshot(prompt_token_ids=prompt, lora=lora_name)
            return view.decode[0].cached_prefix_tokens

        await _until(lambda: cached("sql") == 8 * sim_bs, "the index holds the sql blocks")
        assert cached("") == 0 and cached("fr") == 0
