"""`python -m disagg_tools.kubeapi --port N --pods FILE.yaml [--kubeconfig PATH]`

Runs the stand-in API server until SIGINT/SIGTERM. FILE.yaml is a list of pods, each either a
Pod manifest (`kind: Pod`, stored as written) or the short form the control surface takes:

    - name: decode-0
      namespace: default          # optional
      labels: {role: decode}
      annotations: {}
      ports: {http: 8000}         # named container ports
      phase: Running              # optional
      ready: true                 # optional
      podIP: 10.0.0.7             # optional

Prints one line, `kubeapi listening on http://HOST:PORT`, once it serves. Faults from another
process: POST /standin/faults (see disagg_tools.kubeapi.app).
"""

from __future__ import annotations

import argparse
import asyncio
import signal
from pathlib import Path
from typing import Any

import yaml

from disagg_tools import uvrun

from .kubeconfig import write_kubeconfig
from .objects import PODS
from .server import KubeApiServer, KubeApiSettings
from .watch import WatchSettings

_SHORT_KEYS = {"name", "namespace", "labels", "annotations", "ports", "phase", "ready", "podIP"}


def load_pods(server: KubeApiServer, path: Path) -> int:
    docs = yaml.safe_load(path.read_text(encoding="utf-8")) or []
    if not isinstance(docs, list):
        raise SystemExit(f"{path}: a YAML list of pods expected")
    for doc in docs:
        if not isinstance(doc, dict):
            raise SystemExit(f"{path}: each pod is a mapping, got {doc!r}")
        if doc.get("kind") == "Pod":
            server.store.create(PODS.name, doc)
            continue
        unknown = set(doc) - _SHORT_KEYS
        if unknown or "name" not in doc:
            raise SystemExit(f"{path}: pod {doc.get('name')!r}: unknown keys {sorted(unknown)}")
        server.add_pod(
            str(doc["name"]),
            namespace=str(doc.get("namespace", "default")),
            labels=doc.get("labels") or {},
            annotations=doc.get("annotations") or {},
            ports=doc.get("ports") or {},
            phase=str(doc.get("phase", "Running")),
            ready=bool(doc.get("ready", True)),
            pod_ip=doc.get("podIP"),
        )
    return len(docs)


async def serve(args: argparse.Namespace) -> None:
    settings = KubeApiSettings(
        host=args.host,
        port=args.port,
        history_size=args.history_size,
        watch=WatchSettings(bookmark_interval_s=args.bookmark_interval),
    )
    server = KubeApiServer(settings)
    if args.pods:
        load_pods(server, Path(args.pods))
    await server.start()
    if args.kubeconfig:
        write_kubeconfig(Path(args.kubeconfig), server.url)
    print(f"kubeapi listening on {server.url}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await server.stop()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m disagg_tools.kubeapi", description=__doc__.split("\n")[0]
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="0: an ephemeral port (printed)")
    p.add_argument("--pods", help="a YAML list of pods to start with")
    p.add_argument("--kubeconfig", help="write a kubeconfig for kubectl here")
    p.add_argument("--history-size", type=int, default=1000)
    p.add_argument("--bookmark-interval", type=float, default=60.0, help="seconds")
    args: Any = p.parse_args(argv)
    uvrun.run(serve(args))


if __name__ == "__main__":
    main()
