"""The goodput search, one for the replay bench and the simulator experiments.

Goodput (DistServe): the highest arrival-rate scale at which at least `target` (90 %) of the
requests meet both SLOs. Attainment falls with load, so the search brackets the crossing from
`start` by growing or shrinking the rate by `factor`, then bisects geometrically until the
passing and failing rates are within `rel_tol` of each other. It is given a callable that
measures attainment at one rate scale: a live replay (`disagg_tools.replay.replay_cli
--search`, async) or a simulator run (`disagg_tools.experiments.simruns`, sync).
"""

from __future__ import annotations

import inspect
import math
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import IO, Any

from disagg_tools.progress import bar

__all__ = ["GoodputResult", "GoodputSearch", "goodput", "goodput_search", "goodput_search_sync"]


@dataclass(slots=True)
class GoodputResult:
    """The highest rate scale that met the target (None if none did) and every probe made."""

    rate_scale: float | None
    attainment: float | None
    target: float
    points: list[tuple[float, float]] = field(default_factory=list)


@dataclass(slots=True)
class GoodputSearch:
    """The search as a state machine with no I/O: ask `next_rate()`, measure, `record()` it.

    From `start`, grow (or shrink) by `factor` until one rate passes and a higher one fails,
    then bisect geometrically until they are within `rel_tol`. Attainment is noisy, so "good" is
    the highest passing rate seen and "bad" the lowest failing rate above it.
    """

    start: float = 1.0
    target: float = 0.9
    rel_tol: float = 0.05
    factor: float = 2.0
    max_steps: int = 12
    min_rate: float = 1 / 64
    max_rate: float = 64.0
    points: list[tuple[float, float]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not (self.start > 0 and self.factor > 1 and self.rel_tol > 0 and 0 < self.target <= 1):
            raise ValueError("need start > 0, factor > 1, rel_tol > 0, 0 < target <= 1")

    def record(self, rate_scale: float, attainment: float) -> None:
        self.points.append((rate_scale, attainment))

    def next_rate(self) -> float | None:
        """The next rate scale to measure, or None when the search is done."""
        if not self.points:
            return self.start
        if len(self.points) >= self.max_steps:
            return None
        good, bad = self._bracket()
        if good is None:
            assert bad is not None
            nxt = bad / self.factor
            return nxt if nxt >= self.min_rate else None
        if bad is None:
            nxt = good * self.factor
            return nxt if nxt <= self.max_rate else None
        return math.sqrt(good * bad) if bad / good > 1 + self.rel_tol else None

    def result(self) -> GoodputResult:
        good, _ = self._bracket()
        att = None if good is None else max(a for r, a in self.points if r == good)
        return GoodputResult(good, att, self.target, list(self.points))

    def _bracket(self) -> tuple[float | None, float | None]:
        passed = [r for r, a in self.points if a >= self.target]
        good = max(passed, default=None)
        failed = [r for r, a in self.points if a < self.target and (good is None or r > good)]
        return good, min(failed, default=None)


def _search_bar(state: GoodputSearch, progress: IO[str] | bool) -> Any:
    """The search's bar: probes made (of at most `max_steps`, when that is a real bound), the
    last probe after it. `progress`: True for stderr, False for none, or the stream."""
    stream = (sys.stderr if progress else None) if isinstance(progress, bool) else progress
    total = state.max_steps if state.max_steps <= 100 else None
    return bar(stream, desc="goodput search", total=total, unit="probe")


def _probed(shown: Any, state: GoodputSearch) -> None:
    rate, attainment = state.points[-1]
    shown.set_postfix_str(f"x{rate:.3g}: {attainment:.0%} (target {state.target:.0%})")
    shown.update(1)


async def goodput_search(
    run_at: Callable[[float], float | Awaitable[float]],
    *,
    progress: IO[str] | bool = True,
    **search: Any,
) -> GoodputResult:
    """Drive a `GoodputSearch` (keyword arguments) with `run_at(rate_scale) -> attainment`.

    `run_at` may be a coroutine function (a live replay) or a plain function (a simulator).
    A bar counts the probes on stderr (or the stream `progress`; False: none) on a terminal.
    """
    state = GoodputSearch(**search)
    with _search_bar(state, progress) as shown:
        while (rate := state.next_rate()) is not None:
            value = run_at(rate)
            attainment = await value if inspect.isawaitable(value) else value
            state.record(rate, float(attainment))
            _probed(shown, state)
    return state.result()


def goodput_search_sync(
    run_at: Callable[[float], float], *, progress: IO[str] | bool = True, **search: Any
) -> GoodputResult:
    """`goodput_search` for a synchronous `run_at`, without an event loop."""
    state = GoodputSearch(**search)
    with _search_bar(state, progress) as shown:
        while (rate := state.next_rate()) is not None:
            state.record(rate, float(run_at(rate)))
            _probed(shown, state)
    return state.result()


def goodput(
    run_at: Callable[[float], float],
    *,
    start: float = 1.0,
    target: float = 0.9,
    precision: float = 1.05,
    lo_limit: float = 1 / 64,
    hi_limit: float = 256.0,
) -> tuple[float, list[tuple[float, float]]]:
    """The simulator experiments' form of the search: (scale, every (scale, attainment) probed),
    scale 0.0 if even `lo_limit` fails. Bisects until hi/lo <= `precision`; no step limit (a
    simulator run is cheap and deterministic)."""
    found = goodput_search_sync(
        run_at,
        start=start,
        target=target,
        rel_tol=precision - 1.0,
        min_rate=lo_limit,
        max_rate=hi_limit,
        max_steps=1_000,
    )
    return (found.rate_scale or 0.0), found.points
