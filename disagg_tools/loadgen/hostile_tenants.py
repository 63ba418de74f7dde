"""What issue 31's hostile-tenant scenarios share: tenants with keys, their requests, the
store's view of a tenant's hold, the admin calls, and the end-of-run checks.

    tenant_cluster   the issue's setting: a HostileCluster with requirepass on its private
                     Redis and `tenants` (each with its key) in every replica's config
    keyed            a LoadRequest sent with a tenant's key (Authorization: Bearer)
    send_wide        one non-streaming request with `n` choices, every choice checked against
                     the simulated worker's deterministic answer (textgen.expected_choice)
    settle           after the traffic: wait (bounded) until the store holds no reservation
                     on any decode worker and no tenant hold; what is left
    admin_post / worker_views   the admin API (drain, undrain) and each replica's view of a worker
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, replace
from typing import Any

import aiohttp
import orjson
import redis.asyncio as aioredis

from disagg_tools.loadgen.hostile_cluster import (
    ADMIN_TOKEN,
    MODEL,
    ClusterShape,
    HostileCluster,
)
from disagg_tools.loadgen.loadclient import ORACLE_HEADER, LoadRequest
from disagg_tools.sim.textgen import expected_choice

__all__ = [
    "WideResult",
    "admin_post",
    "hsum_key",
    "keyed",
    "send_wide",
    "settle",
    "tenant_cluster",
    "tenant_key",
    "worker_views",
]


def tenant_key(name: str) -> str:
    """A fixed, recognisable key per tenant (the cluster is private and short-lived)."""
    return f"sk-hostile-{name}-{sum(map(ord, name)) * 7919:012d}"


def tenant_cluster(
    workers: tuple[tuple[str, str], ...],
    tenants: list[dict[str, Any]],
    *,
    decode_blocks: int,
    time_scale: float,
    log_level: str,
    router: dict[str, Any] | None = None,
) -> ClusterShape:
    """Two replicas on a password-protected private Redis, `tenants` (each given its key)."""
    with_keys = [{**t, "keys": [tenant_key(t["name"])]} for t in tenants]
    return ClusterShape(
        workers=workers,
        decode_blocks=decode_blocks,
        time_scale=time_scale,
        log_level=log_level,
        redis_password=True,
        router={"tenants": with_keys, **(router or {})},
    )


def keyed(req: LoadRequest, tenant: str) -> LoadRequest:
    return replace(req, headers={**req.headers, "Authorization": f"Bearer {tenant_key(tenant)}"})


def hsum_key(prefix: str, tenant: str) -> str:
    return f"{prefix}{{t:{tenant}}}:hsum"  # state/keys.py, Keys.tenant_quota(tenant)[3]


@dataclass(slots=True)
class WideResult:
    status: int | None = None
    choices: int = 0
    exact: int = 0  # choices whose text and finish reason are the worker's exactly
    detail: str = ""
    seconds: float = 0.0


async def send_wide(
    session: aiohttp.ClientSession,
    url: str,
    tenant: str,
    content: str,
    *,
    n: int,
    output_tokens: int,
    max_tokens: int,
    deadline_s: float,
) -> WideResult:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "n": n,
    }
    headers = {
        ORACLE_HEADER: str(output_tokens),
        "Authorization": f"Bearer {tenant_key(tenant)}",
        "Content-Type": "application/json",
    }
    res = WideResult()
    t0 = time.perf_counter()
    try:
        async with asyncio.timeout(deadline_s):
            async with session.post(
                url + "/v1/chat/completions", data=orjson.dumps(body), headers=headers
            ) as resp:
                res.status = resp.status
                raw = await resp.read()
    except (aiohttp.ClientError, OSError, TimeoutError) as exc:
        res.detail = f"{type(exc).__name__}: {exc}"
        return res
    finally:
        res.seconds = time.perf_counter() - t0
    if res.status != 200:
        res.detail = raw[:200].decode("utf-8", "replace")
        return res
    try:
        choices = orjson.loads(raw)["choices"]
    except (orjson.JSONDecodeError, KeyError, TypeError) as exc:
        res.detail = f"not an OpenAI answer ({exc!r})"
        return res
    res.choices = len(choices)
    for ch in choices:
        want, _, finish = expected_choice(
            "/v1/chat/completions", body, int(ch["index"]), {ORACLE_HEADER: str(output_tokens)}
        )
        if ch["message"]["content"] == want and ch.get("finish_reason") == finish:
            res.exact += 1
        elif not res.detail:
            res.detail = f"choice {ch['index']}: {len(ch['message']['content'])} chars, {finish!r}"
    return res


async def settle(
    cluster: HostileCluster, tenants: list[str], timeout_s: float = 30.0
) -> dict[str, Any]:
    """Wait until no decode worker has a reservation and no tenant a hold in the store (the
    releases of the last streams land a moment after their clients saw the end); what is left
    when that happens, or at the timeout."""
    client = aioredis.from_url(cluster.redis_url)
    prefix = cluster.key_prefix
    workers = cluster.shape.decode_ids
    left: dict[str, Any] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            pipe = client.pipeline(transaction=False)
            for wid in workers:
                pipe.get(f"{prefix}{{d:{wid}}}:sum")
                pipe.hlen(f"{prefix}{{d:{wid}}}:res")
            for t in tenants:
                pipe.get(hsum_key(prefix, t))
            answers = await pipe.execute()
            left = {
                "reserved": {w: int(answers[2 * i] or 0) for i, w in enumerate(workers)},
                "reservations": {w: int(answers[2 * i + 1]) for i, w in enumerate(workers)},
                "holds": {
                    t: int(answers[2 * len(workers) + i] or 0) for i, t in enumerate(tenants)
                },
            }
            empty = not any(v for part in left.values() for v in part.values())
            if empty or time.monotonic() > deadline:
                left["empty"] = empty
                return left
            await asyncio.sleep(0.2)
    finally:
        await client.aclose()


_AUTH = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


async def admin_post(
    session: aiohttp.ClientSession, router_url: str, path: str, body: dict[str, Any] | None = None
) -> tuple[int, Any]:
    async with session.post(
        router_url + path, json=body, headers=_AUTH, timeout=aiohttp.ClientTimeout(total=10)
    ) as resp:
        return resp.status, await resp.json(content_type=None)


async def worker_views(
    session: aiohttp.ClientSession, cluster: HostileCluster, wid: str
) -> list[dict[str, Any]]:
    """Each replica's description of worker `wid` (GET /admin/workers)."""
    views: list[dict[str, Any]] = []
    for url in cluster.router_urls:
        async with session.get(
            url + "/admin/workers", headers=_AUTH, timeout=aiohttp.ClientTimeout(total=10)
        ) as resp:
            body = await resp.json(content_type=None)
        workers = body.get("workers", body) if isinstance(body, dict) else body
        views.append(next((w for w in workers if w.get("id") == wid), {}))
    return views
