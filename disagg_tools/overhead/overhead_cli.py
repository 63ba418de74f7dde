"""What a router adds: TTFT, ITL and CPU against a client that does the two PD calls itself.

    python -m disagg_tools.overhead [--targets baseline,ours,ours_dropin,sglang,vllm]
                                    [--concurrency 1,32,256,1024] [--tokens 16,128]
                                    [--json FILE] [--markdown docs/benchmarks-overhead.md]

One run, the same two workers (`disagg_tools.overhead.fixed_worker`: one prefill, one decode,
128-token streams at one token per 20 ms whatever the load), and in turn:

    baseline  the client itself: prefill call (max_tokens 1 + kv_transfer_params), then decode
    ours      `python -m router.edge.serve_cli serve --config …` (in-process store; `ours_redis`:
    Redis)
    ours_tenants  ours_redis with --tenants tenants configured (vtc, fair_cluster), the streams
              spread over their keys; with ours_redis in the run, a table of the two side by
              side (disagg_tools/overhead/tenants_target.py, issue 33)
    ours_dropin  `disagg-router serve --prefill URL --decode URL --redis-url URL`: the deployed
              configuration (no file, Redis, what the workers report)
    sglang    `python -m sglang_router.launch_router --pd-disaggregation …`
    vllm      `vllm-router --vllm-pd-disaggregation …`

Each target serves keep-alive client streams at every concurrency (closed loop, slots staggered
over one stream's length, each slot's first answer is warm-up). Per run: TTFT and inter-token
gap percentiles, their difference from the baseline at the same concurrency and answer length,
tokens/s, and the router process's CPU (utime + stime of every thread and child, from /proc):
seconds per 1,000 tokens and milliseconds per request. `--tokens 16,128` runs the whole ladder
for each answer length (short answers weigh a request's fixed cost more). Then a saturation
phase (faster workers, longer streams) gives tokens/s relayed and tokens per router CPU-second
when the offered load is well beyond one core (the requests per second a core sustains within
a TTFT budget, issue 36, is `python -m disagg_tools.overhead.saturation`).

Pinning (when the OS allows two or more cores): the router on `--router-core`, the load
generator (this process) and the workers on `--load-core`. Routers and workers are
subprocesses; this package imports none of the router.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

from disagg_tools import uvrun
from disagg_tools.overhead.idle import idle_markdown
from disagg_tools.overhead.ladder import run
from disagg_tools.overhead.overhead_report import markdown, replace_between_markers
from disagg_tools.overhead.targets import ROUTERS
from disagg_tools.overhead.tenants_target import tenants_markdown

__all__ = ["add_common_arguments", "build_parser", "main", "parse", "pinned"]


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def _positive_ints(text: str) -> list[int]:
    values = _ints(text)
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: a comma list of positive integers")
    return values


def add_common_arguments(p: argparse.ArgumentParser) -> None:
    """The flags every phase that starts the targets reads (`targets.start_workers`,
    `targets.start_router`): the workers, the routers' settings, pinning, the output; the
    ladder's own are `build_parser`'s, the sustained rate's `disagg_tools.overhead.saturation`'s."""
    p.add_argument(
        "--targets",
        default="baseline,ours,ours_dropin,sglang,vllm",
        help=f"comma list of baseline, {', '.join(ROUTERS)}",
    )
    p.add_argument(
        "--tokens",
        type=_positive_ints,
        default=[128],
        help="tokens per stream (ignore_eos); a comma list (16,128) runs the ladder for each",
    )
    p.add_argument("--interval-ms", type=float, default=20.0, help="worker time per token")
    p.add_argument("--prefill-ms", type=float, default=10.0)
    p.add_argument(
        "--first-token-ms",
        type=float,
        default=None,
        help="decode request to first token (default: one interval)",
    )
    p.add_argument(
        "--worker-metrics",
        default=None,
        type=lambda path: str(Path(path).resolve()),  # the workers start in their own directory
        metavar="FILE",
        help="the stand-in workers also serve this real engine's /metrics families, so that "
        "the load polls cost what they cost against it (e.g. "
        "tests/router/workers/texts/vllm-0.32-metrics.txt, 53 KB); default: their own gauges",
    )
    p.add_argument("--chat", action="store_true", help="/v1/chat/completions, not completions")
    p.add_argument("--model", default="llama-3-8b")
    p.add_argument(
        "--tokenizer",
        default=None,
        metavar="DIR",
        help="ours and ours_redis count prompts with this model directory's tokenizer (settings "
        "`tokenizers`), as a deployment with exact counts does; default: the character estimate "
        "(ours_dropin always: the drop-in command line has no tokenizer flag)",
    )
    p.add_argument(
        "--alt-tokenizer",
        default=None,
        metavar="DIR",
        help="the same for ours_alt (with --ours-src . : tokenizing's cost in one run)",
    )
    p.add_argument(
        "--adapter",
        default="vllm",
        choices=("vllm", "sim"),
        help="our router's adapter name for the workers",
    )
    p.add_argument(
        "--redis-url",
        default="redis://127.0.0.1:6379/0",
        help="for the ours_redis and ours_dropin targets (a fresh key prefix per router start)",
    )
    p.add_argument(
        "--private-redis",
        action="store_true",
        help="start a Redis of the run's own on the load core and point the Redis targets at "
        "it, instead of --redis-url: the router's core then runs the router alone, as in a "
        "deployment whose Redis is on other hosts (disagg_tools/overhead/private_redis.py)",
    )
    p.add_argument(
        "--tenants",
        type=int,
        default=8,
        help="tenants the ours_tenants target configures (weights 1, 2, 4, ..., a key each)",
    )
    p.add_argument("--router-core", type=int, default=0)
    p.add_argument("--load-core", type=int, default=1)
    p.add_argument(
        "--no-pin", dest="pin", action="store_false", help="do not pin (tests, one-core machines)"
    )
    p.add_argument(
        "--nice",
        type=int,
        default=0,
        help="scheduling niceness of every measured process, this one included (a "
        "negative value shields the measurement from noisy neighbours on a "
        "shared machine; needs CAP_SYS_NICE)",
    )
    p.add_argument(
        "--rt-priority",
        type=int,
        default=0,
        help="run every measured process SCHED_RR at this priority (1-99): on a "
        "machine where other work keeps the cores busy, the only way to measure "
        "latency rather than the scheduler; the kernel's RT throttling still "
        "leaves others 5%% of each core; needs CAP_SYS_NICE",
    )
    p.add_argument("--json", dest="json_path", default=None, help="write the results here")
    p.add_argument(
        "--markdown",
        default=None,
        help="write the tables here (between overhead markers if the file has them)",
    )
    p.add_argument(
        "--ours-src",
        default=None,
        help="source tree of the ours_alt target (A/B a router change: the same "
        "command, run from that directory)",
    )
    p.add_argument(
        "--alt-redis",
        action="store_true",
        help="ours_alt with the Redis store, as ours_redis (A/B the deployed configuration)",
    )
    p.add_argument(
        "--alt-settings",
        default=None,
        metavar="JSON",
        help='ours_alt: settings added to its configuration, e.g. \'{"admission": {"fairness": '
        '"vtc"}}\' (A/B a setting with --ours-src .)',
    )
    p.add_argument("--log-dir", default=None, help="process logs and configs (default: a temp dir)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m disagg_tools.overhead",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_common_arguments(p)
    p.add_argument("--concurrency", type=_ints, default=[1, 32, 256, 1024])
    p.add_argument(
        "--rounds",
        type=int,
        default=2,
        help="interleaved rounds over all targets (each with its own warm-up)",
    )
    p.add_argument(
        "--requests",
        type=int,
        default=2,
        help="measured answers per stream slot and round (concurrency > 1)",
    )
    p.add_argument(
        "--requests-c1", type=int, default=10, help="measured answers per round at concurrency 1"
    )
    p.add_argument("--warmup", type=int, default=1, help="warm-up answers per slot")
    p.add_argument("--no-saturation", dest="saturation", action="store_false")
    p.add_argument("--sat-concurrency", type=int, default=256)
    p.add_argument("--sat-interval-ms", type=float, default=2.0)
    p.add_argument("--sat-tokens", type=int, default=1024)
    p.add_argument("--sat-requests", type=int, default=1, help="measured answers per slot")
    p.add_argument(
        "--idle-s",
        type=float,
        default=0.0,
        help="then an idle phase (disagg_tools/overhead/idle.py): seconds of no traffic per "
        "router with 4 workers, router CPU ms/s (0 = off)",
    )
    p.add_argument(
        "--settle-s",
        type=float,
        default=3.0,
        help="idle phase: quiet seconds after start-up before measuring",
    )
    return p


def _parse(argv: list[str] | None) -> argparse.Namespace:
    return parse(build_parser(), argv)


def parse(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """`parser`'s namespace, with the targets checked and the cores chosen (`router_core_`,
    `load_core_`: None when not pinning)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    ns = parser.parse_args(argv)
    ns.argv_ = argv
    ns.targets = [t.strip() for t in ns.targets.split(",") if t.strip()]
    for t in ns.targets:
        if t != "baseline" and t not in ROUTERS:
            raise SystemExit(f"unknown target {t!r}; known: baseline, {', '.join(ROUTERS)}")
    cpus = sorted(os.sched_getaffinity(0))
    if ns.pin and len(cpus) >= 2:
        ns.router_core_, ns.load_core_ = ns.router_core, ns.load_core
    else:
        ns.router_core_ = ns.load_core_ = None
    return ns


@contextlib.contextmanager
def pinned(core: int | None) -> Iterator[None]:
    if core is None:
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {core})
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def main(argv: list[str] | None = None) -> int:
    ns = _parse(argv)
    if ns.nice:
        os.setpriority(os.PRIO_PROCESS, 0, ns.nice)
    if ns.rt_priority:
        os.sched_setscheduler(0, os.SCHED_RR, os.sched_param(ns.rt_priority))
    # SIGTERM like Ctrl-C: the run is cancelled and every process it started is stopped.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    log_dir = Path(ns.log_dir or tempfile.mkdtemp(prefix="bench-overhead-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    with pinned(ns.load_core_), asyncio.Runner(loop_factory=uvrun.loop_factory()) as runner:
        result = runner.run(run(ns, log_dir))
    text = json.dumps(result, indent=1)
    if ns.json_path:
        Path(ns.json_path).write_text(text + "\n")
    md = markdown(result)
    tenants = tenants_markdown(result["runs"])
    if tenants:
        md += "\n" + tenants
    if result.get("idle"):
        md += "\n" + idle_markdown(result["idle"], ns.idle_s)
    if ns.markdown:
        path = Path(ns.markdown)
        existing = path.read_text() if path.exists() else None
        path.write_text(replace_between_markers(existing, md))
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
