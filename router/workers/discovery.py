"""What workers report about themselves: load (for placement) and KV layout (for pairing).

    vLLM    GET /metrics       vllm:num_requests_running / _waiting, vllm:kv_cache_usage_perc,
                               vllm:cache_config_info{num_gpu_blocks=...} when exported
            GET /version, /v1/models                                   -> layout facts
    SGLang  GET /v1/loads      {"loads": [{"dp_rank", "num_running_reqs", "num_waiting_reqs",
                               "num_used_tokens", "max_total_num_tokens", ...}]} (0.5.x)
            GET /get_load      [{"dp_rank", "num_reqs", "num_waiting_reqs", "num_tokens"}] (older)
                               (older: {"load": n})
            GET /server_info   (falls back to /get_server_info)        -> capacity, layout facts

`WorkerFacts` is what a drop-in start-up (no configuration file, router/edge/dropin.py) reads: the
served model names and the decode capacity the engine reports.

Parsers are pure; the fetchers are thin. A `LoadSnapshot` knows when it was taken: data older
than the caller's max age is stale, and stale data never counts as idle — a worker that stopped
answering must not look like the emptiest one.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from multidict import CIMultiDict, CIMultiDictProxy
from yarl import URL

from policies.base import KVLayout
from router.redact import mask_url
from router.workers.prom_samples import Sample, label_value, samples

__all__ = [
    "LoadSnapshot",
    "fetch_layout_facts",
    "parse_vllm_metrics",
    "vllm_load",
    "VLLM_LOAD_NAMES",
    "parse_sglang_load",
    "fetch_vllm_load",
    "fetch_vllm_load_text",
    "fetch_sglang_load",
    "layout_facts_vllm",
    "layout_facts_sglang",
    "merge_layout",
    "fetch_layout",
    "WorkerFacts",
    "worker_facts_vllm",
    "worker_facts_sglang",
    "fetch_worker_facts",
    "fetch_server_facts",
]

Clock = Callable[[], float]


@dataclass(frozen=True, slots=True)
class LoadSnapshot:
    running: int  # sequences being prefilled or decoded
    waiting: int  # queued or preempted
    kv_usage: float | None  # fraction 0-1 of KV blocks in use, when reported
    num_gpu_blocks: int | None  # KV capacity in blocks, when reported
    at: float  # monotonic time it was read

    def stale(self, now: float, max_age_s: float) -> bool:
        return now - self.at > max_age_s

    def idle(self, now: float, max_age_s: float) -> bool:
        """Nothing running or waiting, known from fresh data."""
        return not self.stale(now, max_age_s) and self.running == 0 and self.waiting == 0

    def __repr__(self) -> str:
        usage = "?" if self.kv_usage is None else f"{self.kv_usage:.0%}"
        return (
            f"LoadSnapshot(run={self.running}, wait={self.waiting}, kv={usage}, at={self.at:.3f})"
        )


# --- vLLM ------------------------------------------------------------------------------------

_RUNNING = "vllm:num_requests_running"
_WAITING = "vllm:num_requests_waiting"
_KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")  # new name, pre-0.10 name
_CACHE_INFO = "vllm:cache_config_info"


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None


VLLM_LOAD_NAMES = frozenset((_RUNNING, _WAITING, *_KV_USAGE, _CACHE_INFO))
# Asked by name (`name[]`), prometheus_client answers only those families: these gauges are
# 1.7 KB of vLLM 0.32's 53 KB /metrics, which the engine would otherwise render and the
# router read once a second per worker. vLLM's `/metrics` route itself (its FastAPI
# instrumentator) ignores the names; `/metrics/` is prometheus_client's own ASGI app, which vLLM
# mounts beside it (0.32: vllm/entrypoints/serve/instrumentator/metrics.py) and which
# honours them. tests/real_vllm/test_load_poll.py checks it on a real engine.
LOAD_METRICS_PATH = "/metrics/?" + "&".join(f"name[]={n}" for n in sorted(VLLM_LOAD_NAMES))


def parse_vllm_metrics(text: str, at: float) -> LoadSnapshot:
    """A load record from vLLM's Prometheus text: sums over engines/models, the fullest cache.
    Only the lines of these gauges are read (router/workers/prom_samples.py): a real vLLM text
    is tens of kilobytes of histograms, read once a second per worker while serving."""
    return vllm_load(samples(text, VLLM_LOAD_NAMES), at)


def vllm_load(found: Iterable[Sample], at: float) -> LoadSnapshot:
    """The load record of vLLM's load gauge samples `found` (of `VLLM_LOAD_NAMES`; one rank's
    of a data-parallel server: router/workers/dp_loads.py). A count that is not finite (a
    buggy engine's NaN) counts as none."""
    running = waiting = 0.0
    usage: float | None = None
    blocks: int | None = None
    for name, labels, value in found:
        if name == _RUNNING:
            running += _finite(value) or 0.0
        elif name == _WAITING:
            waiting += _finite(value) or 0.0
        elif name == _CACHE_INFO:
            raw = label_value(labels, "num_gpu_blocks")
            if raw is not None and raw.isdigit():
                blocks = (blocks or 0) + int(raw)
        elif (finite := _finite(value)) is not None:  # a KV usage gauge
            usage = finite if usage is None else max(usage, finite)
    return LoadSnapshot(max(int(running), 0), max(int(waiting), 0), usage, blocks, at)


async def fetch_vllm_load(
    session: aiohttp.ClientSession, url: str, clock: Clock = time.monotonic
) -> LoadSnapshot:
    return parse_vllm_metrics(await fetch_vllm_load_text(session, url), clock())


async def fetch_vllm_load_text(session: aiohttp.ClientSession, url: str) -> str:
    """The /metrics text that carries the load gauges, asked for by name (LOAD_METRICS_PATH).

    A server that ignores `name[]` answers the whole text, which reads the same. One that has
    no `/metrics/` (a 4xx), or whose answer to the names lacks the running gauge, is asked for
    the whole `/metrics` in the same poll: an answer must never read as idle because a filter
    dropped the gauges (an older prometheus_client in multiprocess mode answers a restricted
    query with nothing). A 5xx is the engine's answer: the poll fails."""
    base = url.rstrip("/")
    text = await _metrics_text(session, base + LOAD_METRICS_PATH, missing_ok=True)
    if text is not None and _RUNNING in text:
        return text
    whole = await _metrics_text(session, base + "/metrics")
    assert whole is not None
    return whole


async def _metrics_text(
    session: aiohttp.ClientSession, url: str, missing_ok: bool = False
) -> str | None:
    """The text at `url`; None for a 4xx when `missing_ok`; else a 4xx or 5xx raises."""
    async with session.get(url) as resp:
        if missing_ok and 400 <= resp.status < 500:
            return None
        if resp.status >= 400:  # as raise_for_status, without the headers
            raise _refused(resp, "/metrics")
        return await resp.text()


# --- SGLang ----------------------------------------------------------------------------------


def _int(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return 0
    return int(value)


def parse_sglang_load(load: Any, server_info: Mapping[str, Any] | None, at: float) -> LoadSnapshot:
    """A load record summed over DP ranks: SGLang's `/v1/loads` (`{"loads": [{"num_running_reqs",
    "num_waiting_reqs", "num_used_tokens", "max_total_num_tokens", ...}]}`, 0.5.x), or the
    older `/get_load` (`[{"num_reqs", "num_waiting_reqs", "num_tokens"}]`, or `{"load"}`);
    `/server_info` for the capacity when the record does not give it, and the page size."""
    if isinstance(load, Mapping) and isinstance(load.get("loads"), list):
        load = load["loads"]
    ranks = load if isinstance(load, list) else [load] if isinstance(load, Mapping) else []
    running = waiting = tokens = capacity = 0
    for rank in ranks:
        if not isinstance(rank, Mapping):
            continue
        if "num_running_reqs" in rank:  # /v1/loads
            running += _int(rank.get("num_running_reqs"))
            waiting += _int(rank.get("num_waiting_reqs"))
            tokens += _int(rank.get("num_used_tokens"))
            capacity += _int(rank.get("max_total_num_tokens"))
        elif "num_reqs" in rank:  # /get_load: num_reqs counts the waiting ones too
            running += _int(rank.get("num_reqs")) - _int(rank.get("num_waiting_reqs"))
            waiting += _int(rank.get("num_waiting_reqs"))
            tokens += _int(rank.get("num_tokens"))
        else:
            running += _int(rank.get("load"))  # older SGLang: one number of requests
    usage: float | None = None
    blocks: int | None = None
    info = server_info or {}
    capacity = capacity or _int(info.get("max_total_num_tokens"))
    page = _int(info.get("page_size")) or 1
    if capacity > 0:
        blocks = capacity // page
        usage = min(1.0, tokens / capacity) if tokens else 0.0
    return LoadSnapshot(max(0, running), waiting, usage, blocks, at)


def _refused(resp: aiohttp.ClientResponse, what: str) -> aiohttp.ClientResponseError:
    """The error for a worker's non-200 answer, without the request's headers (its repr would
    show them: the worker's API key, a URL's credentials as `Basic ...`) and with the URL's
    credentials masked: these errors end up in logs and in admin answers."""
    url = URL(mask_url(str(resp.request_info.real_url)))
    info = aiohttp.RequestInfo(url, resp.method, CIMultiDictProxy(CIMultiDict()), url)
    return aiohttp.ClientResponseError(info, (), status=resp.status, message=what)


async def _get_json(session: aiohttp.ClientSession, url: str, *paths: str) -> Any:
    """The first path that answers 200 (SGLang renamed /get_server_info to /server_info)."""
    last: aiohttp.ClientResponseError | None = None
    for path in paths:
        async with session.get(url.rstrip("/") + path) as resp:
            if resp.status == 200:
                return await resp.json(content_type=None)
            last = _refused(resp, path)
    assert last is not None
    raise last


async def fetch_sglang_load(
    session: aiohttp.ClientSession, url: str, clock: Clock = time.monotonic
) -> LoadSnapshot:
    # /v1/loads since SGLang 0.5 (0.5.23 has no /get_load); /get_load before.
    load = await _get_json(session, url, "/v1/loads", "/get_load")
    info = await _get_json(session, url, "/server_info", "/get_server_info")
    return parse_sglang_load(load, info, clock())


# --- KV layout -------------------------------------------------------------------------------


def layout_facts_vllm(version: Any, models: Any) -> dict[str, Any]:
    """Layout fields a vLLM worker tells over HTTP: its version and the model it serves."""
    facts: dict[str, Any] = {"engine": "vllm"}
    if isinstance(version, Mapping) and isinstance(version.get("version"), str):
        facts["engine_version"] = version["version"]
    data = models.get("data") if isinstance(models, Mapping) else None
    if isinstance(data, list) and data and isinstance(data[0], Mapping):
        card = data[0]
        # The served name (`id`, an alias when --served-model-name is set), not `root` (the
        # weights' path): clients ask for the served name, and the router routes on it.
        model = card.get("id") or card.get("root")
        if isinstance(model, str):
            facts["model"] = model
    return facts


def layout_facts_sglang(info: Any) -> dict[str, Any]:
    """Layout fields from SGLang's `/server_info` (server args + version)."""
    if not isinstance(info, Mapping):
        return {"engine": "sglang"}
    facts: dict[str, Any] = {"engine": "sglang"}
    if isinstance(info.get("version"), str):
        facts["engine_version"] = info["version"]
    # The served name when set (clients ask for it), else the model path (SGLang's default).
    for key in ("served_model_name", "model_path"):
        if isinstance(info.get(key), str) and info[key]:
            facts["model"] = info[key]
            break
    dtype = info.get("kv_cache_dtype")
    if not isinstance(dtype, str) or dtype == "auto":
        dtype = info.get("dtype")
    if isinstance(dtype, str) and dtype != "auto":
        facts["dtype"] = dtype
    if _int(info.get("tp_size")) > 0:
        facts["tp_size"] = _int(info["tp_size"])
    if _int(info.get("page_size")) > 0:
        facts["block_size"] = _int(info["page_size"])
    backend = info.get("disaggregation_transfer_backend")
    if isinstance(backend, str):
        facts["connector"] = backend
    return facts


def merge_layout(
    defaults: KVLayout, discovered: Mapping[str, Any], configured: Mapping[str, Any]
) -> KVLayout:
    """Configured fields win over discovered ones, which win over the defaults.

    What HTTP cannot tell (KV heads, head dim, the connector's version) comes from configuration;
    unknown keys are refused so a typo cannot silently pair incompatible workers.
    """
    known = {f.name for f in dataclasses.fields(KVLayout)}
    unknown = (set(discovered) | set(configured)) - known
    if unknown:
        raise ValueError(f"unknown KV layout fields {sorted(unknown)}; known: {sorted(known)}")
    return dataclasses.replace(defaults, **{**discovered, **configured})


async def fetch_layout_facts(
    session: aiohttp.ClientSession, url: str, engine: str
) -> dict[str, Any]:
    """The layout fields one worker reports about itself.

    `engine` is the worker's adapter: "vllm"/"sim"/"mooncake" read `/version` and `/v1/models`;
    "sglang" reads `/server_info` (or `/get_server_info`).
    """
    if engine == "sglang":
        return layout_facts_sglang(
            await _get_json(session, url, "/server_info", "/get_server_info")
        )
    version = await _get_json(session, url, "/version")
    models = await _get_json(session, url, "/v1/models")
    facts = layout_facts_vllm(version, models)
    if engine == "sim":
        facts["engine"] = "sim"
    return facts


async def fetch_server_facts(
    session: aiohttp.ClientSession, url: str, engine: str
) -> tuple[dict[str, Any], WorkerFacts | None]:
    """(layout fields, SGLang's `WorkerFacts` or None) one worker reports about itself: for
    SGLang one `/server_info` read gives both (its bootstrap port, the role it serves)."""
    if engine != "sglang":
        return await fetch_layout_facts(session, url, engine), None
    info = await _get_json(session, url, "/server_info", "/get_server_info")
    return layout_facts_sglang(info), worker_facts_sglang(info)


async def fetch_layout(
    session: aiohttp.ClientSession,
    url: str,
    engine: str,
    defaults: KVLayout,
    configured: Mapping[str, Any] | None = None,
) -> KVLayout:
    """The layout descriptor of one worker: what it reports, merged with configuration."""
    facts = await fetch_layout_facts(session, url, engine)
    return merge_layout(defaults, facts, configured or {})


# --- what a drop-in start-up reads (router/edge/dropin.py) ----------------------------------------


@dataclass(frozen=True, slots=True)
class WorkerFacts:
    """What one worker tells about itself that a configuration file would otherwise say."""

    models: tuple[str, ...] = ()  # served model names, as clients ask for them
    kv_blocks: int | None = None  # KV capacity in blocks, when the engine reports it
    block_size: int | None = None  # tokens per block (vLLM) / page (SGLang)
    max_model_len: int | None = None
    bootstrap_port: int | None = None  # SGLang prefill: its KV bootstrap server
    # SGLang: the role it serves now, "prefill" | "decode" ("both": not in PD mode, it serves
    # whole requests), and whether it can switch at run time (--enable-pd-role-switch).
    pd_mode: str | None = None
    pd_role_switch: bool = False
    # SGLang decode: its CUDA graphs, as a role switch to decode takes them back
    # (`decode_cuda_graph_bs`, `decode_cuda_graph_memory_gb`); empty when it reports none.
    decode_graphs: Mapping[str, Any] = field(default_factory=dict)


def _positive(value: object) -> int | None:
    number = _int(value)
    return number if number > 0 else None


def worker_facts_vllm(models: Any, metrics_text: str | None) -> WorkerFacts:
    """vLLM: every served name of `/v1/models` (with its `max_model_len`), and the capacity
    of `vllm:cache_config_info{num_gpu_blocks, block_size}` in `/metrics`."""
    names: list[str] = []
    lens: list[int] = []
    data = models.get("data") if isinstance(models, Mapping) else None
    for card in data if isinstance(data, list) else []:
        if isinstance(card, Mapping) and isinstance(card.get("id"), str) and card["id"]:
            names.append(card["id"])
            if (length := _positive(card.get("max_model_len"))) is not None:
                lens.append(length)
    blocks = block_size = None
    if metrics_text:
        blocks = parse_vllm_metrics(metrics_text, 0.0).num_gpu_blocks or None
        for sample in samples(metrics_text, frozenset((_CACHE_INFO,))):
            raw = label_value(sample.labels, "block_size")
            if raw is not None and raw.isdigit():
                block_size = int(raw) or None
    return WorkerFacts(
        models=tuple(dict.fromkeys(names)),
        kv_blocks=blocks,
        block_size=block_size,
        max_model_len=min(lens) if lens else None,
    )


def worker_facts_sglang(info: Any) -> WorkerFacts:
    """SGLang's `/server_info`: served name (else model path), `max_total_num_tokens` over
    `page_size` for the capacity, `context_length`, `disaggregation_bootstrap_port`."""
    if not isinstance(info, Mapping):
        return WorkerFacts()
    model = layout_facts_sglang(info).get("model")
    page = _positive(info.get("page_size")) or 1
    tokens = _positive(info.get("max_total_num_tokens"))
    return WorkerFacts(
        models=(model,) if isinstance(model, str) else (),
        kv_blocks=tokens // page if tokens else None,
        block_size=page,
        max_model_len=_positive(info.get("context_length")),
        bootstrap_port=_positive(info.get("disaggregation_bootstrap_port")),
        pd_mode=_pd_mode(info),
        pd_role_switch=info.get("enable_pd_role_switch") is True,
        decode_graphs=_decode_graphs(info),
    )


_PD_MODES = {"prefill": "prefill", "decode": "decode", "null": "both"}


def _decode_graphs(info: Mapping[str, Any]) -> dict[str, Any]:
    """What a decode scheduler reports of its CUDA graphs (InternalState._add_disaggregation),
    for a role switch to decode to be given back: SGLang refuses to capture decode graphs
    without `decode_cuda_graph_memory_gb` (role_switch.handle_pd_role_switch)."""
    states = info.get("internal_states")
    first = states[0] if isinstance(states, list) and states else None
    if not isinstance(first, Mapping) or first.get("disaggregation_mode") != "decode":
        return {}
    out: dict[str, Any] = {}
    sizes = first.get("decode_cuda_graph_bs")
    if isinstance(sizes, list) and all(isinstance(b, int) for b in sizes):
        out["decode_cuda_graph_bs"] = sizes
    memory = first.get("decode_cuda_graph_memory_gb")
    if isinstance(memory, (int, float)) and not isinstance(memory, bool) and memory >= 0:
        out["decode_cuda_graph_memory_gb"] = float(memory)
    return out


def _pd_mode(info: Mapping[str, Any]) -> str | None:
    """The role an SGLang instance serves now. Its top-level `disaggregation_mode` is the
    start-up server args' (SGLang 0.5.23 http_server.server_info: a role switch leaves it as
    it was); each scheduler reports its own in `internal_states` (InternalState.
    _add_disaggregation, set again at every flip). Schedulers that disagree (a switch half
    done across DP ranks): None, not known. An older SGLang without it: the top level."""
    states = info.get("internal_states")
    modes = {
        s.get("disaggregation_mode")
        for s in (states if isinstance(states, list) else [])
        if isinstance(s, Mapping) and "disaggregation_mode" in s
    }
    if len(modes) > 1:
        return None
    live = modes.pop() if modes else info.get("disaggregation_mode")
    return _PD_MODES.get(str(live))


async def fetch_worker_facts(session: aiohttp.ClientSession, url: str, engine: str) -> WorkerFacts:
    """Ask one worker (adapter `engine`) for its `WorkerFacts`. vLLM's `/metrics` is optional:
    an engine that does not export it still tells its models."""
    if engine == "sglang":
        return worker_facts_sglang(
            await _get_json(session, url, "/server_info", "/get_server_info")
        )
    models = await _get_json(session, url, "/v1/models")
    metrics: str | None = None
    async with session.get(url.rstrip("/") + "/metrics") as resp:
        if resp.status == 200:
            metrics = await resp.text()
    return worker_facts_vllm(models, metrics)
