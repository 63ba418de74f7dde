"""When the background loops wake: one beat for all of them, and their quiet cadence.

The loops of a replica (state refresh, registry sync, health probes, load polls, the stranded
reaper) sleep to a shared beat: the next multiple of their period on the loop's clock, shifted
by this replica's phase. An idle router's loops then wake together once a second, not each at
its own instant: a wake-up costs ~40 µs of CPU on its own, more than most of their work
(docs/benchmarks-overhead.md, idle), and replicas sharing a host do not all call the store at
the same instant.

While the replica is quiet (`busy` says no) some loops slow down; they sleep in `quiet_sleep`,
which the next placement (`placed`) cuts short, so the first request after a quiet spell
brings them back at once.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable

__all__ = ["LoopTiming"]


class LoopTiming:
    def __init__(self, *busy: Callable[[], bool], phase: float | None = None) -> None:
        """`busy`: what says this replica is serving (requests in flight or waiting, legs on
        a worker); any one saying so is enough. `phase`: where this replica's beat falls
        within each second (random by default)."""
        self._busy = busy
        self.phase = random.random() if phase is None else phase
        self._placed = asyncio.Event()

    def __repr__(self) -> str:
        return f"LoopTiming(phase={self.phase:.3f}, busy={self.busy()})"

    def busy(self) -> bool:
        return any(signal() for signal in self._busy)

    def placed(self) -> None:
        """A placement was made: the loops sleeping in `quiet_sleep` wake now."""
        self._placed.set()

    def _delay(self, period: float) -> float:
        now = asyncio.get_running_loop().time()
        delay = period - (now - self.phase) % period
        # A timer may fire a hair early (the loop's clock resolution): not a second beat.
        return delay + period if delay < 0.005 else delay

    async def beat(self, period: float) -> None:
        """Sleep to this replica's next beat of `period`."""
        await asyncio.sleep(self._delay(period))

    async def quiet_sleep(self, period: float) -> None:
        """`beat(period)`, cut short by the next placement (a request after a quiet spell)."""
        self._placed.clear()
        try:
            async with asyncio.timeout(self._delay(period)):
                await self._placed.wait()
        except TimeoutError:
            pass
