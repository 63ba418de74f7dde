"""Router settings: one frozen, validated object built once from file + environment + flags.

Precedence: command-line flags > environment (`DISAGG_ROUTER_*`) > the YAML file > defaults.
Nothing else in the router reads `os.environ`. The settings are grouped (router/settings_groups.py:
`store:`, `auth:`, `loops:`, ...); every scalar one is also read from the environment as
DISAGG_ROUTER_<GROUP>_<FIELD> (DISAGG_ROUTER_<FIELD> at the top level, e.g. DISAGG_ROUTER_POLICY).
The flat names of before the groups still load for one release (router/config_renames.py).
The reference, generated from the fields' docs: docs/configuration.md.

A minimal cluster.yaml:

    model: llama-3-8b             # served model name(s): a string or a list
    store: {url: "redis://127.0.0.1:6379/0"}
    perf: {model: llama-3-8b, gpu: h100}   # cost-model profile of the workers (per worker too)
    workers:
      - {id: p0, url: http://10.0.0.1:8000, role: prefill}
      - {id: d0, url: http://10.0.0.2:8000, role: decode, kv_blocks: 24000}
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields, is_dataclass
from pathlib import Path
from types import NoneType, UnionType
from typing import Any, Union, get_args, get_origin, get_type_hints

import yaml

from policies.base import KVLayout
from policies.costmodel import PerfModel
from policies.scaling import ScalingSLO
from router.admission import AdmissionSettings
from router.config_renames import ENV_PREFIX, env_name, move_old_env, move_old_keys
from router.lora_settings import LoraSettings
from router.redact import masked_repr
from router.settings_groups import (
    ApiSettings,
    AuthSettings,
    BreakerSettings,
    DiscoverySettings,
    EstimateSettings,
    LeaseSettings,
    LoopSettings,
    OverrunSettings,
    PreemptionSettings,
    RetrySettings,
    RoleSettings,
    ServerSettings,
    StoreSettings,
    Timeouts,
    UpstreamSettings,
    setting,
)
from router.tenants import Keyring, KeySpec, TenantSpec, parse_tenants
from router.worker_spec import (
    ConfigError,
    WorkerSpec,
    parse_layout,
    parse_perf,
    parse_worker,
)

__all__ = [
    "BreakerSettings",
    "ConfigError",
    "DiscoverySettings",
    "ENV_PREFIX",
    "GROUPS",
    "PreemptionSettings",
    "RetrySettings",
    "RoleSettings",
    "Settings",
    "Timeouts",
    "env_fields",
    "load_settings",
    "merged_settings",
    "read_config",
    "settings_from_mapping",
]


@dataclass(frozen=True, slots=True)
class Settings:
    """Everything the router is configured with (docs/configuration.md)."""

    models: tuple[str, ...] = setting(
        ("llama-3-8b",), doc="served model name(s): a string or a list (also `model:`)"
    )
    max_model_len: int | None = setting(
        None, doc="longest context accepted; default: the perf profile's"
    )
    kv_bytes_per_token: int = setting(
        131_072, doc="KV-cache bytes per token; default: the perf profile's"
    )
    workers: tuple[WorkerSpec, ...] = setting(
        (), doc="the workers: a list of {id, url, role, adapter, kv_blocks, perf, layout, ...}"
    )
    default_perf: PerfModel | None = setting(
        None,
        doc="cost-model profile of the workers, e.g. {model, gpu} (per worker too)",
        key="perf",
    )
    default_layout: KVLayout = setting(
        doc="KV layout of the workers (kv_heads, head_dim, block_size, tp_size); default: the "
        "perf profile's",
        factory=KVLayout,
        key="layout",
    )
    policy: str = setting("two_sided", doc="placement policy: a name or a dotted path")
    policy_args: Mapping[str, Any] = setting(doc="the placement policy's arguments", factory=dict)
    tenants: tuple[TenantSpec, ...] = setting(
        (),
        doc="a list of {name, weight, priority, requests_per_minute, tokens_per_minute, "
        "max_reserved_blocks, keys: [...]} (router/tenants.py); keys are kept hashed only; "
        "priority (alias class): the most urgent class the tenant's requests may have — "
        "interactive, default, batch or an integer (-1, 0, 1: lower first)",
    )
    tenant_keys: tuple[KeySpec, ...] = setting(
        (), doc="the tenants' keys, hashed (built from `tenants`)", show=False, key=""
    )
    tracing: bool = setting(
        False,
        doc="OpenTelemetry spans per request, traceparent to the workers (needs the `otel` extra)",
    )
    server: ServerSettings = setting(doc="the router's HTTP server", factory=ServerSettings)
    store: StoreSettings = setting(doc="the shared state store (Redis)", factory=StoreSettings)
    auth: AuthSettings = setting(doc="who may call the router", factory=AuthSettings)
    loops: LoopSettings = setting(doc="the background loops' periods", factory=LoopSettings)
    leases: LeaseSettings = setting(doc="holdings' leases in the store", factory=LeaseSettings)
    upstream: UpstreamSettings = setting(
        doc="how the router talks to its workers", factory=UpstreamSettings
    )
    estimates: EstimateSettings = setting(
        doc="prompt and output length estimates", factory=EstimateSettings
    )
    overruns: OverrunSettings = setting(
        doc="decode room kept back after forced growth", factory=OverrunSettings
    )
    api: ApiSettings = setting(doc="the OpenAI-compatible API's limits", factory=ApiSettings)
    timeouts: Timeouts = setting(doc="request and client deadlines", factory=Timeouts)
    retry: RetrySettings = setting(doc="retries and their budget", factory=RetrySettings)
    preemption: PreemptionSettings = setting(
        doc="preemption with exact resume", factory=PreemptionSettings
    )
    admission: AdmissionSettings = setting(
        doc="the admission queue and its fairness", factory=AdmissionSettings
    )
    breaker: BreakerSettings = setting(doc="workers' circuit breakers", factory=BreakerSettings)
    scaling: ScalingSLO = setting(
        doc="the SLOs the autoscaling recommendation sizes pools for (router/control/scaling.py)",
        factory=ScalingSLO,
    )
    roles: RoleSettings = setting(doc="`both` workers' roles", factory=RoleSettings)
    lora: LoraSettings = setting(
        doc="LoRA adapters: the catalog the router may load (docs/lora.md)", factory=LoraSettings
    )
    discovery: DiscoverySettings = setting(
        doc="where the workers come from: the file and the admin API, or Kubernetes "
        "(docs/kubernetes.md)",
        factory=DiscoverySettings,
    )

    __repr__ = masked_repr  # the Redis and worker URLs' passwords are not shown

    @property
    def client_keys(self) -> bool:
        """Whether clients need a key (any configured: `auth.api_keys` or a tenant's)."""
        return bool(self.auth.api_keys or self.tenant_keys)

    def __post_init__(self) -> None:
        if not self.models:
            raise ConfigError("models: at least one served model name is needed")
        ids = [w.id for w in self.workers]
        if len(ids) != len(set(ids)):
            raise ConfigError(f"workers: duplicate ids in {ids}")
        try:
            Keyring(self.tenants, self.tenant_keys, self.auth.api_keys)  # no key twice
        except ValueError as exc:
            raise ConfigError(f"tenants: {exc}") from exc
        auth = self.auth
        if not (auth.public_metrics and auth.public_openapi) and not (
            self.client_keys or auth.admin_token or auth.admin_read_token
        ):
            raise ConfigError(
                "auth.public_metrics / auth.public_openapi: false needs a credential to accept: "
                "set auth.api_keys, auth.admin_token, auth.admin_read_token or a tenant's keys"
            )


_HINTS = get_type_hints(Settings)
# The groups: a mapping in the file, a settings class in Settings.
GROUPS: dict[str, type] = {
    f.name: _HINTS[f.name]
    for f in fields(Settings)
    if is_dataclass(_HINTS[f.name]) and "key" not in f.metadata  # not `layout:`, parsed apart
}


def _scalar(hint: Any) -> type | None:
    """The one scalar type (str, int, float, bool) a setting holds, `tuple` for a tuple of
    strings (comma-separated in a variable), None for the others."""
    if get_origin(hint) in (Union, UnionType):
        kinds = [a for a in get_args(hint) if a is not NoneType]
        hint = kinds[0] if len(kinds) == 1 else None
    if get_origin(hint) is tuple:
        item = get_args(hint)[0]
        return tuple if isinstance(item, type) and issubclass(item, str) else None
    if isinstance(hint, type) and issubclass(hint, (str, int, float)):
        return hint
    return None


def env_fields() -> list[tuple[str | None, str, type]]:
    """(group or None, field, type) of every setting the environment may set: the scalars
    and the lists of strings."""
    out: list[tuple[str | None, str, type]] = []
    for f in fields(Settings):
        if f.name in GROUPS:
            hints = get_type_hints(GROUPS[f.name])
            for g in fields(GROUPS[f.name]):
                typ = _scalar(hints[g.name])
                if typ is not None:
                    out.append((f.name, g.name, typ))
        elif f.metadata.get("key") != "" and (typ := _scalar(_HINTS[f.name])) is not None:
            out.append((None, f.name, typ))
    return out


_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def _parse_env(var: str, value: str, typ: type) -> Any:
    if typ is bool:
        if value.lower() not in _TRUE + _FALSE:
            raise ConfigError(f"{var}: {value!r} is not a boolean (true/false)")
        return value.lower() in _TRUE
    if typ is tuple:
        return tuple(item.strip() for item in value.split(",") if item.strip())
    try:
        return typ(value)
    except ValueError as exc:
        raise ConfigError(f"{var}: {exc}") from exc


def _from_env(env: Mapping[str, str]) -> dict[str, Any]:
    env = move_old_env(env)
    raw: dict[str, Any] = {}
    for group, name, typ in env_fields():
        var = env_name(group, name)
        value = env.get(var)
        if value in (None, ""):
            continue
        parsed = _parse_env(var, str(value), typ)
        if group is None:
            raw[name] = parsed
        else:
            raw.setdefault(group, {})[name] = parsed
    return raw


def _without_none(raw: Mapping[str, Any]) -> dict[str, Any]:
    """A flag not given is None: it sets nothing (in a group neither)."""
    out: dict[str, Any] = {}
    for key, value in raw.items():
        if key in GROUPS and isinstance(value, Mapping):
            value = {k: v for k, v in value.items() if v is not None} or None
        if value is not None:
            out[key] = value
    return out


def merged_settings(*layers: Mapping[str, Any]) -> dict[str, Any]:
    """Settings mappings layered: later layers win, a group's settings are merged one by one
    (`{"store": {"url": u}}` over `{"store": {"key_prefix": p}}` keeps both). Each layer's old
    flat names are moved to their groups first."""
    out: dict[str, Any] = {}
    for layer in layers:
        for key, value in move_old_keys(layer).items():
            below = out.get(key)
            if key in GROUPS and isinstance(below, Mapping) and isinstance(value, Mapping):
                value = {**below, **value}
            out[key] = value
    return out


def read_config(path: str | Path) -> dict[str, Any]:
    """The YAML file's top-level mapping, unvalidated (settings_from_mapping checks it)."""
    try:
        loaded = yaml.safe_load(Path(path).read_text())
    except OSError as exc:
        raise ConfigError(f"cannot read config {path}: {exc}") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"config {path} is not valid YAML: {exc}") from exc
    if loaded is not None and not isinstance(loaded, dict):
        raise ConfigError(f"config {path}: the top level must be a mapping")
    return dict(loaded or {})


def load_settings(
    path: str | Path | None = None,
    *,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> Settings:
    """Build Settings from a YAML file, then `DISAGG_ROUTER_*` variables, then flag overrides
    (each in the file's shape: `{"store": {"url": ...}}`)."""
    file_raw = read_config(path) if path is not None else {}
    flags = _without_none(move_old_keys(overrides or {}))
    return settings_from_mapping(merged_settings(file_raw, _from_env(env or {}), flags))


def settings_from_mapping(raw: Mapping[str, Any]) -> Settings:
    raw = move_old_keys(raw)
    known = {f.metadata.get("key", f.name) for f in fields(Settings)} - {""} | {"model"}
    unknown = set(raw) - known
    if unknown:
        raise ConfigError(f"unknown settings {sorted(unknown)}")
    models = raw.pop("models", None) or raw.pop("model", None) or "llama-3-8b"
    if isinstance(models, str):
        models = (models,)
    default_perf = parse_perf(raw.pop("perf", None), "settings")
    served = models[0]
    layout = parse_layout(
        raw.pop("layout", None),
        KVLayout(
            model=served,
            kv_heads=default_perf.model.kv_heads if default_perf else 0,
            head_dim=default_perf.model.head_dim if default_perf else 0,
            block_size=default_perf.block_size if default_perf else 16,
            tp_size=default_perf.tp_size if default_perf else 1,
        ),
    )
    workers = tuple(
        parse_worker(w, default_perf, layout, f"workers[{i}]")
        for i, w in enumerate(raw.pop("workers", []) or [])
    )
    # Each group is its own settings class: its constructor checks the names and values.
    for key, cls in GROUPS.items():
        value = raw.pop(key, None) or {}
        if isinstance(value, cls):
            raw[key] = value
            continue
        if not isinstance(value, Mapping):
            raise ConfigError(f"{key}: must be a mapping of its settings, not {value!r}")
        try:
            raw[key] = cls(**value)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"{key}: {exc}") from exc
    if "kv_bytes_per_token" not in raw and default_perf is not None:
        raw["kv_bytes_per_token"] = default_perf.kv_bytes_per_token
    if "max_model_len" not in raw and default_perf is not None:
        raw["max_model_len"] = default_perf.model.max_model_len
    if "tenants" in raw:
        try:
            # A plain key is hashed here: from now on only its hash exists.
            raw["tenants"], raw["tenant_keys"] = parse_tenants(raw["tenants"])
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"tenants: {exc}") from exc
    try:
        return Settings(
            models=tuple(models),
            workers=workers,
            default_perf=default_perf,
            default_layout=layout,
            **raw,
        )
    except TypeError as exc:
        raise ConfigError(str(exc)) from exc
