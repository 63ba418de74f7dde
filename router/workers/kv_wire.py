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

Two decoders, the same events out. `decode_batch` is msgpack's one call: fast (~10 ns an
element), but it holds the event loop for the whole payload (a 16 MiB, 300,000-block batch:
~180 ms, plus as long again to check it). `decode_batch_steps` reads the payload element by
element (~100 ns each) and yields every `STEP_ELEMENTS` of them, so its caller can let the loop
run between two steps; it also refuses a batch as soon as its block count passes `max_blocks`,
before building the lists (`BatchRefused`). Fields the index does not read are skipped, not
built. The subscriber takes the first for small payloads and the second for large ones.
"""

from __future__ import annotations

from collections.abc import Generator, Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack

__all__ = [
    "AllBlocksCleared",
    "BatchRefused",
    "BlockRemoved",
    "BlockStored",
    "DecodedBatch",
    "END_SEQ",
    "KvEvent",
    "WireError",
    "decode_batch",
    "decode_batch_steps",
    "decode_seq",
    "encode_seq",
]

END_SEQ = -1  # the replay's end marker, as a signed 8-byte big-endian integer


class WireError(ValueError):
    """A message that is not vLLM's KV-event format."""


class BatchRefused(Exception):
    """A batch in the format, but larger than any engine step can be: not applied. `reason`
    is the metric label (`kv_events_refused_total{reason}`)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True, slots=True)
class BlockStored:
    block_hashes: Sequence[Hashable]
    parent_block_hash: Hashable | None
    token_ids: Sequence[int]
    block_size: int
    medium: str | None = None
    # The LoRA adapter the blocks were computed under (docs/lora.md): its `lora_name`, else
    # "lora-id:<lora_id>" (an adapter the name of which the event does not give: its blocks
    # match nothing a request names), None for the base model. The index names them apart.
    lora: str | None = None


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


def _hashes(value: Any, what: str, checked: bool = False) -> list[Hashable]:
    if not isinstance(value, list) or not (
        checked or all(isinstance(h, int | bytes) for h in value)
    ):
        raise WireError(f"{what}: expected a list of block hashes")
    return value


_STORED_ORDER = (
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
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


def _lora_of(f: dict[str, Any]) -> str | None:
    name, lora_id = f.get("lora_name"), f.get("lora_id")
    if isinstance(name, str) and 0 < len(name) <= 256:
        return name
    if isinstance(lora_id, int) and not isinstance(lora_id, bool) and lora_id > 0:
        return f"lora-id:{lora_id}"
    return None


def _event(raw: Any, lists_checked: bool = False) -> KvEvent:
    kind, f = _fields(raw)
    medium = f.get("medium")
    medium = medium if isinstance(medium, str) else None
    if kind == "BlockStored":
        tokens, size, parent = f.get("token_ids"), f.get("block_size"), f.get("parent_block_hash")
        if not isinstance(tokens, list) or not (
            lists_checked or all(isinstance(t, int) for t in tokens)
        ):
            raise WireError("BlockStored.token_ids: expected a list of ints")
        if not isinstance(size, int) or isinstance(size, bool) or size <= 0:
            raise WireError("BlockStored.block_size: expected a positive int")
        if parent is not None and not isinstance(parent, int | bytes):
            raise WireError("BlockStored.parent_block_hash: expected a hash or null")
        hashes = _hashes(f.get("block_hashes"), kind, lists_checked)
        return BlockStored(hashes, parent, tokens, size, medium, _lora_of(f))
    if kind == "BlockRemoved":
        return BlockRemoved(_hashes(f.get("block_hashes"), kind, lists_checked), medium)
    if kind == "AllBlocksCleared":
        return AllBlocksCleared()
    raise WireError(f"unknown event type {kind!r}")


def _block_count(events: Sequence[KvEvent]) -> int:
    return sum(len(e.block_hashes) for e in events if not isinstance(e, AllBlocksCleared))


def _check_blocks(blocks: int, max_blocks: int | None) -> None:
    if max_blocks is not None and blocks > max_blocks:
        raise BatchRefused(
            "batch_blocks", f"a batch of more than {max_blocks} blocks (at least {blocks})"
        )


def decode_batch(payload: bytes, max_blocks: int | None = None) -> DecodedBatch:
    """A batch's msgpack payload -> its events; WireError when it is not the format above,
    BatchRefused when its events name more than `max_blocks` blocks (stored and removed)."""
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
    events = tuple(_event(e) for e in raw[1])
    _check_blocks(_block_count(events), max_blocks)
    return DecodedBatch(float(ts), events, rank)


# --- step by step ---------------------------------------------------------------------------

STEP_ELEMENTS = 4096  # list elements decoded between two yields (~0.4 ms here)
_LISTS = ("block_hashes", "token_ids")  # the only fields that grow with a batch's size
_READ = frozenset(
    ("type", "parent_block_hash", "block_size", "medium", "lora_id", "lora_name") + _LISTS
)


class _Reader:
    """An Unpacker over one payload, with a look at the next value's type byte."""

    __slots__ = ("payload", "unpacker", "blocks", "max_blocks")

    def __init__(self, payload: bytes, max_blocks: int | None) -> None:
        self.payload: bytes = payload
        self.unpacker = msgpack.Unpacker(
            raw=False, strict_map_key=False, max_buffer_size=max(1, len(payload))
        )
        self.unpacker.feed(payload)
        self.blocks = 0
        self.max_blocks = max_blocks

    def _next_byte(self) -> int:
        at = int(self.unpacker.tell())
        if at >= len(self.payload):
            raise WireError("not msgpack: the payload ends inside a value")
        return self.payload[at]

    def at_array(self) -> bool:
        b = self._next_byte()
        return 0x90 <= b <= 0x9F or b in (0xDC, 0xDD)

    def at_map(self) -> bool:
        b = self._next_byte()
        return 0x80 <= b <= 0x8F or b in (0xDE, 0xDF)

    def list_steps(self, field: str) -> Generator[None, None, list[Any]]:
        """One of `_LISTS`, its elements checked as they come."""
        n = self.unpacker.read_array_header()
        if field == "block_hashes":
            self.blocks += n
            _check_blocks(self.blocks, self.max_blocks)  # before a single element is built
            kinds: type | tuple[type, ...] = (int, bytes)
        else:
            kinds = int
        unpack = self.unpacker.unpack
        out: list[Any] = []
        for i in range(n):
            value = unpack()
            if not isinstance(value, kinds):
                what = "block hashes" if field == "block_hashes" else "ints"
                raise WireError(f"{field}: expected a list of {what}")
            out.append(value)
            if i % STEP_ELEMENTS == STEP_ELEMENTS - 1:
                yield
        return out

    def event_steps(self) -> Generator[None, None, KvEvent]:
        u = self.unpacker
        if self.at_map():
            fields: dict[Any, Any] = {}
            for _ in range(u.read_map_header()):
                key = u.unpack()
                if key in _LISTS and self.at_array():
                    fields[key] = yield from self.list_steps(key)
                elif key in _READ:
                    fields[key] = u.unpack()
                else:
                    u.skip()  # extra_keys, group_idx...: not read, so not built
            return _event(fields, lists_checked=True)
        if self.at_array():
            n = u.read_array_header()
            kind = u.unpack() if n else None
            order = _STORED_ORDER if kind == "BlockStored" else _REMOVED_ORDER
            values: list[Any] = [kind]
            for i in range(n - 1):
                field = order[i] if i < len(order) else ""
                if field in _LISTS and self.at_array():
                    values.append((yield from self.list_steps(field)))
                else:
                    values.append(u.unpack())
            return _event(values, lists_checked=True)
        u.skip()
        raise WireError("an event is a tagged map or array")


def decode_batch_steps(
    payload: bytes, max_blocks: int | None = None
) -> Generator[None, None, DecodedBatch]:
    """`decode_batch`, yielding every `STEP_ELEMENTS` list elements; the batch is the
    generator's return value. Same events, same errors (WireError, BatchRefused)."""
    r = _Reader(payload, max_blocks)
    u = r.unpacker
    try:
        n = u.read_array_header() if r.at_array() else 0
        if n < 2:
            raise WireError("an EventBatch is [ts, [events...], data_parallel_rank?]")
        ts = u.unpack()
        if not r.at_array():
            raise WireError("an EventBatch is [ts, [events...], data_parallel_rank?]")
        events = []
        for _ in range(u.read_array_header()):
            events.append((yield from r.event_steps()))
        rank = u.unpack() if n > 2 else None
        for _ in range(n - 3):
            u.skip()
        if u.tell() != len(payload):
            raise WireError("not msgpack: bytes after the batch")
    except (ValueError, msgpack.UnpackException) as exc:
        if isinstance(exc, WireError):
            raise
        raise WireError(f"not msgpack: {exc}") from exc
    if not isinstance(ts, int | float):
        raise WireError("EventBatch.ts: expected a number")
    rank = rank if isinstance(rank, int) else None
    return DecodedBatch(float(ts), tuple(events), rank)
