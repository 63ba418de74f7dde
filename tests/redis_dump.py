"""A key prefix of a real Redis as tests use it: every key under it and every value, read by its
type (what a test searches for a secret: tests/router/edge/test_tenant_secrets.py,
tests/router/edge/test_tenant_keys_shared.py), and every key under it deleted (a test's cleanup, or
a store
that lost its data)."""

from __future__ import annotations

from typing import Any

import redis.asyncio as aioredis


async def redis_dump(url: str, prefix: str, types: set[str] | None = None) -> list[bytes]:
    """Every key under `prefix` and every value, as bytes; the types seen are added to `types`.
    An unknown type fails: a value that is not read cannot be searched."""
    client: Any = aioredis.from_url(url)  # redis-py's answers: bytes, typed loosely
    out: list[Any] = []
    try:
        async for key in client.scan_iter(match=prefix + "*", count=1000):
            out.append(key)
            kind = (await client.type(key)).decode()
            if types is not None:
                types.add(kind)
            if kind == "string":
                out.append(await client.get(key) or b"")
            elif kind == "hash":
                for f, v in (await client.hgetall(key)).items():
                    out += [f, v]
            elif kind == "set":
                out += list(await client.smembers(key))
            elif kind == "zset":
                out += [m for m, _ in await client.zrange(key, 0, -1, withscores=True)]
            elif kind == "list":
                out += list(await client.lrange(key, 0, -1))
            elif kind == "stream":
                for entry_id, fields in await client.xrange(key):
                    out.append(entry_id)
                    for f, v in fields.items():
                        out += [f, v]
            elif kind != "none":  # "none": expired between SCAN and TYPE
                raise AssertionError(f"a Redis value of type {kind} at {key!r}: not read")
    finally:
        await client.aclose()
    return [x if isinstance(x, bytes) else str(x).encode() for x in out]


async def delete_prefix(url: str, prefix: str) -> None:
    """Delete every key under `prefix`."""
    client = aioredis.from_url(url)
    try:
        keys = [k async for k in client.scan_iter(match=prefix + "*", count=1000)]
        if keys:
            await client.delete(*keys)
    finally:
        await client.aclose()
