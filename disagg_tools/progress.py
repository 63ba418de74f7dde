"""Progress bars for the long runs (bench replays, goodput searches, the demo), with tqdm.

A bar is drawn only when its stream is a terminal; into a pipe, a file or CI logs it writes
nothing at all. Result lines (`note`) are still written there, and on a terminal above the bars
so that no bar is torn.
"""

from __future__ import annotations

import sys
from typing import IO, Any

from tqdm import tqdm

__all__ = ["ReplayBar", "bar", "on_terminal", "note"]


def on_terminal(stream: IO[str] | None) -> bool:
    """Whether `stream` is an interactive terminal (a closed or odd stream is not)."""
    if stream is None:
        return False
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError, OSError):
        return False


def bar(stream: IO[str] | None, *, desc: str, total: int | None = None, unit: str = "it") -> Any:
    """A tqdm bar on `stream`, disabled (silent, still callable) unless it is a terminal."""
    return tqdm(
        total=total,
        desc=desc,
        unit=unit,
        file=stream if stream is not None else sys.stderr,
        disable=not on_terminal(stream),
        dynamic_ncols=True,
        mininterval=0.1,
        leave=True,
    )


def note(line: str, stream: IO[str] | None = None) -> None:
    """A result line that stays (a probe's attainment, a ladder rung's numbers): written above
    the bars on a terminal, so no bar is torn; a plain line into a log."""
    stream = stream if stream is not None else sys.stderr
    if on_terminal(stream):
        tqdm.write(line, file=stream)
    else:
        print(line, file=stream, flush=True)


class ReplayBar:
    """A replay's progress hook (`disagg_tools.replay.replayer.ProgressFn`): requests done of
    the total, with the outcomes so far (ok, error, timeout...) after the bar."""

    def __init__(self, stream: IO[str] | None, *, desc: str) -> None:
        self._bar = bar(stream, desc=desc, unit="req")
        self._outcomes: dict[str, int] = {}

    def __call__(self, done: int, total: int, rec: Any) -> None:
        outcome = str(getattr(rec, "outcome", "done"))
        self._outcomes[outcome] = self._outcomes.get(outcome, 0) + 1
        if self._bar.total != total:
            self._bar.total = total
        self._bar.set_postfix(self._outcomes, refresh=False)
        self._bar.update(done - self._bar.n)

    def close(self) -> None:
        self._bar.close()

    def __repr__(self) -> str:
        return f"ReplayBar({self._outcomes})"
