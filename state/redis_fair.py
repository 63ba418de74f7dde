"""The cluster's fair share on `RedisStore`: one script call (state/fair_scripts.py) on the
``{fair}`` hash tag, a replica's sync once a period (never on a request's path). The steps:
state/fair_shares.py."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

from redis.commands.core import AsyncScript

from state.base import StoreError
from state.fair_scripts import FAIR_CLAIM_SCRIPT, FAIR_SYNC_SCRIPT
from state.fair_shares import (
    FairSlot,
    FairView,
    FairWaiter,
    check_fair_sync,
    decode_nudge_line,
    encode_nudge_line,
)
from state.redact import mask_urls
from state.redis_conn import FAILURES, RedisConnection, store_call, text

__all__ = ["RedisFair"]


def _number(raw: Any) -> float:
    return float(text(raw))


def _failed(exc: BaseException) -> StoreError:
    problem = mask_urls(f"{type(exc).__name__}: {exc}")
    return StoreError(f"the state store failed (fair_nudges): {problem}")


class RedisFair(RedisConnection):
    """The fair-share method of the `StateStore` on Redis (mixed into `RedisStore`)."""

    def _register_fair_scripts(self, register: Callable[[str], AsyncScript]) -> None:
        self._fair_sync = register(FAIR_SYNC_SCRIPT)
        self._fair_claim = register(FAIR_CLAIM_SCRIPT)

    @store_call
    async def fair_sync(
        self,
        replica: str,
        charges: Mapping[FairSlot, float],
        waiting: Mapping[FairSlot, tuple[int, float]],
        lease_s: float,
        holding: Mapping[FairSlot, int] | None = None,
    ) -> FairView:
        holding = holding or {}
        check_fair_sync(replica, charges, waiting, lease_s, holding)
        args: list[str | int] = [self._now(), replica, repr(float(lease_s)), len(charges)]
        for (priority, tenant), amount in charges.items():
            args += [int(priority), tenant, repr(float(amount))]
        args.append(len(waiting))
        for (priority, tenant), (count, age) in waiting.items():
            args += [int(priority), tenant, int(count), repr(float(age))]
        args.append(len(holding))
        for (priority, tenant), blocks in holding.items():
            args += [int(priority), tenant, int(blocks)]
        row = [text(x) for x in await self._hot_script(self._fair_sync, self._keys.fair, args)]
        i = 0
        floors: dict[int, float] = {}
        for _ in range(int(row[i])):
            floors[int(row[i + 1])] = _number(row[i + 2])
            i += 2
        i += 1
        counters: dict[FairSlot, float] = {}
        for _ in range(int(row[i])):
            counters[(int(row[i + 1]), row[i + 2])] = _number(row[i + 3])
            i += 3
        i += 1
        waiters: list[FairWaiter] = []
        for _ in range(int(row[i])):
            name, cls, who, many, waited = row[i + 1 : i + 6]
            waiters.append(FairWaiter(name, int(cls), who, int(many), _number(waited)))
            i += 5
        i += 1
        held: dict[FairSlot, int] = {}
        for _ in range(int(row[i])):
            held[(int(row[i + 1]), row[i + 2])] = int(row[i + 3])
            i += 3
        i += 1
        replicas = sorted(row[i + 1 : i + 1 + int(row[i])])
        waiters.sort(key=lambda w: (w.replica, w.priority, w.tenant))
        return FairView(
            dict(sorted(counters.items())),
            floors,
            tuple(waiters),
            dict(sorted(held.items())),
            tuple(replicas),
        )

    @store_call
    async def fair_claim(
        self, wanted: Mapping[str, tuple[int, int]], owner: str, ttl_s: float
    ) -> dict[str, int]:
        lines = [(line, count, want) for line, (count, want) in wanted.items() if count > 0]
        if not lines:
            return {line: 0 for line in wanted}
        keys: list[str] = []
        args: list[str | int] = [owner, max(1, int(ttl_s * 1000))]
        for line, count, want in lines:
            keys += self._keys.fair_claims(line, count)
            args += [count, want]
        row = await self._hot_script(self._fair_claim, keys, args)
        got = {line: 0 for line in wanted}
        for (line, _, _), claimed in zip(lines, row, strict=True):
            got[line] = int(claimed)
        return got

    @store_call
    async def fair_nudge(self, replica: str, line: FairSlot | None = None) -> None:
        await self._client.publish(self._keys.fair_nudge(replica), encode_nudge_line(line))

    async def fair_nudges(self, replica: str) -> AsyncIterator[FairSlot | None]:
        """A subscription of its own (one connection, redis-py's pub/sub; on a cluster the
        message reaches every node, so any node serves it)."""
        pubsub = self._client.pubsub()
        try:
            try:
                await pubsub.subscribe(self._keys.fair_nudge(replica))
            except FAILURES as exc:
                raise _failed(exc) from exc
            while True:
                try:
                    message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=None)
                except FAILURES as exc:
                    raise _failed(exc) from exc
                if message is not None and message.get("type") == "message":
                    yield decode_nudge_line(message.get("data"))
        finally:
            # Shielded: a shutdown cancels a task again until it ends (router/background.py);
            # a second cancel inside the close would leave its connection's socket open.
            with contextlib.suppress(*FAILURES, asyncio.CancelledError):
                await asyncio.shield(pubsub.aclose())
