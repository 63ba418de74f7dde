"""Issue 22, "KV events", on a real vLLM engine: one engine with prefix caching and a ZeroMQ
`--kv-events-config` (../shared/docs/design.md §9), the router's own subscriber
(router/workers/kv_events.py) on its publisher. After a run, the router's index of the engine
holds exactly the full blocks of the prompts it served, named by the router's chained hash of
their token ids (policies/token_blocks.py, not the engine's seeded hash); and a prompt that
shares a block with an earlier one is a prefix-cache hit by vLLM's own counter, of exactly the
shared block.

The engine runs without a KV connector (the events are the engine's, not the connector's): a
fourth engine of its own, for this module only, so that the package's three-engine cluster
keeps prefix caching off (its tests count every prompt token as moved).
"""

from __future__ import annotations

import asyncio
import json
import shutil
import tempfile
import time
import urllib.request
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import pytest
import zmq
import zmq.asyncio

from policies.token_blocks import block_hashes
from router.metrics import RouterMetrics
from router.workers.kv_events import KvEventSubscriber
from router.workers.worker_spec import KvEventsSpec
from tests.conftest import free_port
from tests.real_vllm.conftest import (
    BLOCK_SIZE,
    SERVED,
    START_TIMEOUT_S,
    VllmServer,
    missing_reason,
)

pytestmark = pytest.mark.real_vllm


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
            "topic": "kv",
        }
        return [
            *super().command(),
            "--enable-prefix-caching",
            "--kv-events-config",
            json.dumps(config),
        ]


@pytest.fixture(scope="module")
def events_engine() -> Iterator[EventsServer]:
    reason = missing_reason()
    if reason is not None:
        pytest.skip(reason)
    workdir = Path(tempfile.mkdtemp(prefix="real-vllm-events-"))
    server = EventsServer("e0", None, workdir)
    try:
        server.start()
        server.wait_ready(time.monotonic() + START_TIMEOUT_S)
        yield server
    finally:
        server.stop()
        shutil.rmtree(workdir, ignore_errors=True)


@pytest.fixture
async def subscriber(events_engine: EventsServer) -> AsyncIterator[KvEventSubscriber]:
    spec = KvEventsSpec(
        f"tcp://127.0.0.1:{events_engine.pub_port}",
        f"tcp://127.0.0.1:{events_engine.replay_port}",
        topic="kv",
    )
    ctx = zmq.asyncio.Context()
    sub = KvEventSubscriber("e0", spec, ctx, RouterMetrics())
    task = asyncio.create_task(sub.run())
    try:
        yield sub
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        ctx.term()


def _prefix_cache_hits(url: str) -> float:
    """vLLM's prefix-cache hits counter (tokens), summed over its labels."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith("vllm:prefix_cache_hits") and not line.startswith("#"):
            name = line.split("{")[0].split(" ")[0]
            if name.endswith("_created"):
                continue
            total += float(line.rsplit(" ", 1)[1])
    return total


async def _complete(session: aiohttp.ClientSession, url: str, prompt: list[int]) -> None:
    body = {"model": SERVED, "prompt": prompt, "max_tokens": 1, "temperature": 0}
    async with session.post(url + "/v1/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()


async def test_the_index_holds_exactly_the_engines_blocks_and_a_shared_block_is_a_hit(
    events_engine: EventsServer, subscriber: KvEventSubscriber
) -> None:
    # Token-id prompts: the blocks' tokens are known exactly. 2 full blocks and a partial one
    # each (plus one generated token: still 2 full blocks); b shares a's first block only.
    a = [10 + (i * 7) % 900 for i in range(2 * BLOCK_SIZE + 5)]
    b = a[:BLOCK_SIZE] + [1000 + (i * 11) % 900 for i in range(BLOCK_SIZE + 5)]
    expected = set(block_hashes(a, BLOCK_SIZE)) | set(block_hashes(b, BLOCK_SIZE))
    assert len(expected) == 3

    url = events_engine.url
    async with aiohttp.ClientSession() as session:
        await _complete(session, url, a)
        hits_before = _prefix_cache_hits(url)
        await _complete(session, url, b)
        hits_after = _prefix_cache_hits(url)

        # The events reach the index asynchronously: wait for the engine's batches, bounded.
        for _ in range(200):
            if subscriber.index.router_hashes >= expected:
                break
            await asyncio.sleep(0.05)
    assert subscriber.index.router_hashes == expected, subscriber.describe()
    assert subscriber.index.block_size == BLOCK_SIZE
    # b's first block was a's: vLLM served it from its prefix cache, and only it.
    assert hits_after - hits_before == BLOCK_SIZE
