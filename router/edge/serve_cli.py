"""The router's own entry: `disagg-router serve` (and `python -m router.edge.serve_cli serve`).

`add_serve_arguments` defines serve's options, `serve` runs the router until SIGTERM; the
umbrella command (`disagg_tools/launcher/main.py`: serve | worker | demo | bench | simulate) mounts
both.
Only this module knows about signals, the open-files limit and the aiohttp runner.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import signal
import sys
import traceback
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from router.config import Timeouts

__all__ = ["add_serve_arguments", "main", "run_app_until_signal", "serve"]


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

    The server bounds the client side (router/edge/server.py): head, body, idle and stall timeouts.
    """
    from router.config import Timeouts
    from router.edge.server import serving

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


def serve(ns: argparse.Namespace) -> int:
    """Run the router with the options `add_serve_arguments` defined; the exit code."""
    from router.config import ConfigError
    from router.edge.app import create_app
    from router.edge.dropin import load_serve_settings

    # The flags keep the peers' names (vllm-router, sglang-router); they set the new fields.
    overrides = {
        "server": {"host": ns.host, "port": ns.port},
        "store": {"url": ns.redis_url},
        "policy": ns.policy,
        "estimates": {"estimator": ns.estimator},
    }
    from router.logs import configure_logging
    from router.redact import Redactor, mask_url, scrub, secrets_of
    from state import StoreError

    try:
        settings = load_serve_settings(ns, env=os.environ, overrides=overrides)
    except (ConfigError, ValueError) as exc:
        # A config error may quote a URL (a bad worker or Redis URL): credentials hidden.
        print(f"disagg-router: {scrub(str(exc))}", file=sys.stderr)
        return 2
    # Now that the secrets are known, they are scrubbed from every line.
    redact = Redactor(secrets_of(settings))
    configure_logging(ns.log_level, ns.log_format, secrets=redact.secrets)
    if settings.tracing:
        from router.tracing import configure_sdk

        configure_sdk(exporter=os.environ.get("OTEL_TRACES_EXPORTER", ""))
    try:
        app = create_app(settings)
    except (ConfigError, ValueError) as exc:
        print(f"disagg-router: {redact(str(exc))}", file=sys.stderr)
        return 2

    def ready(addresses: list) -> None:  # type: ignore[type-arg]
        store = settings.store.url or "in-process store (single replica)"
        line = (
            f"disagg-router serving on http://{settings.server.host}:{addresses[0][1]} "
            f"policy={settings.policy} estimator={settings.estimates.estimator} "
            f"state={mask_url(store)}"
        )
        print(redact(line), flush=True)
        _freeze_startup_heap()

    _raise_open_files_limit()
    try:
        with asyncio.Runner(loop_factory=_uvloop_factory()) as runner:
            runner.run(
                run_app_until_signal(
                    app,
                    settings.server.host,
                    settings.server.port,
                    timeouts=settings.timeouts,
                    backlog=settings.server.listen_backlog,
                    on_ready=ready,
                )
            )
    except (StoreError, ValueError) as exc:
        # At start-up: Redis silent, or its URL unusable. One line, credentials masked.
        print(f"disagg-router: {redact(str(exc))}", file=sys.stderr)
        return 1
    except Exception:
        # Python's own traceback printer knows no secrets: this one is scrubbed.
        print(redact(traceback.format_exc()), file=sys.stderr, end="")
        return 1
    return 0


def _uvloop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's loop, or asyncio's default where uvloop is not installed (slower, same
    behaviour). The router's own choice, not `uvrun`'s: the product imports only `policies` and
    `state` (docs/design.md §9); the tools share `uvrun`, which makes the same choice."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


# Full (generation-2) collections every this many generation-1 ones (CPython's default: 10).
GC_GEN2_EVERY = 100


def _freeze_startup_heap() -> None:
    """Once serving: what start-up built (modules, the app, settings: ~72k objects) moves to
    the permanent generation, and full collections become ten times rarer.

    Why (issue 24, "The tail"): a full collection walks every tracked object with the event
    loop held, and every stream's next token waits. Measured in the router at 256 streams
    with Redis (gc.callbacks; SCHED_RR, so wall = CPU): one full collection every ~26 s, each
    65-91 ms over ~104k objects; a measured round with one had added TTFT p99.9 +70 to
    +89 ms, one without +37 ms or less. Frozen, a full collection walks only what start-up
    did not build (33-46 ms); with both, none came in 8 measured rounds. The cost: cyclic
    garbage that reaches generation 2 (0-235 objects per full collection there) waits ten
    times longer; request garbage is still found by generations 0 and 1, whose thresholds are
    unchanged, and start-up objects live as long as the process anyway."""
    gc.collect()
    gc.freeze()
    gen0, gen1, _ = gc.get_threshold()
    gc.set_threshold(gen0, gen1, GC_GEN2_EVERY)


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


def add_serve_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """serve's options (one place: the umbrella CLI mounts the same function)."""
    parser.add_argument("--config", help="cluster.yaml")
    parser.add_argument("--host")
    parser.add_argument("--port", type=int)
    parser.add_argument("--redis-url", dest="redis_url")
    parser.add_argument("--policy")
    parser.add_argument("--estimator")
    parser.add_argument(
        "--log-format",
        choices=("json", "text"),
        default=os.environ.get("DISAGG_ROUTER_LOG_FORMAT", "json"),
        help="json (one object a line, the default for serve) or text",
    )
    from router.edge.dropin import add_dropin_arguments

    add_dropin_arguments(parser)  # --prefill URL [PORT] / --decode URL: no file needed
    return parser


def add_log_level_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--log-level", default=os.environ.get("DISAGG_ROUTER_LOG_LEVEL", "INFO"))


def build_parser() -> argparse.ArgumentParser:
    """`[--log-level L] serve ...`: the same command line as the umbrella's serve."""
    parser = argparse.ArgumentParser(prog="python -m router.edge.serve_cli", description=__doc__)
    add_log_level_argument(parser)
    sub = parser.add_subparsers(dest="command", required=True)
    add_serve_arguments(sub.add_parser("serve", help="run the router"))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    from router.logs import configure_logging

    configure_logging(ns.log_level, "text")  # serve sets its own format once it has settings
    return serve(ns)


if __name__ == "__main__":
    sys.exit(main())
