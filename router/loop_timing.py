"""When the background loops wake: one beat for all of them, and their quiet cadence.

The loops of a replica (state refresh, registry sync, health probes, load polls, the stranded
reaper, and outside router/workers/ the lease keeper and the role manager) sleep to a shared
beat: the next multiple of their period on the loop's clock, shifted by this replica's phase. An
idle router's loops then wake together once a second, not each at its own instant: a wake-up
costs ~40 µs of CPU on its own, more than most of their work (docs/benchmarks-overhead.md,
idle), and replicas sharing a host do not all call the store at the same instant. The phase is
drawn once per process (a replica is a process), so a loop with no `LoopTiming` at hand wakes
on the same beat through the module's `beat`.

While the replica is quiet (`busy` says no) some loops slow down; they sleep in `quiet_sleep`,
which the next placement (`placed`) cuts short, so the first request after a quiet spell
brings them back at once.

A quiet replica makes no store call and has no timer on the beat: the registry sync waits on
the store's change feed instead (router/workers/registry.py), and the state refresher, quiet,
hands its read to the registry sync (`StateStore.registry_and_usage_view`), which takes it
along whenever it reads. They meet here: the registry sync announces its period
(`carrier_period`) while its loop runs, the refresher rides (`rider`) while quiet. The next
request (`arrived`, before it is placed) or placement (`placed`) wakes every quiet wait.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from typing import Protocol

from state.base import UsageView

__all__ = ["LoopTiming", "PROCESS_PHASE", "UsageRider", "beat"]

# Where this process's beat falls within each second.
PROCESS_PHASE = random.random()


def _delay(period: float, phase: float) -> float:
    now = asyncio.get_running_loop().time()
    delay = period - (now - phase) % period
    # A timer may fire a hair early (the loop's clock resolution): not a second beat.
    return delay + period if delay < 0.005 else delay


async def beat(period: float, phase: float = PROCESS_PHASE) -> None:
    """Sleep to this process's next beat of `period` (the lease keeper's and the role
    manager's ticks: they fall on the pools' beat without holding their `LoopTiming`)."""
    await asyncio.sleep(_delay(period, phase))


class UsageRider(Protocol):
    """A quiet loop whose store read (decode usage, stranded bytes) the registry sync takes
    along on its beat: the state refresher (router/workers/refresher.py)."""

    def usage_ids(self) -> tuple[list[str], list[str]]:
        """The decode and the prefill workers whose usage to read."""
        ...

    async def take_usage(self, view: UsageView) -> None:
        """The read, taken along."""
        ...

    def drop_ride(self) -> None:
        """No read this beat after all (the store failed, or the registry sync stopped): the
        rider reads for itself again."""
        ...


class LoopTiming:
    def __init__(self, *busy: Callable[[], bool], phase: float | None = None) -> None:
        """`busy`: what says this replica is serving (requests in flight or waiting, legs on
        a worker); any one saying so is enough. `phase`: where this replica's beat falls
        within each second (this process's by default)."""
        self._busy = busy
        self.phase = PROCESS_PHASE if phase is None else phase
        self._placed = asyncio.Event()
        self._quiet_waits: set[asyncio.Event] = set()
        # The registry sync's period while its loop runs (None: no store read to ride on).
        self.carrier_period: float | None = None
        # The loop whose read the next beat's registry sync takes along (None: nobody rides).
        self.rider: UsageRider | None = None

    def __repr__(self) -> str:
        return f"LoopTiming(phase={self.phase:.3f}, busy={self.busy()})"

    def busy(self) -> bool:
        return any(signal() for signal in self._busy)

    def placed(self) -> None:
        """A placement was made: the loops sleeping in `quiet_sleep` or `quiet_wait` wake now."""
        self._placed.set()
        for wake in self._quiet_waits:
            wake.set()

    def arrived(self) -> None:
        """A request arrived (admitted, or queued for room): the quiet loops wake as at a
        placement, before it is placed: a request that waits for room must find the state
        refresher reading again, and the registry sync back on its beat."""
        if self._quiet_waits or not self._placed.is_set():
            self.placed()

    def _delay(self, period: float) -> float:
        return _delay(period, self.phase)

    def delay_past(self, seconds: float, period: float) -> float:
        """How long from now to this replica's first beat of `period` at least `seconds`
        away."""
        return max(seconds, 0.0) + _delay(period, self.phase - max(seconds, 0.0))

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

    async def quiet_wait(self, wake: asyncio.Event) -> None:
        """Until `wake` is set, or the next placement or request: no timer of its own (a
        rider's wait, woken by the read it rides on; the registry sync's wait on the feed)."""
        self._quiet_waits.add(wake)
        try:
            await wake.wait()
        finally:
            self._quiet_waits.discard(wake)
