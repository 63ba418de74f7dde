"""Graceful shutdown: stop taking work, let running streams finish up to a deadline, end the
rest cleanly.

`serving` (router/edge/server.py) calls `Shutdown.stop` when the process is told to stop (SIGTERM,
SIGINT), before aiohttp's own cleanup:

1. `stopping` is set: a request arriving on a connection that is still open is answered
   503 + Retry-After (`code: shutting_down`, `Connection: close`) and `/ready` says 503, so a
   load balancer moves the traffic elsewhere;
2. the listening sockets close: no new connection is accepted;
3. running requests get `grace_s` to finish;
4. those still running are interrupted (`RequestFlow.interrupt`), which takes the path of a
   missed deadline: a stream ends with a valid SSE error frame and `data: [DONE]`, a request
   not yet answered gets the 503, and each releases its reservation and stranded entry in its
   own cleanup. They get `_CUT_WAIT_S` more to do so.

Then the app's cleanup runs as always: background tasks stop and the lease keeper settles
what the store still owes (router/edge/app.py), so nothing stays held once the process exits.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterable, Iterator
from typing import Protocol

from aiohttp import web

from router.errors import RouterError, Unavailable

__all__ = ["SHUTDOWN", "Shutdown", "ShuttingDown"]

log = logging.getLogger(__name__)

# After the grace period, how long interrupted requests have to write their error frame and
# release what they hold (one store call each).
_CUT_WAIT_S = 5.0


class ShuttingDown(Unavailable):
    """This replica is shutting down: retry on another one (the connection closes)."""

    code = "shutting_down"

    def headers(self) -> dict[str, str]:
        return {**super().headers(), "Connection": "close"}


class _Interruptible(Protocol):
    def interrupt(self, err: RouterError) -> None: ...


class Shutdown:
    """The replica's running requests, and whether it is shutting down."""

    def __init__(self, grace_s: float) -> None:
        self.grace_s = grace_s
        self.stopping = False
        self._running: set[_Interruptible] = set()
        self._idle = asyncio.Event()
        self._idle.set()

    def __repr__(self) -> str:
        return f"Shutdown(stopping={self.stopping}, running={len(self._running)})"

    def check(self) -> None:
        """Refuse a new request once shutting down."""
        if self.stopping:
            raise ShuttingDown(
                "this router replica is shutting down; retry the request", retry_after_s=1.0
            )

    @contextlib.contextmanager
    def track(self, flow: _Interruptible) -> Iterator[None]:
        """Count `flow` as running, from its start to the end of its cleanup. A request whose
        body was still arriving when the shutdown began is refused here."""
        self.check()
        self._running.add(flow)
        self._idle.clear()
        try:
            yield
        finally:
            self._running.discard(flow)
            if not self._running:
                self._idle.set()

    async def _wait_idle(self, timeout_s: float) -> bool:
        try:
            async with asyncio.timeout(timeout_s):
                await self._idle.wait()
        except TimeoutError:
            return False
        return True

    async def stop(self, sites: Iterable[web.BaseSite]) -> None:
        """Steps 1-4 of the module docstring."""
        self.stopping = True
        for site in list(sites):
            await site.stop()
        if not self._running:
            return
        log.info(
            "shutting down: %d requests running, %.1f s to finish", len(self._running), self.grace_s
        )
        if await self._wait_idle(self.grace_s):
            return
        cut = list(self._running)
        log.warning(
            "shutting down: ending %d requests still running after %.1f s", len(cut), self.grace_s
        )
        for flow in cut:
            flow.interrupt(
                ShuttingDown(
                    "this router replica shut down before the request was complete",
                    retry_after_s=1.0,
                )
            )
        if not await self._wait_idle(_CUT_WAIT_S):
            log.warning(
                "shutting down: %d requests did not end; aiohttp cancels them", len(self._running)
            )


SHUTDOWN = web.AppKey("shutdown", Shutdown)
