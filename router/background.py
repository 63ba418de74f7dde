"""Every task the router starts that no request awaits: held, its failure logged and counted,
and drained at shutdown.

A bare `loop.create_task(...)` that nothing holds may be garbage-collected mid-flight, and its
exception surfaces only as "Task exception was never retrieved" at some later GC — under load,
megabytes of it. Here each task is held until it ends; a failure is counted per task name and
logged at most once per `log_every_s` per name (with how many were not logged), so a store
outage does not write a line per request.

Two kinds: *loops* (the refresher, the health prober...) run until shutdown and are cancelled
then; *jobs* (a reservation growth, an unstrand) are short and are given `drain_s` to finish at
shutdown before they are cancelled too.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any

__all__ = ["BackgroundTasks"]

log = logging.getLogger(__name__)


class BackgroundTasks:
    def __init__(
        self,
        on_failure: Callable[[str], None] | None = None,
        log_every_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._jobs: set[asyncio.Task[Any]] = set()
        self._loops: set[asyncio.Task[Any]] = set()
        self._on_failure = on_failure  # e.g. a metric's inc, by task name
        self._log_every_s = log_every_s
        self._clock = clock
        self._last_logged: dict[str, float] = {}
        self._unlogged: dict[str, int] = {}
        self.failures = 0
        self.closed = False

    def __repr__(self) -> str:
        return (
            f"BackgroundTasks(jobs={len(self._jobs)}, loops={len(self._loops)}, "
            f"failures={self.failures})"
        )

    def __len__(self) -> int:
        return len(self._jobs)

    def job(self, coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task[Any]:
        """A short task: awaited (up to a deadline) at shutdown."""
        return self._start(coro, name, self._jobs)

    def loop(self, coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task[Any]:
        """A task that runs until shutdown cancels it."""
        return self._start(coro, name, self._loops)

    def _start(
        self, coro: Coroutine[Any, Any, Any], name: str, into: set[asyncio.Task[Any]]
    ) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        if self.closed:
            # Started by a timer or a callback that outlived the shutdown (a fair-share sync
            # after its wait's timer, a nudge): cancelled before its first step, so that it
            # opens no connection to a store that is closed or closing, which nobody would
            # close again (an "unclosed transport" at the next garbage collection).
            task.cancel()
        into.add(task)
        task.add_done_callback(lambda t: self._ended(t, into))
        return task

    def _ended(self, task: asyncio.Task[Any], owner: set[asyncio.Task[Any]]) -> None:
        owner.discard(task)
        if task.cancelled():
            return
        exc = task.exception()  # retrieved: never "never retrieved"
        if exc is None:
            return
        name = task.get_name()
        self.failures += 1
        if self._on_failure is not None:
            self._on_failure(name)
        now = self._clock()
        last = self._last_logged.get(name)
        if last is not None and now - last < self._log_every_s:
            self._unlogged[name] = self._unlogged.get(name, 0) + 1
            return
        self._last_logged[name] = now
        more = self._unlogged.pop(name, 0)
        suffix = f" ({more} more such failures since the last report)" if more else ""
        log.warning("background task %s failed: %r%s", name, exc, suffix)

    async def close(self, drain_s: float = 5.0) -> None:
        """Give jobs `drain_s` to finish, then cancel whatever is left, loops first. Anything
        started from then on is cancelled before it runs."""
        self.closed = True
        await self._cancel(self._loops)
        if self._jobs:
            await asyncio.wait(set(self._jobs), timeout=drain_s)
        await self._cancel(self._jobs)

    @staticmethod
    async def _cancel(tasks: set[asyncio.Task[Any]]) -> None:
        # A library that swallows one cancellation (redis-py can, inside a command) must not
        # hang shutdown: cancel again until they end.
        for _ in range(50):
            pending = [t for t in tasks if not t.done()]
            if not pending:
                return
            for t in pending:
                t.cancel()
            await asyncio.wait(pending, timeout=0.1)
