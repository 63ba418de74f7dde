"""What the benchmark-client recipes share (scripts/aiperf_recipe.py, scripts/vllm_bench_recipe.py).

Each recipe starts `disagg-router demo --serve` and then one simulated worker, runs a client that
users already know against each, and prints the two runs side by side. The start-up, the offline
environment for the client and the table are the same whatever the client is, so they live here.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

# The stdout lines that carry the URL once each server listens.
DEMO_READY = "router: http://"
WORKER_READY = "listening on http://"


def entry() -> list[str]:
    """The `disagg-router` command of the interpreter running this script."""
    script = Path(sys.executable).with_name("disagg-router")
    return [str(script)] if script.exists() else [sys.executable, "-m", "router.edge.serve_cli"]


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


def add_cluster_args(parser: argparse.ArgumentParser, *, pools: int) -> None:
    """The options both recipes take for what they start: `pools` prefill and as many decode
    workers behind the router by default, and the simulated GPUs' speed."""
    parser.add_argument("--time-scale", type=float, default=10.0, help="simulated GPU speed-up")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--prefill", type=int, default=pools, help="prefill workers (router leg)")
    parser.add_argument("--decode", type=int, default=pools, help="decode workers (router leg)")
    parser.add_argument("--model", default="llama-3-8b", help="the model name the router serves")


def check_cluster_args(parser: argparse.ArgumentParser, ns: argparse.Namespace) -> None:
    if ns.prefill < 1 or ns.decode < 1:
        parser.error("--prefill and --decode need at least one worker each")


LegRun = Callable[[str, Path, str], dict[str, Any]]


def run_both(ns: argparse.Namespace, out: Path, leg: LegRun) -> tuple[Any, Any, dict[str, float]]:
    """`leg(url, out_dir, name)` against the router (`demo --serve`) and then against one
    `both` worker directly, one after the other; their results and the 1-minute load average
    at the start and after each leg."""
    scale = ["--time-scale", f"{ns.time_scale:g}"]
    pools = ["--prefill", str(ns.prefill), "--decode", str(ns.decode)]
    demo = [*entry(), "demo", "--serve", "--port", "0", "--model", ns.model, *pools, *scale]
    worker = [*entry(), "worker", "--role", "both", "--port", "0", "--model", ns.model, *scale]
    load = {"start": _load()}
    with started(demo, DEMO_READY, out / "demo.log") as router_url:
        router = leg(router_url, out / "router", "router")
    load["after_router"] = _load()
    with started(worker, WORKER_READY, out / "worker.log") as worker_url:
        direct = leg(worker_url, out / "direct", "direct")
    load["after_direct"] = _load()
    return router, direct, load


def _load() -> float:
    return round(os.getloadavg()[0], 2)
