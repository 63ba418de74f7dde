"""The cluster simulator's future: events that carry their handler, earliest first.

An event is `(time, seq, fire)`: `fire` is the whole of what happens then, a call with no
arguments (a bound handler and its payload, or a closure), so the run loop only calls it and
needs no table of event kinds. `seq` counts pushes: events at the same simulated time fire in
the order they were pushed, which keeps a run deterministic under its seed and means the heap
never compares two handlers.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterator
from functools import partial
from typing import TypeVar

__all__ = ["Event", "EventQueue"]

P = TypeVar("P")

Event = tuple[float, int, Callable[[], None]]


class EventQueue:
    """One run's pending events; `drain` fires them in time order as the run loop asks."""

    __slots__ = ("_heap", "_seq")

    def __init__(self) -> None:
        self._heap: list[Event] = []
        self._seq = 0

    def call_at(self, t: float, fire: Callable[[], None]) -> None:
        """At simulated time `t`, call `fire()`."""
        self._seq += 1
        heapq.heappush(self._heap, (t, self._seq, fire))

    def at(self, t: float, handler: Callable[[P], None], payload: P) -> None:
        """At simulated time `t`, call `handler(payload)`; the type checker matches the two."""
        fire: Callable[[], None] = partial(handler, payload)
        self._seq += 1
        heapq.heappush(self._heap, (t, self._seq, fire))

    def drain(self) -> Iterator[Event]:
        """Pop events in order until none is left, including those pushed while draining."""
        heap = self._heap
        pop = heapq.heappop
        while heap:
            yield pop(heap)
