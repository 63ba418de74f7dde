"""The services of docker-compose.yml as local processes on loopback, for machines without a
Docker engine (tests/system/test_compose.py, tests/system/test_prometheus.py).

The file is read as Compose reads it (`yaml.safe_load` resolves the `<<: *anchor` merges) and
each service is mapped, not re-described, so what runs is what the file says:

- **network**: every service name is a host name that resolves to 127.0.0.1, and each port a
  service listens on inside its container gets a free loopback port of its own. Any
  `service:port` in an argument, an environment value or a mounted file is rewritten to
  `127.0.0.1:<its port>`; one that names no listening service is an error in the file.
- **our image** (`build: .`): the Dockerfile's ENTRYPOINT, from this interpreter's bin directory
  (`.venv/bin/disagg-router`), with the service's `command`; `--host 0.0.0.0` binds 127.0.0.1
  and `--port N` the mapped port. The environment is the service's own, over a bare PATH/HOME:
  nothing of the test process leaks in. The working directory is an empty temporary one.
- **volumes**: a bind-mounted file or directory is a rewritten temporary copy (callers may edit
  it further: `edits`), and an argument naming the container path names the copy.
- **redis** (`image: redis:*`): the local `redis-server` with the service's command, on its port.
- **prometheus** (`image: prom/prometheus:*`): the local `prometheus` binary with the mounted
  configuration, a temporary TSDB and the mapped listen address.
- **healthcheck**: the `CMD` test is run locally until it passes (`python` is this interpreter,
  `redis-cli` is pointed at the service's port, `127.0.0.1:<container port>` is the service's
  own), and `depends_on` orders the start: a service starts once what it depends on is healthy.

Every process runs in its own process group, dies with the test process (PR_SET_PDEATHSIG) and
is stopped at the end (SIGTERM, then SIGKILL), its output kept in a log for failure messages.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from tests.conftest import free_port
from tests.redis_cluster import die_with_parent

__all__ = ["ComposeCluster", "ComposeError", "load_compose", "ROOT"]

ROOT = Path(__file__).resolve().parent.parent
COMPOSE_FILE = ROOT / "docker-compose.yml"
# Where the upstream images listen (their documented defaults); ours say `--port`.
_IMAGE_PORTS = {"redis": 6379, "prom/prometheus": 9090, "grafana/grafana": 3000}
_BIN = Path(sys.executable).parent


class ComposeError(AssertionError):
    """The compose file says something that cannot run as written."""


def load_compose(path: Path = COMPOSE_FILE) -> dict[str, dict[str, Any]]:
    """The services, merges resolved; `x-` extension keys dropped as Compose does."""
    doc = yaml.safe_load(path.read_text())
    services = doc.get("services")
    if not isinstance(services, dict) or not services:
        raise ComposeError(f"{path}: no services")
    return services


def _image_name(service: Mapping[str, Any]) -> str | None:
    image = service.get("image")
    return None if image is None else str(image).rsplit(":", 1)[0]


def _entrypoint(build_context: Path) -> list[str]:
    """The Dockerfile's exec-form ENTRYPOINT."""
    for line in (build_context / "Dockerfile").read_text().splitlines():
        if line.strip().upper().startswith("ENTRYPOINT"):
            value = json.loads(line.split(None, 1)[1])
            if not isinstance(value, list) or not value:
                raise ComposeError("the Dockerfile's ENTRYPOINT is not an exec-form list")
            return [str(v) for v in value]
    raise ComposeError("the Dockerfile has no ENTRYPOINT")


def _flag(argv: list[str], name: str) -> str | None:
    for i, arg in enumerate(argv):
        if arg == name and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    return None


def _container_port(name: str, service: Mapping[str, Any]) -> int | None:
    """The port the service listens on inside its container."""
    if "build" in service:
        port = _flag([str(a) for a in service.get("command", [])], "--port")
        if port is None:
            raise ComposeError(f"service {name}: our image needs --port in its command")
        return int(port)
    image = _image_name(service)
    return _IMAGE_PORTS.get(image or "")


def _duration_s(value: object, default: float) -> float:
    if value is None:
        return default
    m = re.fullmatch(r"(\d+(?:\.\d+)?)(ms|s|m)", str(value))
    if m is None:
        raise ComposeError(f"unreadable duration {value!r}")
    return float(m[1]) * {"ms": 0.001, "s": 1.0, "m": 60.0}[m[2]]


def _signal_group(proc: subprocess.Popen[bytes], sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)  # its own session: the group id is its pid
    except ProcessLookupError:
        pass


@dataclass
class _Running:
    name: str
    argv: list[str]
    proc: subprocess.Popen[bytes]
    log: Path


@dataclass
class ComposeCluster:
    """Start `services` (default: every service we can map) of the compose file under `tmp`.

    `edits` maps a mounted file's path relative to the repository (`deploy/cluster.yaml`) to a
    function applied to its already rewritten text.
    """

    tmp: Path
    services: Iterable[str] | None = None
    edits: Mapping[str, Callable[[str], str]] = field(default_factory=dict)
    compose_file: Path = COMPOSE_FILE
    start_timeout_s: float = 60.0
    spec: dict[str, dict[str, Any]] = field(init=False)
    ports: dict[str, int] = field(init=False)  # service -> its loopback port
    container_ports: dict[str, int] = field(init=False)
    running: dict[str, _Running] = field(init=False, default_factory=dict)
    argv: dict[str, list[str]] = field(init=False, default_factory=dict)
    env: dict[str, dict[str, str]] = field(init=False, default_factory=dict)
    mounts: dict[str, Path] = field(init=False, default_factory=dict)  # repo-relative -> copy

    def __post_init__(self) -> None:
        self.spec = load_compose(self.compose_file)
        self.container_ports = {}
        for name, service in self.spec.items():
            port = _container_port(name, service)
            if port is not None:
                self.container_ports[name] = port
        self.ports = {name: free_port() for name in self.container_ports}
        wanted = list(self.spec) if self.services is None else list(self.services)
        unknown = set(wanted) - set(self.spec)
        if unknown:
            raise ValueError(f"no such services: {sorted(unknown)}")
        self.services = wanted
        names = sorted(self.spec, key=len, reverse=True)  # "redis" must not eat "redis-x"
        self._host_re = re.compile(r"(?<![\w.-])(" + "|".join(map(re.escape, names)) + r"):(\d+)")

    def __repr__(self) -> str:
        return f"ComposeCluster(running={sorted(self.running)}, ports={self.ports})"

    # -- the mapping ---------------------------------------------------------------------------
    def rewrite(self, text: str, own: str | None = None) -> str:
        """`service:port` → `127.0.0.1:<mapped>`; with `own`, also that service's
        `127.0.0.1|localhost:<container port>` (a healthcheck runs inside its container)."""

        def other(m: re.Match[str]) -> str:
            host, port = m[1], int(m[2])
            if self.container_ports.get(host) != port:
                raise ComposeError(f"{m[0]!r}: service {host} does not listen on {port}")
            return f"127.0.0.1:{self.ports[host]}"

        text = self._host_re.sub(other, text)
        if own is not None and own in self.container_ports:
            own_re = rf"(?:127\.0\.0\.1|localhost):{self.container_ports[own]}(?!\d)"
            text = re.sub(own_re, f"127.0.0.1:{self.ports[own]}", text)
        return text

    def url(self, service: str) -> str:
        return f"http://127.0.0.1:{self.ports[service]}"

    def _mount(self, name: str, volume: str) -> tuple[str, Path]:
        """One `./src:/dst[:ro]` bind mount → (container path, local rewritten copy)."""
        parts = volume.split(":")
        if len(parts) not in (2, 3) or not parts[0].startswith("./"):
            raise ComposeError(f"service {name}: only ./relative bind mounts map: {volume!r}")
        rel, dst = parts[0][2:], parts[1]
        src = ROOT / rel
        if not src.exists():
            raise ComposeError(f"service {name}: mount source {rel} does not exist")
        if rel not in self.mounts:
            copy = self.tmp / "mounts" / rel
            files = [src] if src.is_file() else sorted(p for p in src.rglob("*") if p.is_file())
            for f in files:
                rel_f = f.relative_to(ROOT).as_posix()
                out = self.tmp / "mounts" / rel_f
                out.parent.mkdir(parents=True, exist_ok=True)
                text = self.rewrite(f.read_text())
                if rel_f in self.edits:
                    text = self.edits[rel_f](text)
                out.write_text(text)
            self.mounts[rel] = copy
        return dst, self.mounts[rel]

    def _localise(self, name: str, argv: list[str], mounts: list[tuple[str, Path]]) -> list[str]:
        out: list[str] = []
        for arg in argv:
            arg = self.rewrite(str(arg))
            for dst, local in mounts:
                if arg == dst or arg.startswith(dst + "/"):
                    arg = str(local) + arg[len(dst) :]
                elif "=" in arg and arg.split("=", 1)[1].startswith(dst):
                    key, value = arg.split("=", 1)
                    arg = f"{key}={local}{value[len(dst) :]}"
            out.append(arg)
        port = self.ports.get(name)
        for i, arg in enumerate(out[:-1]):
            if arg == "--host" and out[i + 1] == "0.0.0.0":
                out[i + 1] = "127.0.0.1"
            elif arg == "--port" and port is not None:
                out[i + 1] = str(port)
        return out

    def _command(self, name: str) -> tuple[list[str], dict[str, str]]:
        service = self.spec[name]
        mounts = [self._mount(name, str(v)) for v in service.get("volumes", [])]
        env_spec = service.get("environment") or {}
        if isinstance(env_spec, list):  # the KEY=VALUE list form
            env_spec = dict(str(e).split("=", 1) for e in env_spec)
        home = self.tmp / "home" / name
        home.mkdir(parents=True, exist_ok=True)
        env = {"PATH": f"{_BIN}:/usr/local/bin:/usr/bin:/bin", "HOME": str(home), "LANG": "C.UTF-8"}
        env.update({str(k): self.rewrite(str(v)) for k, v in env_spec.items()})
        command = [str(a) for a in service.get("command", [])]
        image = _image_name(service)
        port = self.ports.get(name)
        if "build" in service:
            if service["build"] not in (".", "./"):
                raise ComposeError(f"service {name}: only `build: .` is mapped")
            entry = _entrypoint(ROOT)
            argv = [str(_BIN / entry[0]), *entry[1:], *command]
        elif image == "redis":
            binary = shutil.which("redis-server")
            if binary is None or command[:1] != ["redis-server"]:
                raise ComposeError(f"service {name}: needs redis-server and a redis-server command")
            argv = [binary, *command[1:], "--port", str(port), "--bind", "127.0.0.1"]
            argv += ["--dir", str(home), "--logfile", ""]
        elif image == "prom/prometheus":
            binary = shutil.which("prometheus")
            if binary is None:
                raise ComposeError("the prometheus binary is not installed")
            # The image's own default command, with its mount and port mapped here.
            config = next((loc for dst, loc in mounts if dst.endswith("prometheus.yml")), None)
            if config is None:
                raise ComposeError(f"service {name}: no prometheus.yml mounted")
            tsdb = self.tmp / "tsdb" / name
            tsdb.mkdir(parents=True, exist_ok=True)
            argv = [binary, f"--config.file={config}", f"--storage.tsdb.path={tsdb}"]
            argv += [f"--web.listen-address=127.0.0.1:{port}", *command]
            return self._localise(name, argv, mounts), env
        else:
            raise ComposeError(f"service {name}: image {image!r} has no local mapping")
        return self._localise(name, argv, mounts), env

    # -- health --------------------------------------------------------------------------------
    def _healthy_once(self, name: str) -> bool:
        check = self.spec[name].get("healthcheck")
        if not check:
            return True
        test = [str(t) for t in check["test"]]
        if test[0] != "CMD":
            raise ComposeError(f"service {name}: only exec-form CMD healthchecks map")
        argv = [self.rewrite(t, own=name) for t in test[1:]]
        if argv[0] == "python":
            argv[0] = sys.executable
        elif argv[0] == "redis-cli":
            argv[1:1] = ["-h", "127.0.0.1", "-p", str(self.ports[name])]
        timeout = _duration_s(check.get("timeout"), 30.0)
        try:
            done = subprocess.run(argv, capture_output=True, timeout=max(timeout, 5.0))
        except subprocess.TimeoutExpired:
            return False
        if done.returncode != 0:
            return False
        # redis-cli exits 0 on an error reply ("LOADING ...") too: want the PONG.
        return test[1] != "redis-cli" or b"PONG" in done.stdout

    def wait_healthy(self, name: str) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            run = self.running[name]
            if run.proc.poll() is not None:
                raise ComposeError(
                    f"service {name} exited {run.proc.returncode}:\n{self.tail(name)}"
                )
            if self._healthy_once(name):
                return
            time.sleep(0.1)
        raise ComposeError(f"service {name} never became healthy:\n{self.tail(name)}")

    def tail(self, name: str, chars: int = 3000) -> str:
        run = self.running.get(name)
        return "" if run is None else run.log.read_text(errors="replace")[-chars:]

    # -- start and stop ------------------------------------------------------------------------
    def _order(self) -> list[str]:
        assert self.services is not None
        order: list[str] = []
        visiting: set[str] = set()

        def visit(name: str) -> None:
            if name in order:
                return
            if name in visiting:
                raise ComposeError(f"depends_on cycle through {name}")
            visiting.add(name)
            deps = self.spec[name].get("depends_on") or []
            for dep in deps if isinstance(deps, list) else list(deps):
                if dep not in self.spec:
                    raise ComposeError(f"service {name} depends on unknown service {dep}")
                visit(dep)
            visiting.discard(name)
            order.append(name)

        for name in self.services:
            visit(name)
        return order

    def start(self) -> None:
        (self.tmp / "logs").mkdir(parents=True, exist_ok=True)
        try:
            for name in self._order():
                argv, env = self._command(name)
                self.argv[name], self.env[name] = argv, env
                log = self.tmp / "logs" / f"{name}.log"
                with log.open("wb") as out:
                    proc = subprocess.Popen(
                        argv,
                        env=env,
                        cwd=self.tmp / "home" / name,
                        stdout=out,
                        stderr=subprocess.STDOUT,
                        stdin=subprocess.DEVNULL,
                        start_new_session=True,
                        preexec_fn=die_with_parent,
                    )
                self.running[name] = _Running(name, argv, proc, log)
                # Compose waits only for `condition: service_healthy`; waiting for every
                # healthcheck is stricter and orders the logs.
                self.wait_healthy(name)
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        for run in reversed(list(self.running.values())):
            if run.proc.poll() is None:
                _signal_group(run.proc, signal.SIGTERM)  # graceful: a router drains
        for run in reversed(list(self.running.values())):
            try:
                run.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                _signal_group(run.proc, signal.SIGKILL)
                run.proc.wait(timeout=10)
        self.running.clear()

    def __enter__(self) -> ComposeCluster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
