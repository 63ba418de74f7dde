"""The process entry: `disagg-router serve | worker | demo | bench | simulate`.

Only this module knows about uvloop, signals and the aiohttp runner.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from router.config import Timeouts

__all__ = ["main", "run_app_until_signal"]


def _use_uvloop() -> None:
    try:
        import uvloop
    except ImportError:  # not on this platform: the default loop works, only slower
        return
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())


async def run_app_until_signal(
    app: Any,
    host: str,
    port: int,
    *,
    timeouts: Timeouts | None = None,
    backlog: int = 4096,
    on_ready: Callable[[list[Any]], None] | None = None,
) -> None:
    """Serve `app` until SIGINT/SIGTERM, then shut down gracefully (streams drain first).

    The server bounds the client side (router/server.py): head, body, idle and stall timeouts.
    """
    from router.config import Timeouts
    from router.server import serving

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    async with serving(
        app, host, port, timeouts or Timeouts(), shutdown_timeout=10.0, backlog=backlog
    ) as runner:
        if on_ready is not None:
            on_ready(runner.addresses)
        await stop.wait()


def _serve(ns: argparse.Namespace) -> int:
    from router.app import create_app
    from router.config import ConfigError, load_settings

    overrides = {
        "host": ns.host,
        "port": ns.port,
        "redis_url": ns.redis_url,
        "policy": ns.policy,
        "estimator": ns.estimator,
    }
    from router.logs import configure_logging, secrets_of

    try:
        settings = load_settings(ns.config, env=os.environ, overrides=overrides)
    except (ConfigError, ValueError) as exc:
        print(f"disagg-router: {exc}", file=sys.stderr)
        return 2
    # Now that the secrets are known, they are scrubbed from every line.
    configure_logging(ns.log_level, ns.log_format, secrets=secrets_of(settings))
    if settings.tracing:
        from router.tracing import configure_sdk

        configure_sdk()
    try:
        app = create_app(settings)
    except (ConfigError, ValueError) as exc:
        print(f"disagg-router: {exc}", file=sys.stderr)
        return 2

    def ready(addresses: list) -> None:  # type: ignore[type-arg]
        store = settings.redis_url or "in-process store (single replica)"
        print(
            f"disagg-router serving on http://{settings.host}:{addresses[0][1]} "
            f"policy={settings.policy} estimator={settings.estimator} state={store}",
            flush=True,
        )

    _raise_open_files_limit()
    _use_uvloop()
    asyncio.run(
        run_app_until_signal(
            app,
            settings.host,
            settings.port,
            timeouts=settings.timeouts,
            backlog=settings.listen_backlog,
            on_ready=ready,
        )
    )
    return 0


def _raise_open_files_limit() -> None:
    """Each stream holds a client socket and a decode-worker socket: the common default of
    1,024 open files would cap a router near 500 streams. Raise the soft limit to the hard one
    (what the operator allows), as servers do."""
    try:
        import resource
    except ImportError:  # not on this platform
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError):
            pass  # keep what we have


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="disagg-router", description=__doc__)
    parser.add_argument("--log-level", default=os.environ.get("DISAGG_ROUTER_LOG_LEVEL", "INFO"))
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the router")
    serve.add_argument("--config", help="cluster.yaml")
    serve.add_argument("--host")
    serve.add_argument("--port", type=int)
    serve.add_argument("--redis-url", dest="redis_url")
    serve.add_argument("--policy")
    serve.add_argument("--estimator")
    serve.add_argument(
        "--log-format",
        choices=("json", "text"),
        default=os.environ.get("DISAGG_ROUTER_LOG_FORMAT", "json"),
        help="json (one object a line, the default for serve) or text",
    )

    from sim.worker import add_worker_arguments

    add_worker_arguments(sub.add_parser("worker", help="run a simulated GPU worker"))

    from router.demo import add_demo_arguments

    add_demo_arguments(sub.add_parser("demo", help="a local cluster, real trace traffic, a report"))

    from bench.cli import add_bench_arguments

    add_bench_arguments(sub.add_parser("bench", help="replay a trace against an endpoint"))

    try:
        from sim.cluster_cli import add_simulate_arguments
    except ImportError:
        pass
    else:
        add_simulate_arguments(sub.add_parser("simulate", help="discrete-event cluster simulator"))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)
    from router.logs import configure_logging

    configure_logging(ns.log_level, "text")  # `serve` sets its own format once it has settings
    if ns.command == "serve":
        return _serve(ns)
    if ns.command == "worker":
        from sim.worker import config_from_args, run_worker

        _use_uvloop()
        run_worker(config_from_args(ns))
        return 0
    if ns.command == "demo":
        from router.demo import run_demo

        _use_uvloop()
        return asyncio.run(run_demo(ns))
    if ns.command == "bench":
        from bench.cli import run_bench

        _use_uvloop()
        return asyncio.run(run_bench(ns))
    if ns.command == "simulate":
        from sim.cluster_cli import run_simulate

        try:
            return run_simulate(ns)
        except ValueError as exc:  # a bad policy, trace or cluster shape: say so, no traceback
            print(f"disagg-router: {exc}", file=sys.stderr)
            return 2
    parser.error(f"unknown command {ns.command}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
