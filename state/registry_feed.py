"""The registry's change feed: what a quiet replica waits on instead of reading the registry.

Every store call that changes what the registry sync reads — a registration added, changed or
removed, a drain mark, a `both` worker's role, the tenant keys, the store-loss marker
re-created — also appends to the feed, in the same script (state/registry_scripts.py,
`LUA_FEED`). A quiet replica blocks on the feed (`RegistryFeed.wait`) and reads the registry
when it moves, so while nothing changes it makes no store call and has no timer: the wait is
Redis's (``XREAD BLOCK``), on a connection of its own, never the shared one.

A wait also ends, saying "read now", when its connection breaks: a Redis that died or restarted
empty closes it, and the registry sync then runs the store-loss path at once
(router/workers/store_loss.py). What no event shows (a ``FLUSHALL`` on a Redis that keeps
running: the feed is gone with the rest, nobody writes it) is left to the wait's bound, which
the caller keeps short of the marker's TTL.

Order: `start` takes the feed's newest entry before the registry read it precedes, and each
wait continues from the newest entry it has seen, so a change that lands between a read and
the next wait ends that wait at once: none is missed, at worst one is read twice.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import redis.asyncio as aioredis

from state.base import StoreError
from state.redis_conn import FAILURES as _FAILURES

__all__ = ["FeedCounter", "MemoryRegistryFeed", "RedisRegistryFeed"]


class RedisRegistryFeed:
    """The feed on Redis: ``XREAD BLOCK`` on a connection of its own (`connect` makes it;
    one server, or the cluster node that holds the feed's slot)."""

    def __init__(self, connect: Callable[[], Awaitable[aioredis.Redis]], key: str) -> None:
        self._connect = connect
        self._key = key
        self._client: aioredis.Redis | None = None
        self._last: Any = None  # the newest entry id seen (None: not started)

    def __repr__(self) -> str:
        return f"RedisRegistryFeed({self._key}, after {self._last!r})"

    @property
    def listening(self) -> bool:
        return self._client is not None

    async def start(self) -> None:
        await self._drop()
        try:
            client = self._client = await self._connect()
        except _FAILURES as exc:
            raise StoreError(f"the registry feed cannot start: {type(exc).__name__}") from exc
        try:
            newest = await client.xrevrange(self._key, "+", "-", count=1)
        except _FAILURES as exc:
            self._forget(client)
            raise StoreError(f"the registry feed cannot start: {type(exc).__name__}") from exc
        finally:
            await self._closed_under(client)
        # No feed yet (a new or emptied store): its first entry, whatever its id, is new.
        self._last = newest[0][0] if newest else "0-0"

    async def wait(self, timeout_s: float) -> bool:
        client = self._client
        if client is None:
            await self.start()
            return True  # what changed while it was not listening is unknown: read
        block_ms = max(1, int(timeout_s * 1000))
        try:
            answer = await client.xread({self._key: self._last}, block=block_ms)
        except _FAILURES:
            # Redis closed it (died, restarted, failed over) or stopped answering: read now,
            # the store-loss path decides; the next wait starts again (the client is closed
            # just below, no longer the feed's).
            self._forget(client)
            return True
        finally:
            await self._closed_under(client)
        if not answer:
            return False
        self._last = _newest_id(answer)
        return True

    def _forget(self, client: aioredis.Redis) -> None:
        """`client` failed: no longer the feed's (`_closed_under` closes it)."""
        if self._client is client:
            self._client = None

    async def _closed_under(self, client: aioredis.Redis) -> None:
        """After every call on `client`: close it when it is no longer the feed's — it failed,
        or another task closed the feed or started it again meanwhile. Such a close
        disconnected the connection under the call, and redis-py connects a disconnected
        connection again for the call's next command (its handshake is several: HELLO, AUTH,
        SELECT, ...): that socket belongs to no one the feed knows, and is closed here, or the
        garbage collector finds it open (seen in the state machine: a replica shut down while
        its feed was connecting). Closing a closed client again is harmless."""
        if self._client is not client:
            await _close(client)

    async def _drop(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            await _close(client)

    async def close(self) -> None:
        await self._drop()


async def _close(client: aioredis.Redis) -> None:
    """Close `client` to its end. Shielded: shutdown cancels the registry loop again and again
    until it ends (router/background.py), and a cancel inside the close would leave the feed's
    socket open for the garbage collector ("unclosed transport"). The close runs to its end on
    its own; the cancel still reaches the caller."""
    closing = asyncio.ensure_future(client.aclose())
    closing.add_done_callback(_retrieved)
    await asyncio.shield(closing)


def _retrieved(closing: asyncio.Future[None]) -> None:
    """A close nobody awaits any more (its caller was cancelled): its failure, if any, is
    retrieved here rather than reported as "never retrieved" (the socket is gone either way)."""
    if not closing.cancelled():
        closing.exception()


def _newest_id(answer: Any) -> Any:
    """The last entry's id in an ``XREAD`` answer of one stream: ``[[key, entries]]`` (RESP2)
    or ``{key: [entries]}`` (RESP3, as redis-py parses it)."""
    entries = next(iter(answer.values())) if isinstance(answer, dict) else answer[0][1]
    if entries and isinstance(entries[0], list):
        entries = entries[-1]
    return entries[-1][0]


class MemoryRegistryFeed:
    """The feed of an in-process store: a change count and events, no polling."""

    def __init__(self, changes: FeedCounter) -> None:
        self._changes = changes
        self._seen = changes.count

    def __repr__(self) -> str:
        return f"MemoryRegistryFeed(seen {self._seen} of {self._changes.count})"

    @property
    def listening(self) -> bool:
        return True

    async def start(self) -> None:
        self._seen = self._changes.count

    async def wait(self, timeout_s: float) -> bool:
        changes = self._changes
        if changes.count == self._seen:
            woken = asyncio.Event()
            changes.waiters.add(woken)
            try:
                async with asyncio.timeout(timeout_s):
                    await woken.wait()
            except TimeoutError:
                return False
            finally:
                changes.waiters.discard(woken)
        self._seen = changes.count
        return True

    async def close(self) -> None:
        pass


class FeedCounter:
    """The in-process store's side: how many registry changes so far, and who waits."""

    def __init__(self) -> None:
        self.count = 0
        self.waiters: set[asyncio.Event] = set()

    def __repr__(self) -> str:
        return f"FeedCounter({self.count}, {len(self.waiters)} waiting)"

    def fed(self) -> None:
        self.count += 1
        for woken in self.waiters:
            woken.set()
