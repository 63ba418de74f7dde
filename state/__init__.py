"""disagg-router: state shared by router replicas (docs/design.md §5).

`open_store(url)` picks the implementation: no URL means the in-process `MemoryStore`, a
``redis://``, ``rediss://`` or ``unix://`` URL a `RedisStore` on one server, a
``redis+cluster://host:port[,host:port...]`` (or ``rediss+cluster://``) URL a `RedisStore` on a
Redis Cluster (checked with a ping).
"""

from __future__ import annotations

from state.base import (
    DecodeUsage,
    DrainMark,
    Finished,
    RetryBudgetPolicy,
    StateStore,
    StoreBusy,
    StoreError,
    StrandedEntry,
    WorkerRole,
)
from state.keys import DEFAULT_PREFIX, Keys
from state.memory_store import MemoryStore
from state.redis_conn import (
    CLUSTER_SCHEMES,
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_POOL_TIMEOUT_S,
    StoreUnavailableError,
    redact_url,
)
from state.redis_store import RedisStore

__all__ = [
    "DecodeUsage",
    "DrainMark",
    "Finished",
    "Keys",
    "MemoryStore",
    "RedisStore",
    "RetryBudgetPolicy",
    "StateStore",
    "StoreBusy",
    "StoreError",
    "StoreUnavailableError",
    "StrandedEntry",
    "WorkerRole",
    "open_store",
    "redact_url",
]

_REDIS_SCHEMES = ("redis://", "rediss://", "unix://", *CLUSTER_SCHEMES)


async def open_store(
    url: str | None,
    prefix: str = DEFAULT_PREFIX,
    *,
    max_connections: int = DEFAULT_MAX_CONNECTIONS,
    pool_timeout_s: float = DEFAULT_POOL_TIMEOUT_S,
) -> StateStore:
    """The store for `url`: `MemoryStore` when it is None or empty, else a pinged `RedisStore`
    (on a cluster: `max_connections` per node).

    Raises `StoreUnavailableError` (naming the URL, password hidden) when Redis does not answer,
    and `ValueError` for a URL of another scheme.
    """
    if not url:
        return MemoryStore()
    if not url.startswith(_REDIS_SCHEMES):
        schemes = ", ".join(_REDIS_SCHEMES)
        raise ValueError(f"state store URL must start with one of {schemes}: {redact_url(url)}")
    store = RedisStore.from_url(
        url, prefix, max_connections=max_connections, pool_timeout_s=pool_timeout_s
    )
    try:
        await store.ensure_reachable()
    except StoreUnavailableError:
        await store.close()
        raise
    return store
