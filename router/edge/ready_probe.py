"""Whether the shared store answers now, for /ready: one check at a time, waited on for at
most `READY_STORE_TIMEOUT_S`.

The state refresher's `store_ok` says how its last read ended, and a read of a frozen Redis
(SIGSTOP, a stalled host, a partition that drops packets) does not end until the client's
socket timeout (10 s) — until then /ready said 200 (issue 31). So /ready runs a check of its
own (router/edge/app.py: a refresh of the shared state, the store-loss marker's included, so that
a store restarted empty is ready only once this replica has put back what it holds), and a
check that has not ended within the bound is a 503.

One check is in flight at most: a probe that comes while one is pending waits on that one (a
load balancer probing every second does not pile up calls, nor connections, on a frozen
store), and the check itself is never cancelled (a command cancelled mid-reply would cost its
connection); it ends on its own, by its answer or its socket timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable

from aiohttp import web

__all__ = ["READY_STORE_TIMEOUT_S", "STORE_PROBE", "StoreProbe"]

# Below Kubernetes' default probe timeout (1 s), so that the probe gets our 503 and its
# Retry-After rather than timing out itself; a healthy Redis answers the check's two calls
# (router/workers/refresher.py `refresh`) in about a millisecond.
READY_STORE_TIMEOUT_S = 0.5


class StoreProbe:
    __slots__ = ("_check",)

    def __init__(self) -> None:
        self._check: asyncio.Future[None] | None = None

    def __repr__(self) -> str:
        pending = self._check is not None and not self._check.done()
        return f"StoreProbe(check_pending={pending})"

    async def answers(
        self, check: Callable[[], Awaitable[None]], within_s: float = READY_STORE_TIMEOUT_S
    ) -> bool:
        """True if `check()` (this one, or the one already pending) ends without an error
        within `within_s`; never waits longer."""
        task = self._check
        if task is None or task.done():
            task = self._check = asyncio.ensure_future(check())
            task.add_done_callback(_retrieve)
        # asyncio.wait, not wait_for: the check goes on when this probe stops waiting.
        done, _ = await asyncio.wait({task}, timeout=within_s)
        return bool(done) and not task.cancelled() and task.exception() is None

    async def close(self) -> None:
        """At the app's cleanup: a check still pending (a store that never answered) ends."""
        task, self._check = self._check, None
        if task is not None and not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task


def _retrieve(task: asyncio.Future[None]) -> None:
    # A check that failed after every probe stopped waiting: its error is read (and dropped:
    # the next probe checks again; the refresher logs the outage), not reported at exit as
    # "never retrieved".
    if not task.cancelled():
        task.exception()


STORE_PROBE = web.AppKey("store_probe", StoreProbe)
