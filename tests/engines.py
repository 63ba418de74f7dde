"""A real engine's server as a child process group on loopback, for the suites that start real
engines (tests/real_vllm, tests/real_sglang): started with its log in a work directory, waited
for, probed, killed or stopped with everything it spawned, its Prometheus metrics read.

`EngineProcess` is a mixin: the suite's dataclass gives `name`, `workdir`, `port`, `proc`,
`started_at`, `ready_after_s`, and `command()` / `environment()`."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

__all__ = ["EngineProcess", "EngineSuite", "http_get", "http_post_json"]


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL when the test process dies, however it dies, so no
    orphaned engine keeps busy-polling a core (Linux prctl PR_SET_PDEATHSIG)."""
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)


def http_get(url: str, timeout: float = 5.0) -> tuple[int, bytes]:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(url, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def http_post_json(url: str, body: dict[str, Any], timeout: float) -> tuple[int, Any]:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with opener.open(request, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


@dataclass(frozen=True)
class EngineSuite:
    """A package of tests against one real engine: where its prepared environment is, whether it
    is there (else every test skips with one line saying how to prepare it), and the marker and
    timeout each of its tests gets. `label` names it ("vLLM": the switch REAL_VLLM, the script
    scripts/prepare_real_vllm.sh)."""

    label: str
    here: Path  # the package's directory
    home: Path  # the prepared environment: venv/ and model/, each with a .ready stamp
    timeout_s: int

    @property
    def switch(self) -> str:
        return f"REAL_{self.label.upper()}"

    @property
    def python(self) -> Path:
        return self.home / "venv" / "bin" / "python"

    @property
    def model_dir(self) -> Path:
        return self.home / "model"

    def missing_reason(self) -> str | None:
        script = f"scripts/prepare_real_{self.label.lower()}.sh"
        if os.environ.get(self.switch, "").strip() == "0":
            return f"{self.switch}=0"
        if not (self.python.exists() and (self.home / "venv" / ".ready").exists()):
            return (
                f"the real-{self.label} venv is not prepared at {self.home / 'venv'}: "
                f"run {script} (or set {self.switch}_HOME)"
            )
        if not (self.model_dir / ".ready").exists():
            return f"the tiny model is not built at {self.model_dir}: run {script}"
        return None

    def mark(self, items: list[pytest.Item]) -> None:
        """Its tests get the suite's marker and timeout, and are skipped with the reason when
        the environment is missing (the package's `pytest_collection_modifyitems`)."""
        reason = self.missing_reason()
        marker = getattr(pytest.mark, self.switch.lower())
        for item in items:
            if self.here not in Path(str(item.path)).parents:
                continue
            item.add_marker(marker)
            item.add_marker(pytest.mark.timeout(self.timeout_s))
            if reason is not None:
                item.add_marker(pytest.mark.skip(reason=f"real {self.label}: {reason}"))


class EngineProcess:
    """The process plumbing of one engine server (see the module docstring)."""

    KIND = "engine"  # for messages: "vLLM server", "SGLang server"
    # Log lines that never explain a failure (probes, start-up warnings every engine logs).
    ROUTINE: tuple[str, ...] = ('"GET /health', '"GET /metrics')

    name: str
    workdir: Path
    port: int
    proc: subprocess.Popen[bytes] | None
    started_at: float
    ready_after_s: float | None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.workdir / f"{self.name}.log"

    def command(self) -> list[str]:
        raise NotImplementedError

    def environment(self) -> dict[str, str]:
        raise NotImplementedError

    def start(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                self.command(),
                env=self.environment(),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                cwd=self.workdir,
                preexec_fn=_die_with_parent,
            )
        self.started_at = time.monotonic()
        self.ready_after_s = None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def healthy(self) -> bool:
        try:
            return self.alive() and http_get(self.url + "/health", timeout=2.0)[0] == 200
        except OSError:
            return False

    def answers_health(self, within_s: float = 30.0) -> bool:
        """Healthy now or within `within_s` (a loaded machine can be slow to answer once)."""
        deadline = time.monotonic() + within_s
        while self.alive():
            if self.healthy():
                return True
            if time.monotonic() > deadline:
                return False
            time.sleep(1.0)
        return False

    def log_excerpt(self, errors: int = 30, tail: int = 15) -> str:
        """What explains a failure: the log's error lines and its last lines."""
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        lines = [ln for ln in lines if not any(q in ln for q in self.ROUTINE)]
        marks = ("ERROR", "Error", "Traceback", "WARNING", "Killed", "dead", "timed out")
        flagged = [ln for ln in lines[:-tail] if any(m in ln for m in marks)][-errors:]
        return "\n".join([*flagged, "...", *lines[-tail:]])

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def wait_ready(self, deadline: float) -> None:
        while time.monotonic() < deadline:
            if not self.alive():
                raise RuntimeError(
                    f"{self.KIND} {self.name} exited "
                    f"(code {self.proc.returncode if self.proc else None}):\n"
                    f"{self.log_tail()}"
                )
            if self.healthy():
                self.ready_after_s = time.monotonic() - self.started_at
                return
            time.sleep(0.5)
        raise RuntimeError(f"{self.KIND} {self.name} not ready in time:\n{self.log_tail()}")

    def signal_group(self, sig: signal.Signals) -> None:
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, sig)

    def kill(self) -> None:
        """A crash: SIGKILL to the server and its engine process."""
        self.signal_group(signal.SIGKILL)
        if self.proc is not None:
            self.proc.wait(timeout=30)

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.signal_group(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
        # The engine core is a child in the same group: make sure nothing is left behind.
        self.signal_group(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)

    def metrics(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        status, data = http_get(self.url + "/metrics", timeout=10.0)
        assert status == 200, f"{self.name} /metrics answered {status}"
        out = {}
        for family in text_string_to_metric_families(data.decode()):
            for s in family.samples:
                labels = tuple(
                    sorted((k, v) for k, v in s.labels.items() if k not in ("engine", "model_name"))
                )
                out[(s.name, labels)] = s.value
        return out

    def metric(self, name: str, **labels: str) -> float:
        key = (name, tuple(sorted(labels.items())))
        return self.metrics().get(key, 0.0)
