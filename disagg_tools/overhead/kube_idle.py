"""What Kubernetes discovery costs a router that nobody asks anything: CPU with 1,000 watched
pods, idle.

    python -m disagg_tools.overhead.kube_idle [--pods 1000] [--idle-s 30] [--redis-url URL]

Two `fixed_worker` engines (one prefill, one decode) stand behind every pod: the stand-in API
server (`python -m disagg_tools.kubeapi`) serves `--pods` pods, half `role=prefill` pointing at
the prefill engine's port, half `role=decode` at the decode engine's, all Ready, and as many
again NotReady under another label. Then three routers in turn, each measured over `--idle-s`
of no traffic after it serves every worker it should and `--settle-s` of quiet:

    static      the same pods' addresses as `workers:` in the file: no discovery (the baseline:
                health probes, refreshes, the registry sync of that many workers)
    discovery   `discovery.kind: kubernetes` over the Ready pods: the same workers, found by
                two list-watches (bookmarks every --bookmark-s), registered through the store
    watch-only  discovery over the NotReady pods: the watches and their reconcile, no worker

CPU is the router process's scheduler run time (/proc/<pid>/task/*/schedstat), as
`disagg_tools.overhead.idle` reads it; `discovery - static` is discovery's own cost.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from disagg_tools import uvrun
from disagg_tools.overhead.targets import fixed_worker_command, fresh_key_prefix, wait_listening
from disagg_tools.procs import HOST, Child, free_port, process_tree_run_s

__all__ = ["kube_idle", "main"]

MODEL = "llama-3-8b"


def _pods_file(path: Path, pods: int, ports: dict[str, int]) -> None:
    """`pods` Ready pods (half prefill, half decode) and as many NotReady ones."""
    docs: list[dict[str, Any]] = []
    for ready, app in ((True, "bench"), (False, "bench-nr")):
        for i in range(pods):
            role = "prefill" if i % 2 == 0 else "decode"
            docs.append({
                "name": f"{app}-{role}-{i}",
                "labels": {"app": app, "role": role, "pod-template-hash": "r1"},
                "ports": {"http": ports[role]},
                "ready": ready,
                "podIP": HOST,
            })  # fmt: skip
    path.write_text(json.dumps(docs))  # JSON is YAML


def _forget(redis_url: str, prefix: str) -> None:
    """Delete what a measured router left in Redis under its own prefix (a thousand
    registrations and their capacities)."""
    import redis

    client = redis.Redis.from_url(redis_url)
    try:
        for key in client.scan_iter(match=f"{prefix}*", count=1000):
            client.delete(key)
    finally:
        client.close()


def _config(
    kind: str, ns: argparse.Namespace, kubeconfig: Path, ports: dict[str, int], path: Path
) -> str:
    """Writes the router's config to `path`; returns its store key prefix."""
    store = {"key_prefix": fresh_key_prefix(f"kube-{kind}")}
    if ns.redis_url:
        store["url"] = ns.redis_url
    config: dict[str, Any] = {
        "model": MODEL,
        "perf": {"model": MODEL, "gpu": "h100"},
        "store": store,
        # A thousand probes at once to two engines on a shared core: a loaded machine would
        # fail some at the default 5 s and the wait for "every worker serving" never ends.
        "loops": {"health_timeout_s": 30.0},
    }
    if kind == "static":
        config["workers"] = [
            {
                "id": f"bench-{role}-{i}",
                "url": f"http://{HOST}:{ports[role]}",
                "role": role,
                **({"kv_blocks": 100000} if role == "decode" else {}),
            }
            for i in range(ns.pods)
            for role in ["prefill" if i % 2 == 0 else "decode"]
        ]
    else:
        app = "bench" if kind == "discovery" else "bench-nr"
        config["discovery"] = {
            "kind": "kubernetes",
            "kubeconfig": str(kubeconfig),
            "namespace": "default",
            "prefill_selector": f"app={app},role=prefill",
            "decode_selector": f"app={app},role=decode",
            "kv_blocks": 100000,
        }
    path.write_text(json.dumps(config))
    return store["key_prefix"]


def _serving(port: int) -> int:
    """How many workers the router at `port` has in rotation (its /admin/workers)."""
    with urllib.request.urlopen(f"http://{HOST}:{port}/admin/workers", timeout=60) as resp:
        workers = json.loads(resp.read())["workers"]
    return sum(1 for w in workers if w["healthy"] and not w["drained"] and w["layout"])


async def _wait_serving(port: int, want: int, proc: Child, timeout_s: float) -> float:
    start = time.monotonic()
    seen = -1
    while time.monotonic() - start < timeout_s:
        if not proc.alive():
            raise RuntimeError(f"{proc.name} exited:\n{proc.tail()}")
        try:
            seen = await asyncio.to_thread(_serving, port)
            if seen == want:
                return time.monotonic() - start
        except OSError:
            pass
        await asyncio.sleep(0.5)
    raise RuntimeError(f"{proc.name}: {seen} of {want} workers after {timeout_s} s:\n{proc.tail()}")


async def kube_idle(ns: argparse.Namespace, log_dir: Path) -> list[dict[str, Any]]:
    children: list[Child] = []
    try:
        ports: dict[str, int] = {}
        for role in ("prefill", "decode"):
            ports[role] = free_port()
            cmd = fixed_worker_command(role, ports[role], MODEL, interval_ms=20, prefill_ms=10)
            children.append(Child(f"kube-idle-{role}", cmd, log_dir, core=ns.load_core_))
            await wait_listening(ports[role], children[-1])
        pods, kubeconfig, api_port = log_dir / "pods.yaml", log_dir / "kubeconfig", free_port()
        _pods_file(pods, ns.pods, ports)
        api = [sys.executable, "-m", "disagg_tools.kubeapi", "--host", HOST, "--port"]
        api += [str(api_port), "--pods", str(pods), "--kubeconfig", str(kubeconfig)]
        api += ["--bookmark-interval", str(ns.bookmark_s)]
        children.append(Child("kube-idle-apiserver", api, log_dir, core=ns.load_core_))
        await wait_listening(api_port, children[-1])
        out = []
        for kind in ns.kinds:
            cfg, port = log_dir / f"{kind}.yaml", free_port()
            prefix = _config(kind, ns, kubeconfig, ports, cfg)
            cmd = [sys.executable, "-m", "router.edge.serve_cli", "--log-level", "WARNING"]
            cmd += ["serve", "--config", str(cfg), "--host", HOST, "--port", str(port)]
            router = Child(f"kube-idle-router-{kind}", cmd, log_dir, core=ns.router_core_)
            try:
                await wait_listening(port, router, timeout_s=120)
                want = 0 if kind == "watch-only" else ns.pods
                ready_s = await _wait_serving(port, want, router, timeout_s=300)
                await asyncio.sleep(ns.settle_s)
                load = os.getloadavg()[0]
                t0, r0 = time.perf_counter(), process_tree_run_s(router.pid)
                await asyncio.sleep(ns.idle_s)
                t1, r1 = time.perf_counter(), process_tree_run_s(router.pid)
                if not router.alive():
                    raise RuntimeError(f"{router.name} died:\n{router.tail()}")
            finally:
                router.stop()
                if ns.redis_url:
                    await asyncio.to_thread(_forget, ns.redis_url, prefix)
            r = {
                "kind": kind,
                "pods_watched": 0 if kind == "static" else ns.pods,
                "workers": want,
                "serving_after_s": round(ready_s, 1),
                "idle_s": round(t1 - t0, 2),
                "cpu_ms_per_s": round((r1 - r0) / (t1 - t0) * 1e3, 2),
                "loadavg_1m": round(load, 2),
            }
            print(f"[kube-idle] {r}", file=sys.stderr, flush=True)
            out.append(r)
        return out
    finally:
        for child in children:
            child.stop()


def markdown(runs: list[dict[str, Any]], ns: argparse.Namespace) -> str:
    store = "Redis" if ns.redis_url else "the in-process store"
    lines = [
        f"### Idle with {ns.pods} pods: {ns.idle_s:g} s of no traffic, {store}",
        "",
        "| router | pods watched | workers | serving all after | **router CPU ms/s** "
        "| load average (1 min) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in runs:
        lines.append(
            f"| {r['kind']} | {r['pods_watched']} | {r['workers']} | {r['serving_after_s']} s "
            f"| {r['cpu_ms_per_s']:.2f} | {r['loadavg_1m']:.2f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m disagg_tools.overhead.kube_idle",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--pods", type=int, default=1000, help="Ready pods watched (and NotReady)")
    p.add_argument("--kinds", default="static,discovery,watch-only")
    p.add_argument("--idle-s", type=float, default=30.0)
    p.add_argument("--settle-s", type=float, default=10.0)
    p.add_argument("--bookmark-s", type=float, default=60.0, help="the stand-in's bookmarks")
    p.add_argument("--redis-url", default="", help="the store (default: in-process)")
    p.add_argument("--router-core", type=int, default=0)
    p.add_argument("--load-core", type=int, default=1)
    p.add_argument("--no-pin", dest="pin", action="store_false")
    p.add_argument("--log-dir", default=None)
    ns = p.parse_args(argv)
    ns.kinds = [k.strip() for k in ns.kinds.split(",") if k.strip()]
    pin = ns.pin and len(os.sched_getaffinity(0)) >= 2
    ns.router_core_, ns.load_core_ = (ns.router_core, ns.load_core) if pin else (None, None)
    log_dir = Path(ns.log_dir or tempfile.mkdtemp(prefix="bench-kube-idle-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    with asyncio.Runner(loop_factory=uvrun.loop_factory()) as runner:
        runs = runner.run(kube_idle(ns, log_dir))
    print(markdown(runs, ns))
    return 0


if __name__ == "__main__":
    sys.exit(main())
