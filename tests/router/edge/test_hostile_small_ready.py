"""/ready while the shared store is frozen (issue 31, item 6c): a Redis that takes the bytes
and never answers (SIGSTOP) fails no read until the client's socket timeout, so the state
refresher still said `store_ok` and /ready answered 200. Now /ready pings
(router/edge/ready_probe.py)
and answers 503 with a Retry-After, without hanging the probe; 200 again once it answers.

A private redis-server of this test's own on an ephemeral port (tests/redis_server.py), never
the shared one.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Awaitable, Callable
from pathlib import Path

import aiohttp

from tests.conftest import sim_cluster
from tests.redis_server import PrivateRedis

# How long a probe may take before it counts as hanging: far above the router's bound
# (READY_STORE_TIMEOUT_S), far below the Redis client's socket timeout (10 s), after which
# even the old code said 503.
PROBE_TIMEOUT_S = 8.0
WAIT_S = 60.0  # for conditions that must come "soon" on a loaded machine


def _state_of(pid: int) -> str:
    """The process's state letter (`T`: stopped), from /proc."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat.rsplit(")", 1)[1].split()[0]


async def _until(condition: Callable[[], Awaitable[bool]], what: str) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + WAIT_S
    while loop.time() < end:
        if await condition():
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"not within {WAIT_S} s: {what}")


async def test_ready_says_503_while_the_store_is_frozen_and_200_once_it_answers() -> None:
    with PrivateRedis() as redis:
        assert redis.proc is not None
        pid = redis.proc.pid
        async with (
            sim_cluster(redis_prefix="dr:", store={"url": redis.url}) as c,
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=PROBE_TIMEOUT_S)) as s,
        ):
            url = c.router_url + "/ready"

            async def status() -> int:
                async with s.get(url) as r:
                    return r.status

            async def ready() -> bool:
                return await status() == 200

            await _until(ready, "/ready says 200 with the store up")
            os.kill(pid, signal.SIGSTOP)
            try:

                async def stopped() -> bool:
                    return _state_of(pid) == "T"

                await _until(stopped, "redis-server stopped")

                # Three probes at once: each answers (none hangs past PROBE_TIMEOUT_S: the
                # client's timeout would raise), each says 503 with a Retry-After.
                async def probe() -> tuple[int, str | None, dict[str, object]]:
                    async with s.get(url) as r:
                        return r.status, r.headers.get("Retry-After"), await r.json()

                answers = await asyncio.gather(probe(), probe(), probe())
                for got, retry_after, body in answers:
                    assert got == 503, (got, body)
                    assert retry_after is not None and int(retry_after) >= 1, retry_after
                    assert body["store"] is False and body["status"] == "not_ready", body
                assert await status() == 503  # and the next one, with a ping still pending
            finally:
                os.kill(pid, signal.SIGCONT)
            await _until(ready, "/ready says 200 again once the store answers")
