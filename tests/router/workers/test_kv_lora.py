"""Prefix caches per LoRA adapter (issue 35; docs/lora.md): KV events carrying `lora_name` /
`lora_id` go to the adapter's own name space in the worker's index, so a prompt under adapter A
never counts a base-model or adapter-B prefix hit, while under A a prefix is still a prefix."""

from __future__ import annotations

import msgpack

from policies.loras import lora_prefixes, lora_root
from policies.token_blocks import ROOT_HASH, block_hashes
from router.workers.kv_index import KvIndex
from router.workers.kv_wire import BlockStored, decode_batch

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
