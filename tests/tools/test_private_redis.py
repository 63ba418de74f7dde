"""`--private-redis` (disagg_tools/overhead/private_redis.py): the benchmark's own Redis is
started, answers at the URL the targets are given, holds nothing on disk, and is gone when the
run ends, also when the run fails."""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import pytest
import redis.asyncio as aioredis
import redis.exceptions

from disagg_tools.overhead.private_redis import redis_for_run

pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None, reason="no redis-server")

SHARED = "redis://127.0.0.1:6379/0"


def _ns(private: bool) -> argparse.Namespace:
    return argparse.Namespace(
        private_redis=private, redis_url=SHARED, load_core_=None, nice=0, rt_priority=0
    )


async def _pings(url: str) -> bool:
    client = aioredis.from_url(url, socket_connect_timeout=1.0)
    try:
        return bool(await client.ping())
    except (OSError, redis.exceptions.ConnectionError):
        return False
    finally:
        await client.aclose()


async def test_a_private_redis_serves_the_run_and_stops_with_it(tmp_path: Path) -> None:
    ns = _ns(private=True)
    async with redis_for_run(ns, tmp_path):
        url = ns.redis_url
        assert url != SHARED and url.startswith("redis://127.0.0.1:")
        assert await _pings(url)
        client = aioredis.from_url(url)
        try:
            config = await client.config_get("save")
            assert config["save"] == ""  # no snapshot forks inside a measurement
            assert (await client.config_get("appendonly"))["appendonly"] == "no"
        finally:
            await client.aclose()
    assert not await _pings(url)


async def test_it_stops_when_the_run_fails(tmp_path: Path) -> None:
    ns = _ns(private=True)
    with pytest.raises(RuntimeError, match="the run failed"):
        async with redis_for_run(ns, tmp_path):
            url = ns.redis_url
            raise RuntimeError("the run failed")
    assert not await _pings(url)


async def test_without_the_flag_the_given_url_is_kept(tmp_path: Path) -> None:
    ns = _ns(private=False)
    async with redis_for_run(ns, tmp_path):
        assert ns.redis_url == SHARED
    assert not (tmp_path / "redis-private.log").exists()  # nothing was started
