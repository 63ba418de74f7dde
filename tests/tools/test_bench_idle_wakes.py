"""The idle benchmark's wake-up count (disagg_tools/overhead/idle_threads.py) and its one-pair
start (`--per-role 1`, one prefill and one decode stand-in, as users run it)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from disagg_tools.overhead.idle_threads import ThreadUse, thread_delta, thread_readings

ROOT = Path(__file__).resolve().parents[2]


def test_a_thread_that_sleeps_and_wakes_is_counted() -> None:
    """A thread woken 20 times, read while it lives (its /proc entry goes with it), shows at
    least 20 wake-ups and some run time; it started inside the window, so it counts from
    zero."""
    pid = os.getpid()
    before = thread_readings(pid)
    slept, release = threading.Event(), threading.Event()

    def sleeper() -> None:
        for _ in range(20):
            time.sleep(0.002)
        slept.set()
        release.wait(10)

    t = threading.Thread(target=sleeper)
    t.start()
    try:
        assert slept.wait(10)
        after = thread_readings(pid)
    finally:
        release.set()
        t.join()
    assert t.native_id is not None
    use = after[(pid, t.native_id)]
    assert (pid, t.native_id) not in before
    assert use.wakes >= 20 and use.run_ns > 0


def test_thread_delta_sums_same_named_threads_costliest_first() -> None:
    """Per thread name: the run time and wake-ups spent between the readings, a thread
    missing from the first reading counted from zero."""
    before = {(1, 1): ThreadUse("loop", 1_000, 10), (1, 2): ThreadUse("tokio", 500, 5)}
    after = {
        (1, 1): ThreadUse("loop", 4_000, 13),
        (1, 2): ThreadUse("tokio", 700, 6),
        (1, 3): ThreadUse("tokio", 9_000, 2),
    }
    assert thread_delta(before, after) == [
        ThreadUse("tokio", 9_200, 3),
        ThreadUse("loop", 3_000, 3),
    ]


def test_the_idle_phase_runs_one_pair_and_reports_wake_ups(tmp_path: Path) -> None:
    """`--per-role 1`: one prefill and one decode in the router's configuration, and a
    wake-ups column beside the CPU figure (no bound on either: the benchmark shows them)."""
    cmd = [sys.executable, "-m", "disagg_tools.overhead.idle", "--targets", "ours", "--no-pin"]
    cmd += ["--per-role", "1", "--idle-s", "1", "--settle-s", "0.5", "--log-dir", str(tmp_path)]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    config = (tmp_path / "idle-ours.yaml").read_text()
    assert config.count("role: prefill") == 1 and config.count("role: decode") == 1
    assert "2 workers (1 prefill + 1 decode)" in out.stdout
    row = next(line for line in out.stdout.splitlines() if line.startswith("| ours |"))
    cells = [c.strip().strip("*") for c in row.split("|")]
    assert float(cells[3]) >= 0.0  # CPU ms/s
    assert float(cells[5]) >= 0.0  # wake-ups/s
