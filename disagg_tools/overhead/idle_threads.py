"""Where an idle router's CPU goes, thread by thread, and how often each thread wakes.

The scheduler keeps, per thread, its nanoseconds on a CPU and the number of times it was put
on one (`/proc/<pid>/task/<tid>/schedstat`: run time, wait time, timeslices). An idle event
loop that sleeps in `epoll_wait` and wakes for a timer gets one timeslice a wake-up, so the
timeslice count is the wake-up count: what the idle router's background loops cost is mostly
their wake-ups (each pays the loop's turn, the syscalls and the cache misses), and a thread
that should sleep (a resolver's, a metrics exporter's) shows up here with its own count.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from disagg_tools.procs import descendants

__all__ = ["ThreadUse", "thread_delta", "thread_readings"]


@dataclass(frozen=True, slots=True)
class ThreadUse:
    """One thread's (or a group of same-named threads') run time and wake-ups."""

    name: str
    run_ns: int
    wakes: int


def thread_readings(pid: int) -> dict[tuple[int, int], ThreadUse]:
    """Every live thread of `pid` and its descendants, keyed by (pid, tid)."""
    out: dict[tuple[int, int], ThreadUse] = {}
    for p in descendants(pid):
        try:
            tids = os.listdir(f"/proc/{p}/task")
        except OSError:
            continue
        for tid in tids:
            base = f"/proc/{p}/task/{tid}"
            try:
                with open(f"{base}/schedstat") as f:
                    run_ns, _wait_ns, slices = (int(x) for x in f.read().split()[:3])
                with open(f"{base}/comm") as f:
                    name = f.read().strip()
            except (OSError, ValueError):
                continue
            out[(p, int(tid))] = ThreadUse(name, run_ns, slices)
    return out


def thread_delta(
    before: dict[tuple[int, int], ThreadUse], after: dict[tuple[int, int], ThreadUse]
) -> list[ThreadUse]:
    """What each thread name spent between two readings (threads that started inside the
    window count from zero), the costliest first."""
    by_name: dict[str, list[int]] = {}
    for key, use in after.items():
        prev = before.get(key)
        run = use.run_ns - (prev.run_ns if prev else 0)
        wakes = use.wakes - (prev.wakes if prev else 0)
        acc = by_name.setdefault(use.name, [0, 0])
        acc[0] += run
        acc[1] += wakes
    rows = [ThreadUse(name, run, wakes) for name, (run, wakes) in by_name.items()]
    return sorted(rows, key=lambda r: -r.run_ns)
