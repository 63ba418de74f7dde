"""vLLM's KV-event wire format, decoded (read off `vllm/distributed/kv_events.py`, vLLM 0.32).

The publisher (`ZmqEventPublisher`) sends each batch as a ZeroMQ PUB multipart message:

    frame 0  topic                 the configured topic, UTF-8 (empty by default)
    frame 1  sequence number       8 bytes, big-endian, unsigned; 0, 1, 2... per process
    frame 2  payload               msgpack of an EventBatch

    EventBatch (msgspec Struct, array_like): [ts: float, events: list, data_parallel_rank: int?]

Each event is a msgspec Struct tagged by its class name. vLLM 0.32 encodes events as tagged
*maps* (`{"type": "BlockStored", "block_hashes": ..., ...}`; array_like was dropped from
KVCacheEvent in vllm-project/vllm#42892); releases before it encoded tagged *arrays*
(`["BlockStored", block_hashes, ...]`, in field order). Both are read here:

    BlockStored      block_hashes: list[int | bytes], parent_block_hash: int | bytes | None,
                     token_ids: list[int], block_size: int, lora_id: int | None,
                     medium: str | None, lora_name: str | None, extra_keys (opt), group_idx (opt),
                     kv_cache_spec_kind (opt), kv_cache_spec_sliding_window (opt)
    BlockRemoved     block_hashes: list[int | bytes], medium: str | None, group_idx (opt)
    AllBlocksCleared (no fields)

`token_ids` holds the tokens of every block in `block_hashes`, block after block.

The replay socket (ROUTER, optional) serves missed batches: a DEALER sends
`[b"", start_seq (8 bytes big-endian)]`; the publisher answers `[b"", seq (8 bytes), payload]`
for every buffered batch with seq >= start_seq (its buffer keeps the last 10,000 batches by
default), then the end marker `[b"", (-1 as 8 signed big-endian bytes), b""]`.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack

__all__ = [
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "DecodedBatch",
    "END_SEQ",
    "KvEvent",
    "WireError",
    "decode_batch",
    "decode_seq",
    "encode_seq",
]

END_SEQ = -1  # the replay's end marker, as a signed 8-byte big-endian integer


class WireError(ValueError):
    """A message that is not vLLM's KV-event format."""


@dataclass(frozen=True, slots=True)
class BlockStored:
    block_hashes: Sequence[Hashable]
    parent_block_hash: Hashable | None
    token_ids: Sequence[int]
    block_size: int
    medium: str | None = None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: Sequence[Hashable]
    medium: str | None = None


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class DecodedBatch:
    ts: float
    events: tuple[KvEvent, ...]
    data_parallel_rank: int | None = None


def encode_seq(seq: int) -> bytes:
    return seq.to_bytes(8, "big", signed=True)


def decode_seq(frame: bytes) -> int:
    """A sequence frame: 8 bytes big-endian. The publisher's counter is unsigned from 0; the
    replay's end marker is -1, so a frame of all ones reads as -1."""
    if len(frame) != 8:
        raise WireError(f"a sequence number is 8 bytes, not {len(frame)}")
    return int.from_bytes(frame, "big", signed=True)


def _hashes(value: Any, what: str) -> list[Hashable]:
    if not isinstance(value, list) or not all(isinstance(h, int | bytes) for h in value):
        raise WireError(f"{what}: expected a list of block hashes")
    return value


_STORED_ORDER = (
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
)
_REMOVED_ORDER = ("block_hashes", "medium")


def _fields(raw: Any) -> tuple[str, dict[str, Any]]:
    """(type, fields by name) of a tagged map or a tagged array."""
    if isinstance(raw, dict):
        kind = raw.get("type")
        if not isinstance(kind, str):
            raise WireError("an event map without its 'type' tag")
        return kind, raw
    if isinstance(raw, list) and raw and isinstance(raw[0], str):
        kind = raw[0]
        order = _STORED_ORDER if kind == "BlockStored" else _REMOVED_ORDER
        return kind, dict(zip(order, raw[1:], strict=False))
    raise WireError(f"an event is a tagged map or array, not {type(raw).__name__}")


def _event(raw: Any) -> KvEvent:
    kind, f = _fields(raw)
    medium = f.get("medium")
    medium = medium if isinstance(medium, str) else None
    if kind == "BlockStored":
        tokens, size, parent = f.get("token_ids"), f.get("block_size"), f.get("parent_block_hash")
        if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
            raise WireError("BlockStored.token_ids: expected a list of ints")
        if not isinstance(size, int) or isinstance(size, bool) or size <= 0:
            raise WireError("BlockStored.block_size: expected a positive int")
        if parent is not None and not isinstance(parent, int | bytes):
            raise WireError("BlockStored.parent_block_hash: expected a hash or null")
        return BlockStored(_hashes(f.get("block_hashes"), kind), parent, tokens, size, medium)
    if kind == "BlockRemoved":
        return BlockRemoved(_hashes(f.get("block_hashes"), kind), medium)
    if kind == "AllBlocksCleared":
        return AllBlocksCleared()
    raise WireError(f"unknown event type {kind!r}")


def decode_batch(payload: bytes) -> DecodedBatch:
    """A batch's msgpack payload -> its events; WireError when it is not the format above."""
    try:
        raw = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except (ValueError, msgpack.UnpackException) as exc:
        raise WireError(f"not msgpack: {exc}") from exc
    if not isinstance(raw, list) or len(raw) < 2 or not isinstance(raw[1], list):
        raise WireError("an EventBatch is [ts, [events...], data_parallel_rank?]")
    ts = raw[0]
    if not isinstance(ts, int | float):
        raise WireError("EventBatch.ts: expected a number")
    rank = raw[2] if len(raw) > 2 and isinstance(raw[2], int) else None
    return DecodedBatch(float(ts), tuple(_event(e) for e in raw[1]), rank)
