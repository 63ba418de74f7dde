"""A busy replica's background store calls fall on the loops' shared beat (router/loop_timing.py),
so they go out in one loop turn with the others' instead of each waking the replica on its own
timer (issue 36: at one stream the retry tally's own 0.25 s timer and the lease keeper's 1 s
sleep were two thirds of the timer wake-ups; docs/benchmarks-overhead.md). Each call is timed
on the loop's clock against this process's phase, on the real in-process store."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from router.config import RetrySettings
from router.edge.wiring import _TALLY_S, _tally_requests
from router.leases import _OWED_RETRY_S, LeaseKeeper
from router.loop_timing import PROCESS_PHASE, beat
from router.retry_budget import RetryBudget
from state.base import Finished
from state.memory_store import MemoryStore
from tests.router.workers.test_pools_idle import loop_running

# A timer fires late by the loop's busy turns (a loaded machine's: tens of ms), never early.
# The calls below start half way between two beats, so a call on a timer of its own lands
# at least 0.15 s from any beat: far outside this.
SLACK_S = 0.06


class _TimedStore(MemoryStore):
    """The in-process store, noting on the loop's clock when each call of interest came."""

    def __init__(self) -> None:
        super().__init__()
        self.tallies: list[float] = []
        self.finishes: list[float] = []
        self.finished = asyncio.Event()

    async def note_request(self, count: int = 1) -> None:
        self.tallies.append(asyncio.get_running_loop().time())
        await super().note_request(count)

    async def finish(self, *args: object, **kwargs: object) -> Finished:
        self.finishes.append(asyncio.get_running_loop().time())
        self.finished.set()
        return await super().finish(*args, **kwargs)  # type: ignore[arg-type]


def _off_beat(times: Sequence[float], period: float) -> list[float]:
    """How far each time is from this process's nearest beat of `period`."""
    off = []
    for t in times:
        r = (t - PROCESS_PHASE) % period
        off.append(min(r, period - r))
    return off


async def test_the_retry_tally_goes_out_on_the_beat() -> None:
    store = _TimedStore()
    budget = RetryBudget(store, RetrySettings())
    async with loop_running(_tally_requests(budget)):
        for _ in range(3):
            # A request counted 0.1 s past a beat: a tally on a 0.25 s timer of its own went
            # out 0.35 s past it, 0.15 s before the next.
            await beat(_TALLY_S, PROCESS_PHASE + 0.1)
            budget.note_request()
            await asyncio.sleep(_TALLY_S)
    assert len(store.tallies) >= 2, store.tallies
    assert max(_off_beat(store.tallies, _TALLY_S)) < SLACK_S, store.tallies
    assert budget._untallied == 0  # every count landed


async def test_the_lease_keepers_owed_steps_are_retried_on_the_beat() -> None:
    store = _TimedStore()
    keeper = LeaseKeeper(store, lease_s=30.0)
    async with loop_running(keeper.run()):
        # Held half way between two beats: a tick on a 1 s sleep of its own fell there too.
        await beat(_OWED_RETRY_S, PROCESS_PHASE + _OWED_RETRY_S / 2)
        keeper.hold("d0", "r1", blocks=4)
        keeper._owe(("d0", "r-owed"), None)  # a release that failed: retried on the tick
        async with asyncio.timeout(3 * _OWED_RETRY_S):
            await store.finished.wait()
    assert max(_off_beat(store.finishes, _OWED_RETRY_S)) < SLACK_S, store.finishes
