"""The child processes and ports of the tools, and what /proc says about a process.

    Child       one subprocess in a session of its own (its log file, optional core pinning,
                niceness or real-time priority; SIGTERM then SIGKILL to its group on stop)
    free_port   a loopback port free now and not handed out before by this process

What each CPU reading counts (they differ, so each has its own name):

    process_cpu_s       utime + stime of every thread of one process, its children left out
                        (10 ms ticks): the router of a load run, this client
    process_tree_cpu_s  the same over a process and its live descendants: a router that
                        starts helpers of its own (the peers' routers do)
    process_tree_user_sys_s  the same, split into (user, system): the kernel's share of a
                        router's CPU over a run
    process_tree_run_s  the scheduler's nanosecond run time of every live thread of a process
                        and its descendants: an idle router spends ~1 ms/s, which ticks
                        cannot resolve over seconds
    own_cpu_s           this process, from getrusage (every thread, ended ones included)

Nothing here imports the router or the workers: they are the subprocesses.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
import resource
import signal
import socket
import subprocess
import sys
import weakref
from collections.abc import Callable
from pathlib import Path

__all__ = [
    "HOST",
    "Child",
    "descendants",
    "free_port",
    "own_cpu_s",
    "process_cpu_s",
    "process_rss_bytes",
    "process_tree_cpu_s",
    "process_tree_run_s",
    "process_tree_user_sys_s",
]

HOST = "127.0.0.1"
_TICK = os.sysconf("SC_CLK_TCK")
_PAGE = os.sysconf("SC_PAGE_SIZE")

# Every port handed out so far. The workers and routers bind theirs only once started, so the
# kernel may offer the same free port twice meanwhile; two children would then race for it and
# one exit with "address already in use".
_HANDED_OUT: set[int] = set()


def free_port() -> int:
    """A loopback port free now and not handed out before by this process."""
    while True:
        with socket.socket() as s:
            s.bind((HOST, 0))
            port = int(s.getsockname()[1])
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port


# --- what /proc says about a process ------------------------------------------------------------


def descendants(pid: int) -> list[int]:
    """`pid` and every live process below it (children of any of its threads)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    todo.extend(int(c) for c in f.read().split())
        except OSError:
            pass
    return out


def _user_sys_ticks(pid: int) -> tuple[int, int]:
    """(utime, stime) of every thread of `pid`, in clock ticks ((0, 0) once it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0, 0
    return int(fields[11]), int(fields[12])  # stat fields 14 and 15


def process_cpu_s(pid: int) -> float:
    """utime + stime of every thread of `pid`, in seconds; its children are not counted."""
    return sum(_user_sys_ticks(pid)) / _TICK


def process_tree_cpu_s(pid: int) -> float:
    """utime + stime of `pid` and its live descendants, every thread, in seconds."""
    return sum(process_tree_user_sys_s(pid))


def process_tree_user_sys_s(pid: int) -> tuple[float, float]:
    """(user, system) seconds of `pid` and its live descendants, every thread: the kernel's
    share of a process's CPU, from the 10 ms ticks (read it over seconds, not per request)."""
    user = system = 0
    for p in descendants(pid):
        u, k = _user_sys_ticks(p)
        user, system = user + u, system + k
    return user / _TICK, system / _TICK


def process_tree_run_s(pid: int) -> float:
    """Seconds on a CPU of `pid` and its descendants (every live thread), from the scheduler's
    own nanosecond count (`/proc/<pid>/task/<tid>/schedstat`, first field). A thread that
    ended inside the window is missing from it (an idle router ends none)."""
    total = 0
    for p in descendants(pid):
        try:
            tasks = os.listdir(f"/proc/{p}/task")
        except OSError:
            continue
        for tid in tasks:
            try:
                with open(f"/proc/{p}/task/{tid}/schedstat") as f:
                    total += int(f.read().split()[0])
            except (OSError, ValueError, IndexError):
                continue
    return total / 1e9


def own_cpu_s() -> float:
    """User + system seconds of this process (every thread, ended ones included)."""
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def process_rss_bytes(pid: int) -> int:
    """Resident set size of `pid` (0 once it is gone)."""
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * _PAGE
    except OSError:
        return 0


# --- child processes ----------------------------------------------------------------------------


def _before_exec(core: int | None, nice: int, rt_priority: int) -> Callable[[], None]:
    """What the child does between fork and exec: die with its parent, then take its core and
    priority (a measured process may be pinned and prioritised; others are left as they are)."""

    def prepare() -> None:
        _die_with_parent()
        if core is not None:
            os.sched_setaffinity(0, {core})
        if nice:
            os.setpriority(os.PRIO_PROCESS, 0, nice)
        if rt_priority:
            os.sched_setscheduler(0, os.SCHED_RR, os.sched_param(rt_priority))

    return prepare


def _die_with_parent() -> None:
    """SIGKILL when the process that started it dies (Linux), so a run that is itself killed
    (a pytest timeout, ^C twice) leaves nothing behind. Each child has a session of its own, so
    a signal to our group would not reach it. Some sandboxes ignore it (this one's PID 1 does):
    `_LIVE` and the atexit hook below are the fallback."""
    if sys.platform != "linux":
        return
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


# Every Child still running, killed at interpreter exit: a run cut short (a pytest timeout that
# abandons its event loop) must not leave workers, routers or a Redis behind. A safety net
# only: `stop()` is the normal way out.
_LIVE: weakref.WeakSet[Child] = weakref.WeakSet()


@atexit.register
def _kill_leftovers() -> None:
    for child in list(_LIVE):
        if child.alive():
            child.kill()


class Child:
    """A subprocess in its own session, logging to `<log_dir>/<name>.log`, started at once.

    `core`, `nice` and `rt_priority` pin and prioritise it (the overhead benchmark's measured
    processes); `start()` again after it exited or was killed restarts the same command.
    `stop` never raises."""

    def __init__(
        self,
        name: str,
        cmd: list[str],
        log_dir: Path,
        *,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        core: int | None = None,
        nice: int = 0,
        rt_priority: int = 0,
    ) -> None:
        self.name = name
        self.cmd = cmd
        self.env = {**os.environ, **env} if env else None
        self.cwd = cwd
        self.log_path = log_dir / f"{name}.log"
        self._prepare = _before_exec(core, nice, rt_priority)
        self.starts = 0
        self.popen = self._spawn()

    def _spawn(self) -> subprocess.Popen[bytes]:
        # The child writes to its own copy of the descriptor: ours is closed at once.
        with open(self.log_path, "ab") as log:
            popen = subprocess.Popen(
                self.cmd,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                env=self.env,
                cwd=self.cwd,
                preexec_fn=self._prepare,
            )
        self.starts += 1
        _LIVE.add(self)
        return popen

    def start(self) -> None:
        """Start the command again (after it exited or was killed)."""
        self.popen = self._spawn()

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def kill(self) -> None:
        """SIGKILL the whole group at once (a crash, not a shutdown) and reap it."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.popen.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(10)

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM to its group, SIGKILL after `grace_s`; never raises."""
        try:
            if self.popen.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.popen.pid, signal.SIGTERM)
                try:
                    self.popen.wait(grace_s)
                except subprocess.TimeoutExpired:
                    self.kill()
        except Exception as exc:  # noqa: BLE001 - one stuck child must not leak the others
            print(f"disagg_tools.procs: could not stop {self!r}: {exc!r}", file=sys.stderr)

    def __repr__(self) -> str:
        return f"Child({self.name} pid={self.popen.pid} alive={self.alive()} starts={self.starts})"
