"""What the benchmark-client recipes share (scripts/aiperf_recipe.py, scripts/vllm_bench_recipe.py).

Each recipe starts `disagg-router demo --serve` and then one simulated worker, runs a client that
users already know against each, and prints the two runs side by side. The start-up, the offline
environment for the client and the table are the same whatever the client is, so they live here.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

# The stdout lines that carry the URL once each server listens.
DEMO_READY = "router: http://"
WORKER_READY = "listening on http://"


def entry() -> list[str]:
    """The `disagg-router` command of the interpreter running this script."""
    script = Path(sys.executable).with_name("disagg-router")
    return [str(script)] if script.exists() else [sys.executable, "-m", "router.cli"]


def offline_env() -> dict[str, str]:
    """This process's environment, with every way to reach the hub closed."""
    env = dict(os.environ)
    # A closed loopback port: any hub request fails at once instead of leaving the machine.
    env.update(HF_ENDPOINT="http://127.0.0.1:9", NO_PROXY="*", no_proxy="*")
    env.update(HF_HUB_DISABLE_TELEMETRY="1", DO_NOT_TRACK="1")
    for key in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy", "ALL_PROXY"):
        env.pop(key, None)
    return env


@contextlib.contextmanager
def started(cmd: list[str], marker: str, log: Path) -> Iterator[str]:
    """Run `cmd` until the block ends; yield the first URL on the stdout line with `marker`."""
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}  # the demo's own Redis
    with log.open("w") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, env=env)
    try:
        assert proc.stdout is not None
        deadline = time.monotonic() + 60
        url = ""
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            if marker in line:
                url = next(w for w in line.split() if w.startswith("http://")).rstrip("/")
                break
        if not url:
            raise RuntimeError(f"{' '.join(cmd)} did not start; see {log}")
        wait_ok(url + "/health")
        yield url
    finally:
        proc.send_signal(signal.SIGINT)  # both shut down cleanly on Ctrl-C
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def wait_ok(url: str) -> None:
    for _ in range(100):
        with contextlib.suppress(OSError):
            with urllib.request.urlopen(url, timeout=2) as resp:  # noqa: S310 - loopback
                if resp.status == 200:
                    return
        time.sleep(0.1)
    raise RuntimeError(f"{url} never answered 200")


def added_row(router: float | None, direct: float | None) -> dict[str, Any]:
    """One table row: both legs and what the router adds (None where a leg lacks the value)."""
    added = None if router is None or direct is None else round(router - direct, 3)
    return {"router_ms": router, "direct_ms": direct, "added_ms": added}


def print_table(table: dict[str, Any]) -> None:
    """Rows of `added_row`, one metric a line: router, direct, added (ms)."""
    print(f"{'metric (ms)':<28}{'router':>10}{'direct':>10}{'added':>10}")
    for name, row in table.items():
        cells = [f"{v:>10.2f}" if v is not None else f"{'-':>10}" for v in row.values()]
        print(f"{name:<28}{''.join(cells)}")
