"""The simulated worker's prefix cache and its KV events, on vLLM 0.32's wire format.

    prompt computed or pulled ─> SimPrefixCache.store(token ids) ─> one EventBatch:
        BlockStored(new blocks, parent = the engine hash of the block before them, token ids)
        BlockRemoved(blocks evicted, least recently used first, past the worker's KV capacity)
    POST /reset_prefix_cache ─> AllBlocksCleared (vLLM's endpoint of that name)

The publisher is vLLM's `ZmqEventPublisher` in shape (router/workers/kv_wire.py has the
format): PUB multipart (topic, 8-byte big-endian sequence number from 0, msgpack of
`[ts, [events], data_parallel_rank]`, events as tagged maps), and a ROUTER replay socket that
answers `[b"", start_seq]` with `[b"", topic, seq, payload]` for each buffered batch from
start_seq, then `[b"", b"", -1, b""]` (vLLM 0.32's `_service_replay`: the batch as the PUB sent
it, behind the envelope's delimiter). One difference: the sim binds the address it is given
(tcp://127.0.0.1:N binds loopback), where vLLM binds only a `*` address and connects to a
concrete one.

Engine block hashes are salted per process (as vLLM's are), so a subscriber that indexes them by
the router's own hash of the token ids proves it does not depend on them.

The cache is an LRU of full blocks sized by the worker's KV capacity, beside the block pool (the
pool models the KV of running requests; the cache, which prompts' blocks stay reusable). Which
token ids a prompt has: a completions prompt given as ids, those; any other prompt, the ids of
the text the model reads (chat rendered by the sim's template, `textgen.prompt_context`): with
`--tokenizer DIR`, `DIR/tokenizer.json`'s (encoded without special tokens), so a router counting
with the same directory (settings `tokenizers`) names the same blocks; without, the ids the sim's
/tokenize gives (crc32 of each 4-character piece), which no tokenizer reproduces. The prompt's
count in usage stays the sim's own (`textgen.count_prompt_tokens`) either way.

Its HTTP hooks (the test endpoints, vLLM's /reset_prefix_cache, the sockets' lifetime) are in
sim.kv_event_routes.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import struct
import time
import zlib
from collections import OrderedDict, deque
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import msgpack
import zmq
import zmq.asyncio
from tokenizers import Tokenizer

from policies.loras import lora_root
from policies.token_blocks import block_hashes

from . import textgen

__all__ = ["KvEventPublisher", "SimPrefixCache", "load_tokenizer", "prompt_token_ids"]

_END_SEQ = (-1).to_bytes(8, "big", signed=True)


def load_tokenizer(directory: str | Path) -> Tokenizer:
    """`--tokenizer DIR`: DIR's tokenizer.json (raises when there is none or it does not parse)."""
    return Tokenizer.from_file(str(Path(directory) / "tokenizer.json"))


def prompt_token_ids(
    path: str, body: Mapping[str, Any], tokenizer: Tokenizer | None = None
) -> list[int]:
    """The prompt's token ids as the sim's cache names them (see the module docstring)."""
    if path == textgen.COMPLETIONS_PATH:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], list):
            prompt = prompt[0]
        if isinstance(prompt, list) and all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt
        ):
            return list(prompt)
    text = textgen.prompt_context(path, body)
    if tokenizer is not None:
        return list(tokenizer.encode(text, add_special_tokens=False).ids)
    return [zlib.crc32(text[i : i + 4].encode()) % 32_000 for i in range(0, len(text), 4)]


class KvEventPublisher:
    """vLLM's PUB + ROUTER replay publisher, on asyncio sockets (one per worker)."""

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None = None,
        topic: str = "",
        buffer_steps: int = 10_000,
    ) -> None:
        self._endpoint = endpoint
        self._replay_endpoint = replay_endpoint
        self._topic = topic.encode()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._ctx = zmq.asyncio.Context()
        self._pub: zmq.asyncio.Socket | None = None
        self._replay: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task[None] | None = None
        self.seq = 0  # the next batch's sequence number
        self.rank = 0  # the data-parallel rank its batches name (sim.dp_front)
        self.drop_batches = 0  # test hook: the next N batches are not sent
        self.drop_from_replay = False  # ... nor kept for replay
        self.bound: dict[str, str | None] = {"endpoint": None, "replay_endpoint": None}

    def __repr__(self) -> str:
        return f"KvEventPublisher({self._endpoint}, seq={self.seq})"

    def start(self) -> None:
        pub = self._pub = self._ctx.socket(zmq.PUB)
        pub.setsockopt(zmq.LINGER, 0)
        pub.set_hwm(100_000)
        pub.bind(self._endpoint)
        self.bound["endpoint"] = pub.getsockopt_string(zmq.LAST_ENDPOINT)
        if self._replay_endpoint is not None:
            replay = self._replay = self._ctx.socket(zmq.ROUTER)
            replay.setsockopt(zmq.LINGER, 0)
            replay.bind(self._replay_endpoint)
            self.bound["replay_endpoint"] = replay.getsockopt_string(zmq.LAST_ENDPOINT)
            self._task = asyncio.get_running_loop().create_task(self._serve_replay())

    def publish(self, events: list[dict[str, Any]]) -> None:
        if self._pub is None or not events:
            return
        seq, self.seq = self.seq, self.seq + 1
        payload = msgpack.packb([time.time(), events, self.rank])
        if self.drop_batches > 0:
            self.drop_batches -= 1
            if not self.drop_from_replay:
                self._buffer.append((seq, payload))
            return
        self._buffer.append((seq, payload))
        # A PUB never blocks: past its high-water mark it drops, as vLLM's does.
        self._pub.send_multipart([self._topic, seq.to_bytes(8, "big"), payload], zmq.NOBLOCK)

    async def _serve_replay(self) -> None:
        assert self._replay is not None
        while True:
            frames = await self._replay.recv_multipart()
            if len(frames) != 3:
                continue  # vLLM logs and ignores a malformed request too
            client, _, start = frames
            first = int.from_bytes(start, "big")
            for seq, payload in list(self._buffer):
                if seq >= first:
                    frames = [client, b"", self._topic, seq.to_bytes(8, "big"), payload]
                    await self._replay.send_multipart(frames)
            await self._replay.send_multipart([client, b"", b"", _END_SEQ, b""])

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)
        self._ctx.term()


class SimPrefixCache:
    """An LRU of full blocks (engine hash -> router hash), publishing what it stores and evicts."""

    def __init__(
        self,
        capacity_blocks: int,
        block_size: int,
        publisher: KvEventPublisher,
        tokenizer: Tokenizer | None = None,
    ) -> None:
        self.capacity = capacity_blocks
        self.block_size = block_size
        self.publisher = publisher
        self.tokenizer = tokenizer  # --tokenizer: text prompts' ids (prompt_token_ids)
        self._seed = os.urandom(8)  # vLLM's per-process hash seed
        self._blocks: OrderedDict[int, int] = OrderedDict()
        self._lora: tuple[str, int] | None = None  # the adapter of the store being published

    def __repr__(self) -> str:
        return f"SimPrefixCache({len(self._blocks)}/{self.capacity} blocks)"

    def _engine_hash(self, parent: int, tokens: Sequence[int]) -> int:
        h = hashlib.blake2b(self._seed + parent.to_bytes(8, "little"), digest_size=8)
        h.update(struct.pack(f"<{len(tokens)}I", *tokens))
        return int.from_bytes(h.digest(), "little")  # unsigned, up to 2**64, like vLLM's ints

    def prompt_ids(self, path: str, body: Mapping[str, Any]) -> list[int]:
        """The request's prompt token ids, as this worker's cache names them."""
        return prompt_token_ids(path, body, self.tokenizer)

    def store(self, token_ids: Sequence[int], lora: tuple[str, int] | None = None) -> None:
        """The prompt's full blocks are cached (touched when already there); one batch. Under
        a LoRA adapter `lora` (name, id) the blocks are another adapter's than the base
        model's (vLLM folds the adapter into its block hashes) and its events say which."""
        bs = self.block_size
        full = len(token_ids) - len(token_ids) % bs
        routers = block_hashes(token_ids[:full], bs, lora_root(lora[0] if lora else None))
        self._lora = lora
        events: list[dict[str, Any]] = []
        run: list[int] = []
        run_start, run_parent = 0, None
        parent: int | None = None  # the engine hash of the block before the current one
        for i, router in enumerate(routers):
            first = parent if parent is not None else self._lora_seed(lora)
            engine = self._engine_hash(first, token_ids[i * bs : (i + 1) * bs])
            if engine in self._blocks:
                self._blocks.move_to_end(engine)
                if run:
                    events.append(self._stored(run, run_parent, token_ids, run_start))
                    run = []
            else:
                if not run:
                    run_start, run_parent = i, parent
                run.append(engine)
                self._blocks[engine] = router
            parent = engine
        if run:
            events.append(self._stored(run, run_parent, token_ids, run_start))
        evicted: list[int] = []
        while len(self._blocks) > self.capacity:
            evicted.append(self._blocks.popitem(last=False)[0])
        if evicted:
            events.append({"type": "BlockRemoved", "block_hashes": evicted, "medium": "GPU"})
        self.publisher.publish(events)

    def _stored(
        self, run: list[int], parent: int | None, token_ids: Sequence[int], start: int
    ) -> dict[str, Any]:
        bs = self.block_size
        return {
            "type": "BlockStored",
            "block_hashes": list(run),
            "parent_block_hash": parent,
            "token_ids": list(token_ids[start * bs : (start + len(run)) * bs]),
            "block_size": bs,
            "lora_id": self._lora[1] if self._lora else None,
            "medium": "GPU",
            "lora_name": self._lora[0] if self._lora else None,
        }

    @staticmethod
    def _lora_seed(lora: tuple[str, int] | None) -> int:
        """The engine's parent of a prompt's first block: 0, or one per adapter."""
        if lora is None:
            return 0
        return int.from_bytes(hashlib.blake2b(lora[0].encode(), digest_size=8).digest(), "little")

    def clear(self) -> None:
        self._blocks.clear()
        self.publisher.publish([{"type": "AllBlocksCleared"}])

    def router_hashes(self) -> list[int]:
        return sorted(set(self._blocks.values()))
