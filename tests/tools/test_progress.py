"""Progress bars (disagg_tools/progress.py): drawn on a terminal (a pseudo-terminal here),
nothing at
all when the stream is a pipe or a file — the replay hook the bench and the demo use, and the
goodput search's bar."""

from __future__ import annotations

import fcntl
import io
import os
import struct
import termios
from collections.abc import Iterator
from typing import IO, Any

import pytest

from disagg_tools.goodput import goodput_search_sync
from disagg_tools.progress import ReplayBar, note, on_terminal

# What a tqdm bar is drawn with: the bar's edge and its blocks.
BAR_MARKS = ("%|", "█", "▏", "▎", "▍", "▌", "▋", "▊", "▉")


class _Rec:
    def __init__(self, outcome: str) -> None:
        self.outcome = outcome


@pytest.fixture
def terminal() -> Iterator[tuple[IO[str], int]]:
    """A text stream onto a pseudo-terminal's slave end, and the master end's fd to read."""
    master, slave = os.openpty()
    # A terminal of 24 rows of 120 columns (a fresh pty has 0 columns: no room for a bar).
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))
    stream = io.open(slave, "w", encoding="utf-8", closefd=True)  # noqa: UP020 - an fd
    os.set_blocking(master, False)
    try:
        yield stream, master
    finally:
        stream.close()
        os.close(master)


def _drain(master: int) -> str:
    out = b""
    while True:
        try:
            chunk = os.read(master, 65536)
        except BlockingIOError:
            break
        if not chunk:
            break
        out += chunk
    return out.decode("utf-8", "replace")


def _replay(stream: IO[str], total: int = 5) -> None:
    bar = ReplayBar(stream, desc="bench rate x1")
    for done in range(1, total + 1):
        bar(done, total, _Rec("ok" if done % 2 else "rejected"))
    bar.close()


def _search(stream: IO[str]) -> Any:
    # Attainment falls as the rate grows: passes up to x2, fails beyond.
    return goodput_search_sync(lambda r: 1.0 if r <= 2.0 else 0.5, progress=stream, max_steps=8)


def _has_bar(text: str) -> bool:
    return any(mark in text for mark in BAR_MARKS)


def test_no_bar_characters_when_the_stream_is_not_a_terminal() -> None:
    pipe = io.StringIO()
    assert not on_terminal(pipe)
    _replay(pipe)
    found = _search(pipe)
    assert found.rate_scale == 2.0  # the search itself ran
    assert pipe.getvalue() == ""
    note("bench: rate x1: attainment 100.0%", pipe)  # a result line is still written
    assert pipe.getvalue() == "bench: rate x1: attainment 100.0%\n"


def test_a_replay_bar_is_drawn_on_a_terminal(terminal: tuple[IO[str], int]) -> None:
    stream, master = terminal
    assert on_terminal(stream)
    _replay(stream)
    stream.flush()
    shown = _drain(master)
    assert _has_bar(shown), shown
    assert "bench rate x1" in shown and "5/5" in shown
    assert "ok=3" in shown and "rejected=2" in shown  # the outcomes after the bar


def test_the_goodput_search_bar_is_drawn_on_a_terminal(terminal: tuple[IO[str], int]) -> None:
    stream, master = terminal
    found = _search(stream)
    stream.flush()
    shown = _drain(master)
    assert _has_bar(shown), shown
    assert "goodput search" in shown
    assert f"{len(found.points)}/8" in shown
