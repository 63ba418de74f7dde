"""The drop-in command line: `disagg-router serve --prefill URL [BOOTSTRAP_PORT] --decode URL`.

It runs with no configuration file, like `vllm-router --vllm-pd-disaggregation --prefill URL
--decode URL` or `python -m sglang_router.launch_router --pd-disaggregation --prefill URL 9000
--decode URL` (the same grammar: `--prefill` takes a URL and an optional bootstrap port or
`none`, both flags repeat). What a file would say is read from the workers themselves before
serving (router/workers/discovery.py `WorkerFacts`): the served model names, the decode KV capacity
(vLLM `vllm:cache_config_info`, SGLang `max_total_num_tokens`), the context length, an SGLang
prefill's bootstrap port; the KV layout is read as for any `discover_layout` worker.

Precedence, when `--config FILE` is given too (docs/real-workers.md):
  * server.host/port, store.url, policy, estimates.estimator: flag > `DISAGG_ROUTER_*` > file >
    default;
  * workers: the file's, plus one per `--prefill`/`--decode` whose URL the file does not list
    (the file's entry for a URL wins: it may carry a layout, a capacity, a key);
  * served models and max_model_len: the file's when it sets them, else what workers report;
  * a flag decode worker's capacity: `--kv-blocks` > what it reports > the file's `perf`.

Kubernetes discovery (`--service-discovery --prefill-selector app=vllm role=prefill
--decode-selector ... [--service-discovery-namespace NS] [--service-discovery-port N]
[--bootstrap-port-annotation KEY]`: the flags of vllm-router (vllm-project/router src/main.rs;
it has no bootstrap annotation flag) and sglang-router (sglang_router/launch_router.py,
`--bootstrap-port-annotation`, default sglang.ai/bootstrap-port), selectors as space-separated
`key=value` terms, AND-ed) sets `discovery.*`; `--selector` (their non-PD mode) watches pods
that serve whole requests (role both). `--adapter`/`--pd-disaggregation` and `--kv-blocks`
apply to discovered pods; `--prefill`/`--decode` workers may be given too (vllm-router's
"static fallback"): they stay, the discovered ones join them. Unlike the peers (port 80), the
port defaults to 8000, vLLM's and the chart's.

The adapter: `--adapter`, else `sglang` when `--pd-disaggregation` (sglang-router's flag) or a
bootstrap port is given, else `vllm`.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import aiohttp

from router.config import ConfigError, Settings, load_settings, read_config
from router.workers.discovery import WorkerFacts, fetch_worker_facts

__all__ = [
    "FlagWorker",
    "add_dropin_arguments",
    "flag_workers",
    "adapter_of",
    "discovery_overrides",
    "dropin_mapping",
    "discover_facts",
    "load_serve_settings",
]

log = logging.getLogger(__name__)

ADAPTERS = ("vllm", "sglang", "sim", "mooncake")
DEFAULT_STARTUP_TIMEOUT_S = 120.0
_POLL_S = 0.5


class _ExitTwo(argparse.ArgumentTypeError):
    """Raised for a bad flag value; argparse turns it into `error: ...` and exit code 2."""


@dataclass(frozen=True, slots=True)
class FlagWorker:
    url: str
    role: str  # prefill | decode
    bootstrap_port: int | None = None


def _url(value: str) -> str:
    parts = urlsplit(value)
    try:
        parts.port  # noqa: B018 - a bad port raises here
    except ValueError as exc:
        raise _ExitTwo(f"{value!r}: {exc}") from exc
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise _ExitTwo(f"{value!r} is not an http:// or https:// URL")
    return value.rstrip("/")


def _prefill_entry(values: Sequence[str]) -> FlagWorker:
    """`URL [BOOTSTRAP_PORT|none]`, as vllm-router and sglang-router take it."""
    if not 1 <= len(values) <= 2:
        raise _ExitTwo("--prefill takes a URL and an optional bootstrap port (or 'none')")
    port: int | None = None
    if len(values) == 2 and values[1].lower() != "none":
        if not values[1].isdigit() or not 0 < int(values[1]) < 65536:
            raise _ExitTwo(f"--prefill {values[0]}: bootstrap port {values[1]!r} is not a port")
        port = int(values[1])
    return FlagWorker(_url(values[0]), "prefill", port)


def add_dropin_arguments(parser: argparse.ArgumentParser) -> None:
    """The worker flags of `serve` (its host/port/redis/policy flags are
    router/edge/serve_cli.py's)."""
    group = parser.add_argument_group(
        "drop-in (no configuration file needed; docs/real-workers.md has the migration table)"
    )
    group.add_argument(
        "--prefill",
        nargs="+",
        action="append",
        metavar=("URL", "BOOTSTRAP_PORT"),
        help="a prefill worker, optionally with its bootstrap port (or 'none'); repeatable",
    )
    group.add_argument(
        "--decode", action="append", metavar="URL", help="a decode worker; repeatable"
    )
    group.add_argument(
        "--adapter",
        choices=ADAPTERS,
        help="the workers' protocol (default: sglang with --pd-disaggregation or a bootstrap "
        "port, else vllm)",
    )
    group.add_argument(
        "--vllm-pd-disaggregation",
        action="store_true",
        help="accepted for vllm-router compatibility (the vllm adapter)",
    )
    group.add_argument(
        "--pd-disaggregation",
        action="store_true",
        help="accepted for sglang-router compatibility (the sglang adapter)",
    )
    group.add_argument(
        "--kv-blocks",
        type=int,
        metavar="N",
        help="KV capacity (blocks) of each flag decode worker; default: what the worker reports",
    )
    _add_discovery_arguments(parser)
    group.add_argument(
        "--worker-startup-timeout-secs",
        type=float,
        default=DEFAULT_STARTUP_TIMEOUT_S,
        metavar="S",
        help="how long to wait for the flag workers to answer before serving "
        f"(default {DEFAULT_STARTUP_TIMEOUT_S:g})",
    )


def _add_discovery_arguments(parser: argparse.ArgumentParser) -> None:
    """Kubernetes discovery under the flags vllm-router and sglang-router give it (both parse
    a selector as space-separated `key=value` terms, AND-ed); they set `discovery.*`."""
    group = parser.add_argument_group(
        "Kubernetes discovery (vllm-router / sglang-router flags; docs/kubernetes.md)"
    )
    group.add_argument(
        "--service-discovery",
        action="store_true",
        help="find the workers as pods by label selector (discovery.kind kubernetes)",
    )
    for flag, role in (("--prefill-selector", "prefill"), ("--decode-selector", "decode")):
        group.add_argument(
            flag, nargs="+", metavar="KEY=VALUE", help=f"label selector of the {role} pods"
        )
    group.add_argument(
        "--selector",
        nargs="+",
        metavar="KEY=VALUE",
        help="label selector of pods that serve whole requests (role both)",
    )
    group.add_argument(
        "--service-discovery-namespace",
        metavar="NS",
        help="namespace watched (discovery.namespace)",
    )
    group.add_argument(
        "--service-discovery-port",
        type=int,
        metavar="PORT",
        help="the engines' port when no named port says it (discovery.port)",
    )
    group.add_argument(
        "--bootstrap-port-annotation",
        metavar="KEY",
        help="pod annotation of a prefill's bootstrap port (default sglang.ai/bootstrap-port)",
    )


def discovery_overrides(ns: argparse.Namespace) -> dict[str, Any]:
    """`{"discovery": {...}}` from the discovery flags ({} when none is given). A selector
    given without --service-discovery is refused: the peers ignore it silently, which hides
    a forgotten flag."""
    selectors = {
        "prefill_selector": getattr(ns, "prefill_selector", None),
        "decode_selector": getattr(ns, "decode_selector", None),
        "both_selector": getattr(ns, "selector", None),
    }
    given = {k: ",".join(t for term in v for t in term.split(",") if t) for k, v in
             selectors.items() if v}  # fmt: skip
    if not getattr(ns, "service_discovery", False):
        if given:
            raise _ExitTwo("a --*selector needs --service-discovery")
        return {}
    if not given:
        raise _ExitTwo("--service-discovery needs --prefill-selector/--decode-selector or "
                       "--selector")  # fmt: skip
    out: dict[str, Any] = {"kind": "kubernetes", **given}
    if ns.service_discovery_namespace:
        out["namespace"] = ns.service_discovery_namespace
    if ns.service_discovery_port is not None:
        # The peers' one port for every pod: no named port overrides it.
        out["port"], out["port_name"] = ns.service_discovery_port, ""
    if ns.bootstrap_port_annotation:
        out["bootstrap_port_annotation"] = ns.bootstrap_port_annotation
    if ns.adapter:
        out["adapter"] = ns.adapter
    elif ns.pd_disaggregation:
        out["adapter"] = "sglang"
    if ns.kv_blocks is not None:
        out["kv_blocks"] = ns.kv_blocks
    return {"discovery": out}


def flag_workers(ns: argparse.Namespace) -> list[FlagWorker]:
    """The workers named on the command line (their values are checked here: _ExitTwo)."""
    prefills = [_prefill_entry(values) for values in ns.prefill or ()]
    decodes = [FlagWorker(_url(url), "decode") for url in ns.decode or ()]
    if ns.vllm_pd_disaggregation and ns.pd_disaggregation:
        raise _ExitTwo("--vllm-pd-disaggregation and --pd-disaggregation exclude each other")
    if (prefills or decodes) and not ns.config and not (prefills and decodes):
        raise _ExitTwo("give at least one --prefill and one --decode (or a --config file)")
    urls = [w.url for w in prefills + decodes]
    if len(urls) != len(set(urls)):
        twice = sorted({u for u in urls if urls.count(u) > 1})
        raise _ExitTwo(
            f"{', '.join(twice)} given more than once (a worker that does both phases: a "
            "--config entry with role: both)"
        )
    if ns.kv_blocks is not None and ns.kv_blocks < 1:
        raise _ExitTwo("--kv-blocks must be >= 1")
    if ns.worker_startup_timeout_secs < 0:
        raise _ExitTwo("--worker-startup-timeout-secs must be >= 0")
    return prefills + decodes


def adapter_of(ns: argparse.Namespace, workers: Sequence[FlagWorker]) -> str:
    if ns.adapter:
        return str(ns.adapter)
    if ns.pd_disaggregation or any(w.bootstrap_port for w in workers):
        return "sglang"
    return "vllm"


async def discover_facts(
    workers: Sequence[FlagWorker], adapter: str, timeout_s: float
) -> list[WorkerFacts | None]:
    """Each worker's facts, asked again every half second until it answers or `timeout_s`
    has passed (workers often start after their router); None for those that never did."""
    deadline = time.monotonic() + timeout_s
    request_timeout = aiohttp.ClientTimeout(total=max(0.5, min(5.0, timeout_s)))

    async def one(session: aiohttp.ClientSession, w: FlagWorker) -> WorkerFacts | None:
        while True:
            try:
                return await fetch_worker_facts(session, w.url, adapter)
            except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
                if time.monotonic() >= deadline:
                    log.warning("worker %s did not tell its facts: %r", w.url, exc)
                    return None
            await asyncio.sleep(_POLL_S)

    async with aiohttp.ClientSession(timeout=request_timeout) as session:
        return list(await asyncio.gather(*(one(session, w) for w in workers)))


def _free_id(prefix: str, taken: set[str]) -> str:
    n = 0
    while f"{prefix}{n}" in taken:
        n += 1
    taken.add(f"{prefix}{n}")
    return f"{prefix}{n}"


def dropin_mapping(
    file_raw: Mapping[str, Any],
    workers: Sequence[FlagWorker],
    facts: Sequence[WorkerFacts | None],
    adapter: str,
    kv_blocks: int | None,
) -> dict[str, Any]:
    """The settings the flags add to the file's (pure: the precedence of the module doc)."""
    file_workers = list(file_raw.get("workers") or [])
    known_urls = {str(w.get("url", "")).rstrip("/") for w in file_workers if isinstance(w, Mapping)}
    taken = {str(w.get("id")) for w in file_workers if isinstance(w, Mapping)}
    added: list[dict[str, Any]] = []
    for w, fact in zip(workers, facts, strict=True):
        if w.url in known_urls:
            continue
        known_urls.add(w.url)
        entry: dict[str, Any] = {
            "id": _free_id("p" if w.role == "prefill" else "d", taken),
            "url": w.url,
            "role": w.role,
            "adapter": adapter,
            "discover_layout": True,
        }
        port = w.bootstrap_port or (fact.bootstrap_port if fact else None)
        if w.role == "prefill" and port is not None:
            entry["bootstrap_port"] = port
        if w.role == "decode":
            blocks = kv_blocks or (fact.kv_blocks if fact else None)
            if blocks is None and file_raw.get("perf") is None:
                why = "did not answer" if fact is None else "does not report its KV capacity"
                raise ConfigError(
                    f"decode worker {w.url} {why}: pass --kv-blocks N (or a --config with a "
                    "perf profile), or start the worker first"
                )
            if blocks is not None:
                entry["kv_blocks"] = blocks
        added.append(entry)
    out: dict[str, Any] = {"workers": file_workers + added}
    reported = [f for f in facts if f is not None]
    if not file_raw.get("models") and not file_raw.get("model"):
        names = list(dict.fromkeys(name for f in reported for name in f.models))
        if not names:
            raise ConfigError(
                "no worker told its served model name (/v1/models, /server_info): start the "
                "workers first, or name the model in a --config file"
            )
        out["models"] = names
    if "max_model_len" not in file_raw:
        lens = [f.max_model_len for f in reported if f.max_model_len]
        if lens:
            out["max_model_len"] = min(lens)
    return out


def load_serve_settings(
    ns: argparse.Namespace, env: Mapping[str, str], overrides: Mapping[str, Any]
) -> Settings:
    """`serve`'s settings: the file (if any), the environment, the scalar flags (`overrides`)
    and, with `--prefill`/`--decode`, the workers and what they report."""
    try:
        workers = flag_workers(ns)
        discovery = discovery_overrides(ns)
    except _ExitTwo as exc:
        raise ConfigError(str(exc)) from exc
    if not workers:
        return load_settings(ns.config, env=env, overrides={**overrides, **discovery})
    file_raw = read_config(ns.config) if ns.config else {}
    adapter = adapter_of(ns, workers)
    facts = asyncio.run(discover_facts(workers, adapter, ns.worker_startup_timeout_secs))
    for w, fact in zip(workers, facts, strict=True):
        if fact is not None:
            log.info("worker %s (%s, %s) reports %s", w.url, w.role, adapter, fact)
    added = dropin_mapping(file_raw, workers, facts, adapter, ns.kv_blocks)
    settings = load_settings(ns.config, env=env, overrides={**overrides, **added, **discovery})
    if settings.store.url is None:
        log.warning(
            "no --redis-url (nor store.url in a file, nor DISAGG_ROUTER_STORE_URL): state is "
            "kept in this process, so run one replica only"
        )
    return settings
