"""A private `redis-server` on a loopback port of its own: for tests that kill and restart it,
and for the whole session when no Redis answers at the configured address
(tests/session_redis.py).

Never the shared server on 6379: this one keeps nothing on disk (`--save ''`, no AOF, its own
temporary directory), so a restart comes back empty, as a production Redis without persistence
does after a crash. It runs in a session of its own, so a Ctrl-C at the terminal reaches pytest
(which then stops it) and not the server mid-test, and it dies with the test process (Linux
`PR_SET_PDEATHSIG`) if that is killed outright.
"""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import tempfile
import time

import pytest

from tests.ports import free_port
from tests.redis_cluster import die_with_parent

__all__ = ["PrivateRedis"]


class PrivateRedis:
    def __init__(self) -> None:
        if shutil.which("redis-server") is None:
            pytest.skip("redis-server is not installed")
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self.tmpdir: str | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def __repr__(self) -> str:
        return f"PrivateRedis(port={self.port}, running={self.proc is not None})"

    def start(self) -> None:
        self.tmpdir = tempfile.mkdtemp(prefix="dr-redis-")
        self.proc = subprocess.Popen(
            [
                "redis-server",
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--dir",
                self.tmpdir,
                "--save",
                "",
                "--appendonly",
                "no",
                "--logfile",
                "",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=die_with_parent,
        )
        deadline = time.monotonic() + 10.0
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                time.sleep(0.02)
        self.kill()
        raise RuntimeError(f"redis-server on port {self.port} did not come up")

    def kill(self) -> None:
        """SIGKILL: no shutdown, no save; whatever it held is gone, its directory too (a
        restart gets a fresh one)."""
        if self.proc is not None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)
            self.proc = None
        if self.tmpdir is not None:
            shutil.rmtree(self.tmpdir, ignore_errors=True)
            self.tmpdir = None

    def __enter__(self) -> PrivateRedis:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.kill()
