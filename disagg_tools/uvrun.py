"""disagg-router: uvrun — run a process's main coroutine on uvloop when it is installed.

The one start-up helper for every process entry (the router, the simulated worker, the bench
tools): the same loop everywhere, so a benchmark measures the loop the router serves on.
It imports only the standard library (and uvloop, if present), so any layer may use it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

__all__ = ["loop_factory", "run"]

T = TypeVar("T")


def loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's loop constructor, or None (asyncio's default loop) where uvloop is not
    installed (Windows, or a venv without it): slower, but the same behaviour."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def run(main: Coroutine[Any, Any, T]) -> T:
    """`asyncio.run(main)` on the loop `loop_factory` picks."""
    with asyncio.Runner(loop_factory=loop_factory()) as runner:
        return runner.run(main)
