"""The processes the overhead benchmark measures: the stand-in workers and each router target.

    baseline  no router: the client makes the two PD calls itself (nothing started here)
    ours      `python -m router.edge.serve_cli serve --config …` (in-process store; `ours_redis`:
              Redis; `ours_alt`: the same command from another source tree, `--ours-src`)
    ours_tenants  ours_redis with tenants configured (vtc, one fair share for the cluster), the
              load spread over their keys (disagg_tools/overhead/tenants_target.py, issue 33)
    ours_dropin  `disagg-router serve --prefill URL --decode URL --redis-url URL`: the deployed
              command line, no configuration file (the model and the KV capacity are read from
              the workers, router/edge/dropin.py), Redis in the path, a fresh key prefix per start
              from `DISAGG_ROUTER_STORE_KEY_PREFIX`
    sglang    `python -m sglang_router.launch_router --pd-disaggregation …`
    vllm      `vllm-router --vllm-pd-disaggregation …`

The workers are `disagg_tools.overhead.fixed_worker` processes. Shared by the ladder
(`disagg_tools.overhead.ladder`, one pair of workers) and the idle phase
(`disagg_tools.overhead.idle`, four). Every process is a `disagg_tools.procs.Child`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import sys
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from disagg_tools.overhead.overhead_client import LoadSpec, run_load
from disagg_tools.overhead.tenants_target import TENANTS_TARGET, tenant_keys, tenant_settings
from disagg_tools.procs import HOST, Child, free_port, process_tree_cpu_s

__all__ = [
    "ROUTERS",
    "StartedRouter",
    "Workers",
    "client_keys",
    "fixed_worker_command",
    "fresh_key_prefix",
    "router_command",
    "start_router",
    "start_workers",
    "wait_listening",
    "wait_ready",
]

ROUTERS = ("ours", "ours_redis", "ours_alt", TENANTS_TARGET, "ours_dropin", "sglang", "vllm")
# Our router from a configuration file written here (`_our_config`).
CONFIGURED = ("ours", "ours_redis", "ours_alt", TENANTS_TARGET)


def _tenants(ns: argparse.Namespace) -> int:
    """How many tenants `ours_tenants` configures (`--tenants`; the idle phase's parser has no
    such flag: 8)."""
    return int(getattr(ns, "tenants", 8))


def client_keys(name: str, ns: argparse.Namespace) -> tuple[str, ...]:
    """The API keys the load generator spreads target `name`'s streams over (none: no key)."""
    return tenant_keys(_tenants(ns)) if name == TENANTS_TARGET else ()


async def wait_ready(
    addr: tuple[str, int], proc: Child, timeout_s: float = 60.0, api_keys: tuple[str, ...] = ()
) -> None:
    """Until one short stream comes back complete through `addr` (sent with the first of
    `api_keys`, if any)."""
    deadline = time.monotonic() + timeout_s
    last = "not tried"
    while time.monotonic() < deadline:
        if not proc.alive():
            raise RuntimeError(f"{proc.name} exited:\n{proc.tail()}")
        try:
            recs, _, _ = await run_load(
                LoadSpec(
                    1,
                    1,
                    warmup_per_slot=0,
                    target=addr,
                    max_tokens=2,
                    request_timeout_s=5.0,
                    api_keys=api_keys[:1],
                )
            )
            r = recs[0]
            if r.error is None and r.done and r.tokens == 2:
                return
            last = repr(r)
        except OSError as exc:
            last = str(exc)
        await asyncio.sleep(0.3)
    raise RuntimeError(f"{proc.name} not ready after {timeout_s} s ({last}):\n{proc.tail()}")


async def wait_listening(port: int, proc: Child, timeout_s: float = 30.0) -> None:
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


@dataclass(frozen=True, slots=True)
class Workers:
    prefill: Child
    decode: Child
    prefill_port: int
    decode_port: int

    @property
    def prefill_url(self) -> str:
        return f"http://{HOST}:{self.prefill_port}"

    @property
    def decode_url(self) -> str:
        return f"http://{HOST}:{self.decode_port}"

    def cpu_s(self) -> float:
        return process_tree_cpu_s(self.prefill.pid) + process_tree_cpu_s(self.decode.pid)

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
    """A `disagg_tools.overhead.fixed_worker` stand-in (the ladder's pair, the idle phase's
    four)."""
    cmd = [sys.executable, "-m", "disagg_tools.overhead.fixed_worker", "--role", role]
    cmd += ["--host", HOST, "--port", str(port), "--model", model]
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
        if getattr(ns, "worker_metrics", None):
            cmd += ["--metrics-extra", ns.worker_metrics]  # absolute (the CLI resolves it)
        procs.append(
            Child(
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


def fresh_key_prefix(label: str) -> str:
    """A Redis key prefix no other router start has used: state left in Redis by an earlier
    run (reservations, leases, counters) must not be read by the next one."""
    return f"bench-overhead-{label}-{os.getpid()}-{uuid.uuid4().hex[:8]}:"


def _our_config(
    ns: argparse.Namespace,
    prefill: list[str],
    decode: list[str],
    path: Path,
    redis: bool,
    tokenizer: str | None,
    extra: Mapping[str, Any] | None = None,
) -> None:
    store = {"key_prefix": fresh_key_prefix(path.stem), "url": ns.redis_url if redis else None}
    base: dict[str, Any] = {
        "model": ns.model,
        "perf": {"model": "llama-3-8b", "gpu": "h100"},
        "store": {k: v for k, v in store.items() if v is not None},
    }
    if tokenizer:
        # Exact prompt counts: the tokenizer's work is in the request path being measured.
        base["estimates"] = {"tokenizers": {ns.model: str(Path(tokenizer).resolve())}}
    config = _over(base, extra or {})  # the A/B's settings, group by group
    # JSON is YAML's flow style: one line a setting.
    lines = [f"{key}: {json.dumps(value)}" for key, value in config.items()]
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
    if name == "ours_dropin":
        return _dropin_command(ns, prefill, decode, port, label=config_name or name)
    if name in CONFIGURED:
        cfg = log_dir / f"{config_name or name}.yaml"
        alt = name == "ours_alt"
        redis = name in ("ours_redis", TENANTS_TARGET) or (alt and ns.alt_redis)
        tokenizer = ns.alt_tokenizer if alt else ns.tokenizer
        extra = json.loads(ns.alt_settings) if alt and getattr(ns, "alt_settings", None) else {}
        if name == TENANTS_TARGET:
            extra = tenant_settings(_tenants(ns))
        _our_config(ns, prefill, decode, cfg, redis=redis, tokenizer=tokenizer, extra=extra)
        serve = ["--log-level", "WARNING", "serve", "--config", str(cfg)]
        return [
            sys.executable,
            "-m",
            "router.edge.serve_cli",
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


def _disagg_router_executable() -> list[str]:
    """`disagg-router` as installed next to this interpreter (the console script users run),
    else the module it runs."""
    exe = Path(sys.executable).with_name("disagg-router")
    if exe.exists():
        return [str(exe)]
    return [sys.executable, "-m", "disagg_tools.launcher.main"]


def _dropin_command(
    ns: argparse.Namespace, prefill: list[str], decode: list[str], port: int, label: str
) -> tuple[list[str], dict[str, str]]:
    """`disagg-router serve --prefill URL --decode URL --redis-url URL`, as a user coming from
    vllm-router deploys it: no file, so no tokenizer (`--tokenizer` is the configured
    targets') and no perf profile; the key prefix is the only setting not on the command line
    (`serve` has no flag for it), given by the environment (`store.key_prefix`)."""
    cmd = [*_disagg_router_executable(), "--log-level", "WARNING", "serve"]
    for url in prefill:
        cmd += ["--prefill", url]
    for url in decode:
        cmd += ["--decode", url]
    if ns.adapter != "vllm":  # the drop-in's default: said only when it is not
        cmd += ["--adapter", ns.adapter]
    cmd += ["--redis-url", ns.redis_url, "--host", HOST, "--port", str(port)]
    return cmd, {"DISAGG_ROUTER_STORE_KEY_PREFIX": fresh_key_prefix(label)}


@dataclass(frozen=True, slots=True)
class StartedRouter:
    proc: Child
    addr: tuple[str, int]
    command: str  # how it was started, as a shell line: its own environment, then the command


def shell_line(cmd: list[str], env: dict[str, str]) -> str:
    return " ".join([*(f"{k}={shlex.quote(v)}" for k, v in env.items()), shlex.join(cmd)])


async def start_router(
    name: str, ns: argparse.Namespace, workers: Workers, log_dir: Path, tag: str
) -> StartedRouter:
    port = free_port()
    cmd, env = router_command(name, ns, [workers.prefill_url], [workers.decode_url], port, log_dir)
    cwd = ns.ours_src if name == "ours_alt" else None
    proc = Child(
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
        await wait_ready((HOST, port), proc, api_keys=client_keys(name, ns))
    except BaseException:
        proc.stop()
        raise
    return StartedRouter(proc, (HOST, port), shell_line(cmd, env))


def _over(base: dict[str, Any], extra: Mapping[str, Any]) -> dict[str, Any]:
    """`extra`'s settings over `base`'s: a group's (a mapping's) given settings replace only
    their own (router/config.py merged_settings; the tools do not import the router)."""
    out = dict(base)
    for key, value in extra.items():
        below = out.get(key)
        both = isinstance(below, Mapping) and isinstance(value, Mapping)
        out[key] = {**below, **value} if both else value  # type: ignore[dict-item]
    return out
