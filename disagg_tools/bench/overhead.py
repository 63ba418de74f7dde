"""What a router adds: TTFT, ITL and CPU against a client that does the two PD calls itself.

    python -m disagg_tools.bench.overhead [--targets baseline,ours,sglang,vllm] [--concurrency
    1,32,256,1024]
                             [--json FILE] [--markdown docs/benchmarks-overhead.md]

One run, the same two workers (`disagg_tools.bench.fixed_worker`: one prefill, one decode,
128-token streams
at one token per 20 ms whatever the load), and in turn:

    baseline  the client itself: prefill call (max_tokens 1 + kv_transfer_params), then decode
    ours      `python -m router.serve_cli serve --config …` (in-process store; `ours_redis`: Redis)
    sglang    `python -m sglang_router.launch_router --pd-disaggregation …`
    vllm      `vllm-router --vllm-pd-disaggregation …`

Each target serves keep-alive client streams at every concurrency (closed loop, slots staggered
over one stream's length, each slot's first answer is warm-up). Per run: TTFT and inter-token
gap percentiles, their difference from the baseline at the same concurrency, tokens/s, and the
router process's CPU-seconds (utime + stime of every thread, from /proc) per 1,000 tokens.
Then a saturation phase (faster workers, longer streams) gives tokens/s relayed and tokens per
router CPU-second when the offered load is well beyond one core.

Pinning (when the OS allows two or more cores): the router on `--router-core`, the load
generator (this process) and the workers on `--load-core`. Routers and workers are
subprocesses; this module imports none of the router.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import resource
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from disagg_tools import uvrun
from disagg_tools.bench.overhead_client import LoadSpec, StreamRecord, run_load
from disagg_tools.bench.overhead_report import (
    add_deltas,
    markdown,
    replace_between_markers,
    summarize,
)
from disagg_tools.bench.progress import bar, note

__all__ = ["main", "run", "build_parser", "ROUTERS"]

ROUTERS = ("ours", "ours_redis", "ours_alt", "sglang", "vllm")
HOST = "127.0.0.1"
_TICK = os.sysconf("SC_CLK_TCK")


# --- processes ----------------------------------------------------------------------------------


_HANDED_OUT: set[int] = set()


def free_port() -> int:
    """A port free now and not handed out before by this process: the workers and routers bind
    theirs only once started, so the kernel may offer a port twice meanwhile (two workers then
    race for it, and one exits with "address already in use")."""
    while True:
        with socket.socket() as s:
            s.bind((HOST, 0))
            port = int(s.getsockname()[1])
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port


def _descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    todo.extend(int(c) for c in f.read().split())
        except OSError:
            pass
    return out


def proc_cpu_s(pid: int) -> float:
    """utime + stime of a process (all its threads) and its descendants, in seconds."""
    total = 0
    for p in _descendants(pid):
        try:
            with open(f"/proc/{p}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14, 15 of stat)
    return total / _TICK


def self_cpu_s() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


class Proc:
    """A subprocess in its own session, pinned to one core, logging to a file."""

    def __init__(
        self,
        name: str,
        cmd: list[str],
        *,
        core: int | None,
        log_dir: Path,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        nice: int = 0,
        rt_priority: int = 0,
    ) -> None:
        self.name = name
        self.cmd = cmd
        self.log_path = log_dir / f"{name}.log"
        log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        self._log = log

        def pin() -> None:
            if core is not None:
                os.sched_setaffinity(0, {core})
            if nice:
                os.setpriority(os.PRIO_PROCESS, 0, nice)
            if rt_priority:
                os.sched_setscheduler(0, os.SCHED_RR, os.sched_param(rt_priority))

        self.popen = subprocess.Popen(
            cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
            preexec_fn=pin,
            start_new_session=True,
            cwd=cwd,
        )

    @property
    def pid(self) -> int:
        return self.popen.pid

    def cpu_s(self) -> float:
        return proc_cpu_s(self.popen.pid)

    def alive(self) -> bool:
        return self.popen.poll() is None

    def tail(self, n: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def stop(self) -> None:
        """SIGTERM to our own session, SIGKILL after 10 s; never raises."""
        try:
            if self.popen.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.popen.pid, signal.SIGTERM)
                try:
                    self.popen.wait(10)
                except subprocess.TimeoutExpired:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(self.popen.pid, signal.SIGKILL)
                    self.popen.wait(10)
        except Exception as exc:  # noqa: BLE001 - a stuck child must not leak the others
            print(f"disagg_tools.bench.overhead: could not stop {self!r}: {exc!r}", file=sys.stderr)
        finally:
            self._log.close()

    def __repr__(self) -> str:
        return f"Proc({self.name} pid={self.popen.pid} alive={self.alive()})"


async def wait_ready(addr: tuple[str, int], proc: Proc, timeout_s: float = 60.0) -> None:
    """Until one short stream comes back complete through `addr`."""
    deadline = time.monotonic() + timeout_s
    last = "not tried"
    while time.monotonic() < deadline:
        if not proc.alive():
            raise RuntimeError(f"{proc.name} exited:\n{proc.tail()}")
        try:
            recs, _, _ = await run_load(
                LoadSpec(1, 1, warmup_per_slot=0, target=addr, max_tokens=2, request_timeout_s=5.0)
            )
            r = recs[0]
            if r.error is None and r.done and r.tokens == 2:
                return
            last = repr(r)
        except OSError as exc:
            last = str(exc)
        await asyncio.sleep(0.3)
    raise RuntimeError(f"{proc.name} not ready after {timeout_s} s ({last}):\n{proc.tail()}")


async def wait_listening(port: int, proc: Proc, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not proc.alive():
            raise RuntimeError(f"{proc.name} exited:\n{proc.tail()}")
        try:
            _, w = await asyncio.open_connection(HOST, port)
            w.close()
            return
        except OSError:
            await asyncio.sleep(0.1)
    raise RuntimeError(f"{proc.name} is not listening on {port}:\n{proc.tail()}")


# --- the targets --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Workers:
    prefill: Proc
    decode: Proc
    prefill_port: int
    decode_port: int

    @property
    def prefill_url(self) -> str:
        return f"http://{HOST}:{self.prefill_port}"

    @property
    def decode_url(self) -> str:
        return f"http://{HOST}:{self.decode_port}"

    def cpu_s(self) -> float:
        return self.prefill.cpu_s() + self.decode.cpu_s()

    async def counters(self) -> dict[str, int]:
        """Connections accepted and requests served by both workers since they started."""
        out: dict[str, int] = {}
        for role, port in (("prefill", self.prefill_port), ("decode", self.decode_port)):
            reader, writer = await asyncio.open_connection(HOST, port)
            writer.write(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            text = (await reader.read()).decode(errors="replace")
            writer.close()
            for line in text.splitlines():
                if line.startswith("fixed_worker_"):
                    name, _, value = line.partition(" ")
                    key = f"{role}_{name.removeprefix('fixed_worker_').removesuffix('_total')}"
                    out[key] = int(value)
        return out

    def stop(self) -> None:
        self.prefill.stop()
        self.decode.stop()


def fixed_worker_command(
    role: str, port: int, model: str, interval_ms: float, prefill_ms: float
) -> list[str]:
    """A `disagg_tools.bench.fixed_worker` stand-in (the ladder's pair, the idle phase's four)."""
    cmd = [sys.executable, "-m", "disagg_tools.bench.fixed_worker", "--role", role, "--host", HOST]
    cmd += ["--port", str(port), "--model", model]
    return cmd + ["--interval-ms", str(interval_ms), "--prefill-ms", str(prefill_ms)]


async def start_workers(
    ns: argparse.Namespace, log_dir: Path, interval_ms: float, tag: str
) -> Workers:
    procs, ports = [], []
    for role in ("prefill", "decode"):
        port = free_port()
        cmd = fixed_worker_command(role, port, ns.model, interval_ms, ns.prefill_ms)
        if ns.first_token_ms is not None:
            cmd += ["--first-token-ms", str(ns.first_token_ms)]
        procs.append(
            Proc(
                f"worker-{role}-{tag}",
                cmd,
                core=ns.load_core_,
                log_dir=log_dir,
                nice=ns.nice,
                rt_priority=ns.rt_priority,
            )
        )
        ports.append(port)
    for proc, port in zip(procs, ports, strict=True):
        await wait_listening(port, proc)
    return Workers(procs[0], procs[1], ports[0], ports[1])


def _our_config(
    ns: argparse.Namespace, prefill: list[str], decode: list[str], path: Path, redis: bool
) -> None:
    lines = [
        f"model: {ns.model}",
        "perf: {model: llama-3-8b, gpu: h100}",
        f'key_prefix: "bench-overhead-{os.getpid()}-{int(time.time())}:"',
    ]
    if redis:
        lines.append(f"redis_url: {ns.redis_url}")
    lines.append("workers:")
    for i, url in enumerate(prefill):
        lines.append(f"  - {{id: p{i}, url: {url}, role: prefill, adapter: {ns.adapter}}}")
    for i, url in enumerate(decode):
        lines.append(
            f"  - {{id: d{i}, url: {url}, role: decode, adapter: {ns.adapter}, "
            "kv_blocks: 100000000}"
        )
    path.write_text("\n".join(lines) + "\n")


def router_command(
    name: str,
    ns: argparse.Namespace,
    prefill: list[str],
    decode: list[str],
    port: int,
    log_dir: Path,
    config_name: str | None = None,
) -> tuple[list[str], dict[str, str]]:
    """The command line (and environment) that starts router `name` in front of these workers
    (the ladder's one pair, the idle phase's four)."""
    if name in ("ours", "ours_redis", "ours_alt"):
        cfg = log_dir / f"{config_name or name}.yaml"
        _our_config(ns, prefill, decode, cfg, redis=name == "ours_redis")
        serve = ["--log-level", "WARNING", "serve", "--config", str(cfg)]
        return [
            sys.executable,
            "-m",
            "router.serve_cli",
            *serve,
            "--host",
            HOST,
            "--port",
            str(port),
        ], {}
    # The peers try to download a tokenizer at start-up: a closed loopback port fails it at once.
    env = {"HF_ENDPOINT": f"http://{HOST}:{free_port()}"}
    if name == "sglang":
        cmd = [sys.executable, "-m", "sglang_router.launch_router", "--pd-disaggregation"]
        for url in prefill:
            cmd += ["--prefill", url, "none"]  # no bootstrap port: the stand-in needs none
        log_level = "warn"
    elif name == "vllm":
        exe = Path(sys.executable).with_name("vllm-router")
        cmd = (
            [str(exe)]
            if exe.exists()
            else [
                sys.executable,
                "-c",
                "import sys; from vllm_router.launch_router import main; sys.exit(main())",
            ]
        )
        cmd.append("--vllm-pd-disaggregation")
        for url in prefill:
            cmd += ["--prefill", url]
        log_level = "warning"
    else:
        raise ValueError(f"unknown target {name!r}; known: baseline, {', '.join(ROUTERS)}")
    for url in decode:
        cmd += ["--decode", url]
    metrics = ["--prometheus-host", HOST, "--prometheus-port", str(free_port())]
    return [*cmd, "--host", HOST, "--port", str(port), *metrics, "--log-level", log_level], env


# --- measuring ----------------------------------------------------------------------------------


class CpuSampler:
    """Samples (time, router CPU, workers CPU, client CPU) while a run goes on."""

    def __init__(self, router: Proc | None, workers: Workers, period_s: float = 0.25) -> None:
        self.router = router
        self.workers = workers
        self.period_s = period_s
        self.samples: list[tuple[float, float, float, float]] = []
        self._task: asyncio.Task[None] | None = None

    def sample(self) -> tuple[float, float, float, float]:
        s = (
            time.perf_counter(),
            self.router.cpu_s() if self.router else 0.0,
            self.workers.cpu_s(),
            self_cpu_s(),
        )
        self.samples.append(s)
        return s

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.period_s)
            self.sample()

    def __enter__(self) -> CpuSampler:
        self.sample()
        self._task = asyncio.get_running_loop().create_task(self._loop())
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()
        self.sample()

    def delta(self, t0: float | None = None, t1: float | None = None) -> tuple[float, ...]:
        """(seconds, router, workers, client) CPU between the samples nearest t0 and t1."""
        a = self.samples[0] if t0 is None else min(self.samples, key=lambda s: abs(s[0] - t0))
        b = self.samples[-1] if t1 is None else min(self.samples, key=lambda s: abs(s[0] - t1))
        return tuple(y - x for x, y in zip(a, b, strict=True))


def steady_tokens(records: list[StreamRecord], t0: float, t1: float) -> int:
    n = 0
    for r in records:
        for t, k in zip(r.reads, r.counts, strict=True):
            if t0 <= t < t1:
                n += k
    return n


@dataclass(slots=True)
class Segment:
    """One measured load run of one target: raw records and the CPU spent around them."""

    records: list[StreamRecord]
    secs: float
    window: float
    router_cpu: float
    worker_cpu: float
    client_cpu: float
    upstream: dict[str, int]
    loadavg: float
    steady: tuple[float, ...] = ()  # saturation: (secs, router, workers, client, tokens)


async def measure(
    spec: LoadSpec, router: Proc | None, workers: Workers, *, saturation: bool = False
) -> Segment:
    load_before = os.getloadavg()[0]
    before = await workers.counters()
    with CpuSampler(router, workers) as cpu:
        records, _, window = await run_load(spec)
    after = await workers.counters()
    # Reading the counters opens one connection per worker: not the router's.
    upstream = {k: after[k] - before.get(k, 0) for k in after}
    upstream["prefill_connections"] -= 1
    upstream["decode_connections"] -= 1
    secs, router_cpu, worker_cpu, client_cpu = cpu.delta()
    seg = Segment(records, secs, window, router_cpu, worker_cpu, client_cpu, upstream, load_before)
    if saturation:
        # The middle half of the run: every slot is streaming, none is ramping up or down.
        start = cpu.samples[0][0]
        t0 = start + 0.25 * secs
        d = cpu.delta(t0, start + 0.75 * secs)
        seg.steady = (*d, steady_tokens(records, t0, t0 + d[0]))
    return seg


def combine(
    name: str, spec: LoadSpec, segs: list[Segment], has_router: bool, saturation: bool = False
) -> dict[str, Any]:
    """One summary over the rounds of one (target, concurrency)."""
    records = [r for s in segs for r in s.records]
    secs = sum(s.secs for s in segs)
    out = summarize(
        records,
        max_tokens=spec.max_tokens,
        wall_s=secs,
        window_s=sum(s.window for s in segs),
        router_cpu_s=sum(s.router_cpu for s in segs) if has_router else None,
        client_cpu_s=sum(s.client_cpu for s in segs),
        worker_cpu_s=sum(s.worker_cpu for s in segs),
    )
    upstream: dict[str, int] = {}
    for s in segs:
        for k, v in s.upstream.items():
            upstream[k] = upstream.get(k, 0) + v
    out = {
        "target": name,
        "concurrency": spec.concurrency,
        "max_tokens": spec.max_tokens,
        "rounds": len(segs),
        "loadavg_1m": [round(s.loadavg, 2) for s in segs],
        "upstream": upstream,
        **out,
    }
    if has_router:
        out["router_cpu_s_per_1k_by_round"] = [
            round(s.router_cpu / t * 1000, 4) if (t := sum(r.tokens for r in s.records)) else None
            for s in segs
        ]
    if saturation:
        st = [sum(s.steady[i] for s in segs) for i in range(5)]
        s_secs, s_router, s_workers, s_client, tokens = st
        out.update(
            {
                "steady_s": round(s_secs, 3),
                "tokens_per_s": round(tokens / s_secs, 1) if s_secs > 0 else None,
                "router_cpu_util": round(s_router / s_secs, 3) if has_router and s_secs else None,
                "client_cpu_util": round(s_client / s_secs, 3) if s_secs > 0 else None,
                "worker_cpu_s": round(s_workers, 3),
                "wall_s": round(s_secs, 3),
                "tokens_per_router_cpu_s": round(tokens / s_router)
                if has_router and s_router
                else None,
                "cpu_s_per_1k_tokens": (
                    round(s_router / tokens * 1000, 4) if has_router and tokens else None
                ),
            }
        )
    return out


async def start_router(
    name: str, ns: argparse.Namespace, workers: Workers, log_dir: Path, tag: str
) -> tuple[Proc, tuple[str, int]]:
    port = free_port()
    cmd, env = router_command(name, ns, [workers.prefill_url], [workers.decode_url], port, log_dir)
    cwd = ns.ours_src if name == "ours_alt" else None
    proc = Proc(
        f"router-{name}-{tag}",
        cmd,
        core=ns.router_core_,
        log_dir=log_dir,
        env=env,
        cwd=cwd,
        nice=ns.nice,
        rt_priority=ns.rt_priority,
    )
    try:
        await wait_ready((HOST, port), proc)
    except BaseException:
        proc.stop()
        raise
    return proc, (HOST, port)


def _progress(r: dict[str, Any], phase: str = "ladder") -> None:
    # One rung's numbers: a line that stays, above any bar on a terminal
    # (disagg_tools/bench/progress.py).
    note(
        f"[{phase}] {r['target']:>10} c={r['concurrency']:<5} ok={r['complete']}/"
        f"{r['requests']} ttft p50={r['ttft_ms']['p50']} p99={r['ttft_ms']['p99']} "
        f"itl p50={r['itl_ms']['p50']} p99={r['itl_ms']['p99']} tok/s={r['tokens_per_s']} "
        f"router cpu/1k={r['cpu_s_per_1k_tokens']} util={r['router_cpu_util']} "
        f"client util={r['client_cpu_util']}",
        sys.stderr,
    )


def machine_notes(ns: argparse.Namespace) -> dict[str, Any]:
    model = ""
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    versions: dict[str, str | None] = {}
    for pkg in ("aiohttp", "uvloop", "orjson", "sglang-router", "vllm-router", "disagg-router"):
        try:
            versions[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            versions[pkg] = None
    return {
        "cpus": os.cpu_count(),
        "cpu_model": model,
        "kernel": platform.release(),
        "python": platform.python_version(),
        "versions": versions,
        "router_core": ns.router_core_,
        "load_core": ns.load_core_,
        "loadavg_at_start": os.getloadavg(),
    }


async def _phase(
    ns: argparse.Namespace, log_dir: Path, *, saturation: bool
) -> list[dict[str, Any]]:
    """Every target against one pair of workers, interleaved: for each round, for each
    concurrency, every target in turn (the order rotates), so that a noisy neighbour on a
    shared machine hits all targets alike rather than whichever ran during its burst."""
    tag = "sat" if saturation else "ladder"
    interval = ns.sat_interval_ms if saturation else ns.interval_ms
    workers = await start_workers(ns, log_dir, interval, tag)
    routers: dict[str, tuple[Proc, tuple[str, int]]] = {}
    segs: dict[tuple[str, int], list[Segment]] = {}
    specs: dict[tuple[str, int], LoadSpec] = {}
    try:
        for name in ns.targets:
            if name != "baseline":
                routers[name] = await start_router(name, ns, workers, log_dir, tag)
        if saturation:
            levels = [ns.sat_concurrency]
            tokens, stream_s = ns.sat_tokens, ns.sat_tokens * ns.sat_interval_ms / 1e3
        else:
            levels = ns.concurrency
            tokens = ns.tokens
            stream_s = (ns.first_token_ms or ns.interval_ms) / 1e3 + tokens * interval / 1e3
        # One tick per measured (round, concurrency, target): drawn on a terminal only.
        rungs = bar(
            sys.stderr, desc=tag, total=ns.rounds * len(levels) * len(ns.targets), unit="rung"
        )
        for rnd in range(ns.rounds):
            for c in levels:
                k = rnd % len(ns.targets)
                for name in ns.targets[k:] + ns.targets[:k]:
                    if saturation:
                        per_slot = ns.sat_requests
                    else:
                        per_slot = ns.requests_c1 if c == 1 else ns.requests
                    proc, addr = routers.get(name, (None, None))
                    spec = LoadSpec(
                        c,
                        per_slot + ns.warmup,
                        warmup_per_slot=ns.warmup,
                        target=addr,
                        prefill=(HOST, workers.prefill_port),
                        decode=(HOST, workers.decode_port),
                        model=ns.model,
                        max_tokens=tokens,
                        chat=ns.chat,
                        stagger_s=stream_s if c > 1 else 0.0,
                    )
                    if proc is not None and not proc.alive():
                        raise RuntimeError(f"{proc.name} died:\n{proc.tail()}")
                    seg = await measure(spec, proc, workers, saturation=saturation)
                    segs.setdefault((name, c), []).append(seg)
                    specs[(name, c)] = spec
                    _progress(
                        combine(name, spec, [seg], proc is not None, saturation),
                        f"{tag} round {rnd + 1}",
                    )
                    rungs.update(1)
        rungs.close()
    finally:
        for proc, _ in routers.values():
            proc.stop()
        workers.stop()
    runs = [
        combine(name, specs[(name, c)], segs[(name, c)], name != "baseline", saturation)
        for name in ns.targets
        for c in (levels if segs else [])
        if (name, c) in segs
    ]
    return runs


async def run(ns: argparse.Namespace, log_dir: Path) -> dict[str, Any]:
    result: dict[str, Any] = {
        "params": {k: v for k, v in vars(ns).items() if not k.endswith("_")},
        "command": " ".join(["python -m disagg_tools.bench.overhead", *ns.argv_]),
        "machine": machine_notes(ns),
        "runs": [],
        "saturation": [],
        "log_dir": str(log_dir),
    }
    t0 = time.monotonic()
    result["runs"] = await _phase(ns, log_dir, saturation=False)
    add_deltas(result["runs"])
    if ns.saturation:
        result["saturation"] = await _phase(ns, log_dir, saturation=True)
    if ns.idle_s > 0:
        from disagg_tools.bench.overhead_idle import (
            idle_phase,
        )  # imports this module: not at the top

        result["idle"] = await idle_phase(ns, log_dir)
    result["machine"]["loadavg_at_end"] = os.getloadavg()
    result["elapsed_s"] = round(time.monotonic() - t0, 1)
    return result


# --- command line -------------------------------------------------------------------------------


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m disagg_tools.bench.overhead",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--targets",
        default="baseline,ours,sglang,vllm",
        help=f"comma list of baseline, {', '.join(ROUTERS)}",
    )
    p.add_argument("--concurrency", type=_ints, default=[1, 32, 256, 1024])
    p.add_argument("--tokens", type=int, default=128, help="tokens per stream (ignore_eos)")
    p.add_argument("--interval-ms", type=float, default=20.0, help="worker time per token")
    p.add_argument("--prefill-ms", type=float, default=10.0)
    p.add_argument(
        "--first-token-ms",
        type=float,
        default=None,
        help="decode request to first token (default: one interval)",
    )
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
    p.add_argument("--chat", action="store_true", help="/v1/chat/completions, not completions")
    p.add_argument("--model", default="llama-3-8b")
    p.add_argument(
        "--adapter",
        default="vllm",
        choices=("vllm", "sim"),
        help="our router's adapter name for the workers",
    )
    p.add_argument(
        "--redis-url",
        default="redis://127.0.0.1:6379/0",
        help="for the ours_redis target (a unique key_prefix is used)",
    )
    p.add_argument("--no-saturation", dest="saturation", action="store_false")
    p.add_argument("--sat-concurrency", type=int, default=256)
    p.add_argument("--sat-interval-ms", type=float, default=2.0)
    p.add_argument("--sat-tokens", type=int, default=1024)
    p.add_argument("--sat-requests", type=int, default=1, help="measured answers per slot")
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
    p.add_argument("--log-dir", default=None, help="process logs and configs (default: a temp dir)")
    p.add_argument(
        "--idle-s",
        type=float,
        default=0.0,
        help="then an idle phase (disagg_tools/bench/overhead_idle.py): seconds of no traffic per "
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
    argv = list(sys.argv[1:] if argv is None else argv)
    ns = build_parser().parse_args(argv)
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
def _pinned(core: int | None) -> Iterator[None]:
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
    with _pinned(ns.load_core_), asyncio.Runner(loop_factory=uvrun.loop_factory()) as runner:
        result = runner.run(run(ns, log_dir))
    text = json.dumps(result, indent=1)
    if ns.json_path:
        Path(ns.json_path).write_text(text + "\n")
    md = markdown(result)
    if result.get("idle"):
        from disagg_tools.bench.overhead_idle import idle_markdown

        md += "\n" + idle_markdown(result["idle"], ns.idle_s)
    if ns.markdown:
        path = Path(ns.markdown)
        existing = path.read_text() if path.exists() else None
        path.write_text(replace_between_markers(existing, md))
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
