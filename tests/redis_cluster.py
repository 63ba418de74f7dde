"""A private 3-node Redis Cluster on loopback ports of its own, started once per test session.

Never the shared server on 6379. Three primaries, no replicas, nothing on disk: every node runs
with `--save ''` and `--appendonly no` in a temporary directory that is removed at the end.
Each node is told to die with the test process (Linux `PR_SET_PDEATHSIG`), so a pytest that is
killed does not leave servers behind; a normal exit stops them at interpreter exit.

Tests take it through the session fixture `redis_cluster` (import it into the test module); it
skips when `redis-server` or `redis-cli` is missing.
"""

from __future__ import annotations

import atexit
import ctypes
import os
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import time

import pytest

__all__ = ["PrivateRedisCluster", "die_with_parent", "redis_cluster", "shared_cluster"]

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """For `preexec_fn`: the child gets SIGKILL when the test process goes (Linux)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        pass  # not glibc Linux: the atexit hook still stops the nodes on a normal exit


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def _cluster_ports(count: int) -> list[int]:
    """Ports P whose cluster-bus port P + 10000 is free too, both below the kernel's ephemeral
    range (32768+), so no outgoing connection is handed one of them before the node binds."""
    rng = random.Random()
    ports: list[int] = []
    for _ in range(500):
        port = rng.randrange(20000, 22700)
        if port not in ports and _bindable(port) and _bindable(port + 10000):
            ports.append(port)
            if len(ports) == count:
                return ports
    raise RuntimeError("no free port pairs in 20000-22699 / 30000-32699")


def _ask(port: int, command: bytes, timeout: float = 0.5) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(command)
        return s.recv(4096)


class PrivateRedisCluster:
    """`count` primaries on loopback, slots spread by `redis-cli --cluster create`."""

    def __init__(self, count: int = 3) -> None:
        if shutil.which("redis-server") is None or shutil.which("redis-cli") is None:
            pytest.skip("redis-server / redis-cli are not installed")
        self.ports = _cluster_ports(count)
        self.procs: list[subprocess.Popen[bytes]] = []
        self.tmpdir: str | None = None

    @property
    def url(self) -> str:
        """The store URL of this cluster (`redis+cluster://`, every node a seed)."""
        return "redis+cluster://" + ",".join(f"127.0.0.1:{p}" for p in self.ports)

    @property
    def seed(self) -> tuple[str, int]:
        return "127.0.0.1", self.ports[0]

    def __repr__(self) -> str:
        return f"PrivateRedisCluster(ports={self.ports}, running={bool(self.procs)})"

    def start(self) -> None:
        self.tmpdir = tempfile.mkdtemp(prefix="dr-cluster-")
        try:
            for port in self.ports:
                self.procs.append(self._spawn(port))
            for port in self.ports:
                self._wait(port, b"PING\r\n", b"+PONG")
            create = ["redis-cli", "--cluster", "create"]
            create += [f"127.0.0.1:{p}" for p in self.ports]
            create += ["--cluster-replicas", "0", "--cluster-yes"]
            subprocess.run(create, check=True, timeout=30, capture_output=True)
            # `create` returns once the nodes agree on the slots; each node declares the
            # cluster usable a moment later.
            for port in self.ports:
                self._wait(port, b"CLUSTER INFO\r\n", b"cluster_state:ok")
        except BaseException:
            self.stop()
            raise

    def _spawn(self, port: int) -> subprocess.Popen[bytes]:
        assert self.tmpdir is not None
        argv = ["redis-server", "--port", str(port), "--bind", "127.0.0.1"]
        argv += ["--cluster-enabled", "yes"]
        argv += ["--cluster-config-file", os.path.join(self.tmpdir, f"nodes-{port}.conf")]
        argv += ["--dir", self.tmpdir, "--save", "", "--appendonly", "no", "--logfile", ""]
        return subprocess.Popen(
            argv,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # its own process group: no terminal signal reaches it
            preexec_fn=die_with_parent,
        )

    def _wait(self, port: int, command: bytes, expect: bytes) -> None:
        deadline = time.monotonic() + 15.0
        while time.monotonic() < deadline:
            try:
                if expect in _ask(port, command):
                    return
            except OSError:
                pass
            time.sleep(0.02)
        raise RuntimeError(f"redis node on port {port} never answered {expect!r}")

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=10)
        self.procs = []
        if self.tmpdir is not None:
            shutil.rmtree(self.tmpdir, ignore_errors=True)
            self.tmpdir = None


_SHARED: PrivateRedisCluster | None = None


def shared_cluster() -> PrivateRedisCluster:
    """The session's one cluster, started on first use and stopped when the interpreter exits
    (a session fixture imported into two modules would otherwise start one per module)."""
    global _SHARED
    if _SHARED is None:
        cluster = PrivateRedisCluster()
        cluster.start()
        atexit.register(cluster.stop)
        _SHARED = cluster
    return _SHARED


@pytest.fixture(scope="session")
def redis_cluster() -> PrivateRedisCluster:
    return shared_cluster()
