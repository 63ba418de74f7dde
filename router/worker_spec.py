"""One worker's configuration: `WorkerSpec`, and `parse_worker`, which checks a worker entry of
the config file (or of a registration: POST /admin/workers) and fills it from the defaults.

Every check says where and how the entry is wrong (`ConfigError`), and bounds what would not fit
the int64 that Redis and the JSON answers carry.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any
from urllib.parse import urlsplit

from policies.base import KVLayout
from policies.costmodel import PerfModel, perf_model
from router.redact import masked_repr

__all__ = [
    "ConfigError",
    "KvEventsSpec",
    "Secret",
    "WorkerSpec",
    "check_int",
    "parse_layout",
    "parse_perf",
    "parse_worker",
]


class ConfigError(ValueError):
    """The configuration is wrong; the message says where and how."""


class Secret(str):
    """A string that hides itself wherever it is printed (API keys, tokens): its repr, str(),
    f-strings, `%s` and format() show `***`. Comparisons, `encode()` and hashing see the value;
    `reveal()` is the value as a plain str, for the one place that sends it (a header)."""

    def __new__(cls, value: object = "") -> Secret:
        # str(a Secret) is its mask: a Secret made from a Secret keeps the value, not "***" (the
        # environment's parser makes one, and the auth group wraps what it is given again).
        if isinstance(value, Secret):
            value = value.reveal()
        return super().__new__(cls, value)

    def __repr__(self) -> str:
        return "Secret('***')" if self else "Secret('')"

    def __str__(self) -> str:
        return "***" if self else ""

    def __format__(self, spec: str) -> str:
        return format(str(self), spec)

    def reveal(self) -> str:
        return str.__str__(self)  # str's own: an exact str of the value


@dataclass(frozen=True, slots=True)
class KvEventsSpec:
    """Where a worker publishes its KV-cache events (vLLM's `--kv-events-config`): the ZeroMQ
    PUB endpoint the router's subscriber connects to, the optional ROUTER replay endpoint that
    serves missed batches, and the topic (empty: every topic). router/workers/kv_events.py.
    The worker's index is bounded by (its GPU blocks + `offload_blocks`, a CPU tier's, in the
    engine's blocks) x `index_slack`: a stream that claims more is dropped."""

    endpoint: str
    replay_endpoint: str | None = None
    topic: str = ""
    offload_blocks: int = 0
    index_slack: float = 2.0


def _parse_kv_events(raw: Any, where: str) -> KvEventsSpec | None:
    if raw is None:
        return None
    if isinstance(raw, KvEventsSpec):
        return raw
    if not isinstance(raw, Mapping) or not raw.get("endpoint"):
        raise ConfigError(f"{where}.kv_events: expected {{endpoint: tcp://HOST:PORT[, ...]}}")
    unknown = set(raw) - {"endpoint", "replay_endpoint", "topic", "offload_blocks", "index_slack"}
    if unknown:
        raise ConfigError(f"{where}.kv_events: unknown keys {sorted(unknown)}")
    for key in ("endpoint", "replay_endpoint"):
        value = raw.get(key)
        if value is not None and (
            not isinstance(value, str) or not value.startswith(("tcp://", "ipc://"))
        ):
            raise ConfigError(f"{where}.kv_events.{key}: expected tcp://HOST:PORT or ipc://PATH")
    topic = raw.get("topic", "")
    if not isinstance(topic, str) or len(topic) > 256:
        raise ConfigError(f"{where}.kv_events.topic: expected a string")
    offload = _optional_int(
        f"{where}.kv_events.offload_blocks", raw.get("offload_blocks"), 0, _MAX_COUNT
    )
    slack = raw.get("index_slack", 2.0)
    if isinstance(slack, bool) or not isinstance(slack, int | float) or not 1 <= slack <= 100:
        raise ConfigError(f"{where}.kv_events.index_slack: expected a number from 1 to 100")
    return KvEventsSpec(
        raw["endpoint"], raw.get("replay_endpoint"), topic, offload or 0, float(slack)
    )


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    id: str
    url: str
    role: str  # prefill | decode | both
    adapter: str = "vllm"  # vllm | sim | sglang | mooncake
    bootstrap_port: int | None = None  # SGLang / Mooncake: the prefill's KV bootstrap port
    engine_id: str | None = None  # Mooncake: the prefill engine id (else asked at start-up)
    group: str = "default"
    layout: KVLayout = field(default_factory=KVLayout)
    perf: PerfModel | None = None
    kv_blocks: int | None = None  # decode capacity; None = from the cost model
    stranded_cap_bytes: int = 0  # prefill backpressure; 0 = no cap
    # LoRA adapters (docs/lora.md): 0 = the engine serves none (vLLM without --enable-lora);
    # else its --max-loras, the adapters it keeps active at once. `lora_runtime_loading`: the
    # router may load a catalog adapter on it (VLLM_ALLOW_RUNTIME_LORA_UPDATING=True).
    max_loras: int = 0
    lora_runtime_loading: bool = False
    api_key: Secret = Secret("")
    # Read the layout from the worker (/version, /v1/models; SGLang /server_info) before using
    # it; `layout_configured` are the fields its own entry set, which win over what it reports.
    discover_layout: bool = False
    layout_configured: tuple[tuple[str, Any], ...] = ()
    kv_events: KvEventsSpec | None = None  # None: no events, the prefix affinity is estimated
    # False: `bootstrap_port` is what an SGLang prefill's /server_info reported (or not read yet)
    bootstrap_configured: bool = True
    # Kubernetes discovery (router/workers/kube/): the pod it was found as ("namespace/name"; ""
    # for a worker of the file or the admin API) and its revision (the pod-template-hash or the
    # configured label): shown to operators; pairing itself goes by `layout`.
    pod: str = ""
    revision: str = ""
    # Data parallelism (docs/data-parallel.md): `dp_size` engines behind one URL, each its own
    # queue and KV pool of `kv_blocks` (per rank). The membership expands such an entry into one
    # placement target per rank (router/workers/dp_ranks.py): id `<id>@<rank>`, `dp_rank` set,
    # `dp_parent` the entry's id.
    dp_size: int = 1
    dp_rank: int | None = None
    dp_parent: str = ""

    __repr__ = masked_repr  # a URL's password is not shown

    @property
    def is_prefill(self) -> bool:
        return self.role in ("prefill", "both")

    @property
    def reads_bootstrap_port(self) -> bool:
        """An SGLang prefill whose entry gives no `bootstrap_port`: its /server_info's
        `disaggregation_bootstrap_port` is read before it is used (and again after it was out:
        a restarted engine may have another)."""
        return self.adapter == "sglang" and self.is_prefill and not self.bootstrap_configured

    @property
    def switches_engine_role(self) -> bool:
        """An SGLang `both` worker: one engine serving one PD role at a time, which the role
        manager flips through SGLang's runtime role switch (router/workers/engine_role.py);
        the role it serves is read from its /server_info. (A vLLM kv_both engine serves both
        sides at once: its role is the router's choice alone.)"""
        return self.adapter == "sglang" and self.role == "both"

    @property
    def reads_server_facts(self) -> bool:
        """Out of rotation until the worker itself has told what its entry leaves out."""
        return self.discover_layout or self.reads_bootstrap_port or self.switches_engine_role

    @property
    def is_decode(self) -> bool:
        return self.role in ("decode", "both")

    def serves(self, model: str | None) -> bool:
        """Whether this worker serves `model` (None or "": any): its layout names that model,
        or names none (it serves every one)."""
        return not model or not self.layout.model or self.layout.model == model

    @property
    def capacity_blocks(self) -> int:
        if self.kv_blocks is not None:
            return self.kv_blocks
        if self.perf is None:
            raise ConfigError(f"worker {self.id}: set kv_blocks or a perf profile")
        return self.perf.kv_capacity_blocks


def parse_layout(raw: Mapping[str, Any] | None, defaults: KVLayout) -> KVLayout:
    if not raw:
        return defaults
    if not isinstance(raw, Mapping):
        raise ConfigError("layout: expected a mapping")
    known = {f.name for f in fields(KVLayout)}
    unknown = set(raw) - known
    if unknown:
        raise ConfigError(f"layout: unknown keys {sorted(unknown)}; known: {sorted(known)}")
    for key, value in raw.items():
        # Each field keeps its type: the layout is compared and shown (model names in
        # /v1/models), so a number where a name belongs must not slip through.
        want = type(getattr(defaults, key))
        if want is int:
            check_int(f"layout.{key}", value, 0, _MAX_COUNT)
        elif not isinstance(value, str) or len(value) > 256:
            raise ConfigError(f"layout.{key}: expected a string (at most 256 characters)")
    return replace(defaults, **raw)


# Counts (blocks, bytes) beyond this are configuration mistakes, and would not fit the int64
# that Redis and the JSON answers carry.
_MAX_COUNT = 2**53


def check_int(name: str, value: Any, low: int, high: int) -> int:
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise ConfigError(f"{name}: expected an integer from {low} to {high}, not {value!r}")
    return value


def _check_str(name: str, value: Any, max_len: int = 256) -> str:
    if not isinstance(value, str) or not value or len(value) > max_len:
        raise ConfigError(f"{name}: expected a non-empty string of at most {max_len} characters")
    if any(ch.isspace() or not ch.isprintable() for ch in value):
        raise ConfigError(f"{name}: must not contain spaces or control characters")
    return value


def parse_perf(raw: Any, where: str) -> PerfModel | None:
    if raw is None:
        return None
    if not isinstance(raw, Mapping) or "model" not in raw or "gpu" not in raw:
        raise ConfigError(f"{where}.perf: expected {{model: NAME, gpu: NAME[, tp_size: N]}}")
    kw = dict(raw)
    tp_size = kw.pop("tp_size", None)
    if tp_size is not None:
        tp_size = check_int(f"{where}.perf.tp_size", tp_size, 1, 1024)
    try:
        return perf_model(kw.pop("model"), kw.pop("gpu"), tp_size, **kw)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{where}.perf: {exc}") from exc


_WORKER_KEYS = {
    "id",
    "url",
    "role",
    "adapter",
    "group",
    "layout",
    "perf",
    "kv_blocks",
    "stranded_cap_bytes",
    "max_loras",
    "lora_runtime_loading",
    "api_key",
    "bootstrap_port",
    "engine_id",
    "discover_layout",
    "kv_events",
    "pod",
    "revision",
    "dp_size",
    "data_parallel_size",
}
_ADAPTERS = ("vllm", "sim", "sglang", "mooncake")


def _optional_int(name: str, value: Any, low: int, high: int) -> int | None:
    return None if value is None else check_int(name, value, low, high)


def _parse_dp_size(raw: Mapping[str, Any], wid: str, where: str) -> int:
    """`dp_size` (or vLLM's name, `data_parallel_size`): ranks behind the URL, 1 to 1024. A
    rank's id is `<id>@<rank>`, so a DP entry's own id may hold no '@'; an SGLang `both`
    engine flips its one PD role for every rank at once, which per-rank roles cannot follow."""
    if "dp_size" in raw and "data_parallel_size" in raw:
        raise ConfigError(f"{where}: give dp_size or data_parallel_size, not both")
    key = "dp_size" if "dp_size" in raw else "data_parallel_size"
    size = check_int(f"{where}.{key}", raw.get(key, 1), 1, 1024)
    if size > 1 and "@" in wid:
        raise ConfigError(f"{where}.id: a worker with {key} > 1 may hold no '@' in its id")
    if size > 1 and raw.get("adapter") == "sglang" and raw.get("role") == "both":
        raise ConfigError(
            f"{where}: an SGLang `both` worker switches its PD role for all its ranks at once: "
            f"{key} > 1 is not served for it"
        )
    return size


def parse_worker(
    raw: Any, default_perf: PerfModel | None, layout: KVLayout, where: str = "worker"
) -> WorkerSpec:
    """One worker entry (YAML, or a registration through the admin API) -> WorkerSpec."""
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{where}: expected a mapping")
    unknown = set(raw) - _WORKER_KEYS
    if unknown:
        raise ConfigError(f"{where}: unknown keys {sorted(unknown)}")
    for key in ("id", "url", "role"):
        if raw.get(key) in (None, ""):
            raise ConfigError(f"{where}: '{key}' is required")
    # An id names Redis keys inside a Redis Cluster hash tag: no braces (state/keys.py).
    wid = _check_str(f"{where}.id", str(raw["id"]) if isinstance(raw["id"], int) else raw["id"])
    if "{" in wid or "}" in wid or len(wid) > 128:
        raise ConfigError(f"{where}.id: at most 128 characters, no '{{' or '}}'")
    url = _check_str(f"{where}.url", raw["url"], 2048)
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(f"{where}.url: expected http://host:port or https://..., not {url!r}")
    try:
        parts.port  # noqa: B018 - a bad port raises here, not on the first request
    except ValueError as exc:
        raise ConfigError(f"{where}.url: {exc}") from exc
    for key in ("group", "engine_id", "api_key", "pod", "revision"):
        if raw.get(key) is not None:
            _check_str(f"{where}.{key}", raw[key], 4096 if key == "api_key" else 256)
    if raw.get("api_key") and "@" in parts.netloc:
        # Both would be an Authorization header: aiohttp refuses the request (a 500).
        raise ConfigError(
            f"{where}: an api_key and credentials in the url (user:password@) cannot both be "
            "given: the worker gets one Authorization header"
        )
    if raw["role"] not in ("prefill", "decode", "both"):
        raise ConfigError(f"{where}: role must be prefill, decode or both, not {raw['role']!r}")
    if raw.get("adapter", "vllm") not in _ADAPTERS:
        raise ConfigError(f"{where}: adapter must be one of {', '.join(_ADAPTERS)}")
    perf = parse_perf(raw.get("perf"), where) or default_perf
    discover = raw.get("discover_layout", False)
    if not isinstance(discover, bool):
        raise ConfigError(f"{where}: discover_layout must be true or false")
    configured = raw.get("layout") or {}
    kv_blocks = _optional_int(f"{where}.kv_blocks", raw.get("kv_blocks"), 1, _MAX_COUNT)
    max_loras = check_int(f"{where}.max_loras", raw.get("max_loras", 0), 0, 4096)
    lora_runtime = raw.get("lora_runtime_loading", False)
    if not isinstance(lora_runtime, bool):
        raise ConfigError(f"{where}: lora_runtime_loading must be true or false")
    stranded_cap = check_int(
        f"{where}.stranded_cap_bytes", raw.get("stranded_cap_bytes", 0), 0, _MAX_COUNT
    )
    dp_size = _parse_dp_size(raw, wid, where)
    spec = WorkerSpec(
        id=wid,
        url=url.rstrip("/"),
        role=raw["role"],
        adapter=raw.get("adapter", "vllm"),
        bootstrap_port=_optional_int(
            f"{where}.bootstrap_port", raw.get("bootstrap_port"), 1, 65535
        ),
        engine_id=raw.get("engine_id"),
        group=str(raw.get("group", "default")),
        layout=parse_layout(raw.get("layout"), layout),
        perf=perf,
        kv_blocks=kv_blocks,
        stranded_cap_bytes=stranded_cap,
        max_loras=max_loras,
        lora_runtime_loading=lora_runtime,
        api_key=Secret(raw.get("api_key") or ""),
        discover_layout=discover,
        layout_configured=tuple(sorted(configured.items())) if discover else (),
        kv_events=_parse_kv_events(raw.get("kv_events"), where),
        bootstrap_configured=raw.get("bootstrap_port") is not None,
        pod=str(raw.get("pod") or ""),
        revision=str(raw.get("revision") or ""),
        dp_size=dp_size,
    )
    if spec.is_decode:
        try:
            check_int(f"{where}: its KV capacity", spec.capacity_blocks, 1, _MAX_COUNT)
        except TypeError as exc:  # a perf profile whose numbers do not multiply
            raise ConfigError(f"{where}: cannot compute its KV capacity: {exc}") from exc
    return spec
