"""Router settings: one frozen, validated object built once from file + environment + flags.

Precedence: command-line flags > environment (`DISAGG_ROUTER_*`) > the YAML file > defaults.
Nothing else in the router reads `os.environ`.

A minimal cluster.yaml:

    model: llama-3-8b             # served model name(s): a string or a list
    redis_url: redis://127.0.0.1:6379/0
    perf: {model: llama-3-8b, gpu: h100}   # cost-model profile of the workers (per worker too)
    workers:
      - {id: p0, url: http://10.0.0.1:8000, role: prefill}
      - {id: d0, url: http://10.0.0.2:8000, role: decode, kv_blocks: 24000}
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml

from policies.base import KVLayout
from policies.costmodel import PerfModel
from policies.role_pauses import reconfig_pauses
from policies.scaling import ScalingSLO
from router.admission import AdmissionSettings
from router.redact import masked_repr
from router.tenants import Keyring, KeySpec, TenantSpec, parse_tenants
from router.worker_spec import (
    ConfigError,
    Secret,
    WorkerSpec,
    parse_layout,
    parse_perf,
    parse_worker,
)

__all__ = [
    "BreakerSettings",
    "ConfigError",
    "Timeouts",
    "PreemptionSettings",
    "RetrySettings",
    "RoleSettings",
    "Settings",
    "load_settings",
    "read_config",
    "settings_from_mapping",
]

ENV_PREFIX = "DISAGG_ROUTER_"


@dataclass(frozen=True, slots=True)
class Timeouts:
    connect_s: float = 5.0
    prefill_s: float = 120.0  # the whole prefill leg, queueing included
    ttft_s: float = 120.0  # decode: from sending to the first byte of its answer
    idle_s: float = 60.0  # no byte from the decode stream for this long ends it
    total_s: float | None = None  # optional cap on a whole request
    # The client side (router/edge/server.py): a request head must be whole within header_s of the
    # connection opening or of its first byte; its body within body_s of the handler asking
    # for it (408); an idle keep-alive connection is closed after keepalive_s; a client that
    # takes no bytes for client_stall_s while the router has some queued for it is dropped
    # (its decode leg aborted, its reservation released). 0 turns one off.
    header_s: float = 10.0
    body_s: float = 30.0
    keepalive_s: float = 75.0
    client_stall_s: float = 30.0

    def __post_init__(self) -> None:
        for name in ("header_s", "body_s", "client_stall_s"):
            if getattr(self, name) < 0:
                raise ConfigError(f"timeouts.{name} must be >= 0 (0 turns it off)")
        if self.keepalive_s <= 0:
            raise ConfigError("timeouts.keepalive_s must be > 0")


@dataclass(frozen=True, slots=True)
class BreakerSettings:
    """A worker's circuit breaker (router/workers/breaker.py)."""

    failures_to_open: int = 3
    cooldown_s: float = 2.0
    max_cooldown_s: float = 60.0
    half_open_probes: int = 1


@dataclass(frozen=True, slots=True)
class RetrySettings:
    """Retries: at most `max_attempts` per request (SRE book: 3), within a cluster-wide budget
    of `budget_ratio` x recent requests + `budget_min_per_s` over `budget_window_s` (Finagle)."""

    max_attempts: int = 3
    budget_ratio: float = 0.2
    budget_min_per_s: float = 10.0
    budget_window_s: float = 10.0
    backoff_base_s: float = 0.02
    backoff_max_s: float = 1.0

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ConfigError("retry.max_attempts must be >= 1")


@dataclass(frozen=True, slots=True)
class PreemptionSettings:
    """Preemption with exact resume (router/request/preemption.py): a live stream that must
    grow where there is no room (its decode worker full, or its tenant at its block limit) is
    stopped and resumed from the text it has sent, instead of over-committing the worker.

    `max_per_stream`: how many times one request may be preempted (then its growth is forced,
    as without preemption: counted). `resume_wait_s`: how long a preempted stream's
    continuation waits for room (the client sees a pause) before its stream ends with an error
    frame. `release_wait_s`: how long a growth waits for the room of the streams preempted for
    it to be given back before it is forced. `force_after_tokens`: TESTS ONLY — preempt every
    stream once when it has relayed this many tokens (0: never), to prove the resume on real
    engines."""

    enabled: bool = True
    max_per_stream: int = 2
    resume_wait_s: float = 60.0
    release_wait_s: float = 2.0
    force_after_tokens: int = 0

    def __post_init__(self) -> None:
        if self.max_per_stream < 0:
            raise ConfigError("preemption.max_per_stream must be >= 0")
        if self.resume_wait_s <= 0 or self.release_wait_s < 0:
            raise ConfigError("preemption.resume_wait_s must be > 0, release_wait_s >= 0")
        if self.force_after_tokens < 0:
            raise ConfigError("preemption.force_after_tokens must be >= 0")


@dataclass(frozen=True, slots=True)
class RoleSettings:
    """The role manager (router/control/role_manager.py): which `both` workers serve prefill, which
    decode."""

    policy: str = "static"  # static | elastic | a dotted path (policies/registry.py)
    policy_args: Mapping[str, Any] = field(default_factory=dict)
    interval_s: float = 2.0  # how often the replica holding the lease decides
    # Before a drained worker takes its new role: every replica must have seen the drain (a
    # placement decided before it saw it lands within a registry refresh), so at least this.
    settle_s: float = 2.0
    # A worker leaving decode whose streams still run after this long has them resumed
    # elsewhere (the exact tokens sent so far); one leaving prefill has its stranded KV reaped.
    drain_deadline_s: float = 30.0
    # The pause between a drained worker and its first work in the new role, by engine kind
    # (the worker's adapter): a number for every kind, or {kind: seconds} over the defaults of
    # policies/role_pauses.py (vLLM kv_both 0: a role is a per-request choice there; SGLang's
    # PD role switch rebuilds its engine). Timed live by the role manager (out of both pools
    # that long) and told to the policy; the simulator takes the same table.
    reconfig_pause_s: float | Mapping[str, float] | None = None
    # An SGLang engine's role switch (POST /pd_role_switch) answered within this long, else
    # asked again later: the rebuild takes seconds on a GPU, longer on a CPU.
    engine_switch_timeout_s: float = 300.0
    # The demand signals' smoothing window (prompt tokens/s, recent peak of the queue).
    window_s: float = 30.0
    # A `both` worker given the decode role may still prefill its own requests when placement
    # prefers it (the time-shared arrangement, mixed with the pools); False: a worker with a
    # role serves that role's pool only, every request's KV moves from prefill to decode.
    local_prefill: bool = False

    def __post_init__(self) -> None:
        if min(self.interval_s, self.window_s) <= 0:
            raise ValueError("roles: interval_s and window_s must be > 0")
        if self.engine_switch_timeout_s <= 0:
            raise ValueError("roles: engine_switch_timeout_s must be > 0")
        if min(self.settle_s, self.drain_deadline_s) < 0:
            raise ValueError("roles: settle_s and drain_deadline_s must be >= 0")
        pauses = reconfig_pauses(self.reconfig_pause_s)  # raises ValueError when malformed
        object.__setattr__(self, "reconfig_pause_s", pauses)

    def pause_for(self, adapter: str) -> float:
        """The reconfiguration pause of a worker of engine kind `adapter`."""
        pauses = self.reconfig_pause_s
        assert isinstance(pauses, Mapping)  # normalized in __post_init__
        return float(pauses.get(adapter, 0.0))


@dataclass(frozen=True, slots=True)
class Settings:
    host: str = "127.0.0.1"
    port: int = 8000
    models: tuple[str, ...] = ("llama-3-8b",)
    max_model_len: int | None = None
    redis_url: str | None = None  # None = in-process store (single router only)
    key_prefix: str = "dr:"
    # Connections to Redis: at most this many; a call finding them all busy waits up to
    # redis_pool_timeout_s, then the request is shed with 429 (docs/reliability.md).
    redis_max_connections: int = 64
    redis_pool_timeout_s: float = 10.0
    # The listening socket's accept queue: a burst of connections beyond it is dropped by the
    # kernel and retried by clients after 1, 2, 4... s (the kernel caps it at somaxconn).
    listen_backlog: int = 4096
    policy: str = "two_sided"
    policy_args: Mapping[str, Any] = field(default_factory=dict)
    estimator: str = "online_quantile"
    estimator_args: Mapping[str, Any] = field(default_factory=dict)
    workers: tuple[WorkerSpec, ...] = ()
    kv_bytes_per_token: int = 131_072
    max_body_bytes: int = 8 * 1024 * 1024
    chars_per_token: float = 4.0
    # Exact prompt token counts (router/tokens/): served model name -> a directory holding its
    # tokenizer.json (with tokenizer_config.json / chat_template.jinja for chat), e.g. the
    # model's Hugging Face directory. A model without one is estimated by chars_per_token.
    tokenizers: Mapping[str, str] = field(default_factory=dict)
    # The largest `n` (choices per request) accepted; larger is a 400 (router/openai/api.py).
    max_n: int = 128
    # Stateless /v1/responses through the prefill/decode path when a NIXL-pull prefill worker of
    # the model is in rotation (router/openai/responses_pd.py). False serves every Responses request
    # whole on one worker, for a vLLM before 0.32 (it ignores kv_transfer_params there).
    responses_split: bool = True
    reservation_lease_s: float = 30.0
    kv_lease_s: float = 30.0
    state_refresh_s: float = 0.1
    health_interval_s: float = 2.0
    # While every worker is healthy and this replica is quiet (nothing in flight or waiting),
    # the probe interval doubles from health_interval_s up to this; the first request or
    # failed probe brings it back (router/loop_timing.py). An idle router's probes then
    # cost ~4x less; a worker that dies while nobody asks is noticed this much later (a
    # request's own failure trips its breaker at once). <= health_interval_s: never back off.
    health_idle_interval_s: float = 8.0
    # A probe slower than this counts as failed; two failures in a row take a worker out of
    # rotation. Generous by default: a busy vLLM API server can be slow to answer /health.
    health_timeout_s: float = 5.0
    histogram_refresh_s: float = 1.0
    # X-Expected-Output-Tokens may lower a reservation below the estimate only when trusted
    # (every caller of this router is: a benchmark, or clients the operator controls). Untrusted,
    # a hint can only raise it (policies/estimators.py HintEstimator).
    trust_hints: bool = False
    # Decode room kept back per worker after forced growth there (policies/overruns.py): the
    # excess over capacity, halving every half-life, at most this share of the capacity.
    overrun_margin_half_life_s: float = 60.0
    overrun_margin_max_share: float = 0.25
    timeouts: Timeouts = field(default_factory=Timeouts)
    retry: RetrySettings = field(default_factory=RetrySettings)
    preemption: PreemptionSettings = field(default_factory=PreemptionSettings)
    admission: AdmissionSettings = field(default_factory=AdmissionSettings)
    breaker: BreakerSettings = field(default_factory=BreakerSettings)
    stranded_reap_s: float = 1.0  # how often expired stranded-KV entries are reaped
    # Client headers passed through to the workers (the simulated workers' replay header, tracing).
    forward_headers: tuple[str, ...] = ("x-sim-output-tokens", "traceparent", "tracestate")
    # Client API keys accepted by the router; empty = no client authentication.
    api_keys: tuple[Secret, ...] = ()
    # Tenants (router/tenants.py): `tenants:` in the file, a list of {name, weight, priority,
    # requests_per_minute, tokens_per_minute, max_reserved_blocks, keys: [...]}; the keys are
    # kept here hashed only (`tenant_keys`, built from that section, not set directly).
    tenants: tuple[TenantSpec, ...] = ()
    tenant_keys: tuple[KeySpec, ...] = field(default=(), repr=False)
    # The admission queue's order among tenants (policies/fairness.py): fifo (today's order,
    # tenants ignored), vtc (weighted fair share of decode block-seconds and prefill tokens),
    # or a dotted path; loaded with its args when the app is built (policies/registry.py).
    fairness: str = "fifo"
    fairness_args: Mapping[str, Any] = field(default_factory=dict)
    forward_client_auth: bool = False
    upstream_connections: int = 4096
    # How decode streams reach the client: "splice" (router/relay/splice.py: a raw keep-alive client
    # whose protocol callbacks write whole SSE events straight to the client's transport; ~30 %
    # less relay CPU per token, a third of the TTFT tail at 256 streams; http:// workers) or
    # "aiohttp" (its client + StreamResponse.write; also what https:// workers always use).
    relay: str = "splice"
    # Non-streaming requests are streamed from the decode worker and assembled into one JSON
    # answer (router/request/assemble.py): the TTFT, idle and KV-handoff deadlines then hold for
    # them
    # too. False: the worker answers whole (for upstreams that cannot stream).
    assemble_non_streaming: bool = True
    # Token for the admin API's write side (register / remove workers); empty = disabled.
    admin_token: Secret = Secret("")
    # A read-only token for the admin GETs (/admin/state, /admin/workers, /admin/scaling,
    # /admin/roles: worker URLs and topology). They need it (or admin_token) once client keys
    # are configured or this is set; in open mode with neither they answer anyone, as always.
    admin_read_token: Secret = Secret("")
    # /metrics and /openapi.json answer without a key; False: they need a client key, the
    # admin token or the read-only token (a Prometheus scrape's `authorization` credentials).
    public_metrics: bool = True
    public_openapi: bool = True
    registry_refresh_s: float = 1.0  # how often replicas re-read the shared worker registry
    # On SIGTERM, running requests get this long to finish; the rest end with an SSE error
    # frame (router/edge/shutdown.py). Below Kubernetes' default 30 s termination grace period.
    shutdown_grace_s: float = 20.0
    # The SLOs and headroom the autoscaling recommendation sizes each pool for
    # (router/control/scaling.py).
    scaling: ScalingSLO = field(default_factory=ScalingSLO)
    roles: RoleSettings = field(default_factory=RoleSettings)  # `both` workers' roles
    # OpenTelemetry spans per request, traceparent to the workers (router/tracing.py; needs
    # the `otel` extra).
    tracing: bool = False
    load_poll_s: float = 1.0  # read workers' /metrics (vLLM) or /get_load (SGLang); 0 = off
    load_max_age_s: float = 3.0  # older load readings are not trusted (never taken as idle)
    default_perf: PerfModel | None = None  # the `perf:` profile, for workers registered later
    default_layout: KVLayout = field(default_factory=KVLayout)

    __repr__ = masked_repr  # the Redis and worker URLs' passwords are not shown

    @property
    def client_keys(self) -> bool:
        """Whether clients need a key (any configured: `api_keys` or a tenant's)."""
        return bool(self.api_keys or self.tenant_keys)

    def __post_init__(self) -> None:
        if not self.models:
            raise ConfigError("models: at least one served model name is needed")
        if not 0 < self.port < 65536 and self.port != 0:
            raise ConfigError(f"port: {self.port} is not a TCP port")
        ids = [w.id for w in self.workers]
        if len(ids) != len(set(ids)):
            raise ConfigError(f"workers: duplicate ids in {ids}")
        if self.redis_max_connections < 1:
            raise ConfigError("redis_max_connections must be >= 1")
        if self.max_n < 1:
            raise ConfigError("max_n must be >= 1")
        if self.overrun_margin_half_life_s <= 0:
            raise ConfigError("overrun_margin_half_life_s must be > 0")
        if not 0 <= self.overrun_margin_max_share < 1:
            raise ConfigError("overrun_margin_max_share must be within [0, 1)")
        for name in (
            "reservation_lease_s",
            "kv_lease_s",
            "health_interval_s",
            "health_timeout_s",
            "redis_pool_timeout_s",
        ):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be > 0")
        if self.shutdown_grace_s < 0:
            raise ConfigError("shutdown_grace_s must be >= 0")
        if not isinstance(self.tokenizers, Mapping):
            raise ConfigError("tokenizers: a mapping of model name to tokenizer directory")
        for model, directory in self.tokenizers.items():
            if not (Path(str(directory)) / "tokenizer.json").is_file():
                raise ConfigError(f"tokenizers.{model}: no tokenizer.json in {directory!r}")
        if self.relay not in ("aiohttp", "splice"):
            raise ConfigError(f"relay: must be aiohttp or splice, not {self.relay!r}")
        try:
            Keyring(self.tenants, self.tenant_keys, self.api_keys)  # keys vs tenants, no twice
        except ValueError as exc:
            raise ConfigError(f"tenants: {exc}") from exc
        if not (self.public_metrics and self.public_openapi) and not (
            self.client_keys or self.admin_token or self.admin_read_token
        ):
            raise ConfigError(
                "public_metrics / public_openapi: false needs a credential to accept: set "
                "api_keys, admin_token or admin_read_token"
            )


_ENV_SCALARS: dict[str, type] = {
    "host": str,
    "port": int,
    "redis_url": str,
    "key_prefix": str,
    "policy": str,
    "estimator": str,
    "max_body_bytes": int,
    "reservation_lease_s": float,
    "relay": str,
    "redis_max_connections": int,
}


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
    """Build Settings from a YAML file, then `DISAGG_ROUTER_*` variables, then flag overrides."""
    raw: dict[str, Any] = read_config(path) if path is not None else {}
    for key, typ in _ENV_SCALARS.items():
        value = (env or {}).get(ENV_PREFIX + key.upper())
        if value not in (None, ""):
            try:
                raw[key] = typ(value)
            except ValueError as exc:
                raise ConfigError(f"{ENV_PREFIX}{key.upper()}: {exc}") from exc
    raw.update({k: v for k, v in (overrides or {}).items() if v is not None})
    return settings_from_mapping(raw)


def settings_from_mapping(raw: Mapping[str, Any]) -> Settings:
    raw = dict(raw)
    known = ({f.name for f in fields(Settings)} | {"model", "perf", "layout"}) - {
        "default_perf",
        "default_layout",
        "tenant_keys",
    }
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
    # Each value is its own settings class; Settings' constructor checks the names.
    nested: dict[str, Any] = {}
    for key, cls in (
        ("timeouts", Timeouts),
        ("retry", RetrySettings),
        ("preemption", PreemptionSettings),
        ("admission", AdmissionSettings),
        ("breaker", BreakerSettings),
        ("scaling", ScalingSLO),
        ("roles", RoleSettings),
    ):
        value = raw.pop(key, None) or {}
        try:
            nested[key] = value if isinstance(value, cls) else cls(**value)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"{key}: {exc}") from exc
    if "kv_bytes_per_token" not in raw and default_perf is not None:
        raw["kv_bytes_per_token"] = default_perf.kv_bytes_per_token
    if "max_model_len" not in raw and default_perf is not None:
        raw["max_model_len"] = default_perf.model.max_model_len
    for key in ("forward_headers",):
        if key in raw:
            raw[key] = tuple(str(h).lower() for h in raw[key])
    for key in ("admin_token", "admin_read_token"):
        if key in raw:
            raw[key] = Secret(raw[key] or "")
    if "api_keys" in raw:
        raw["api_keys"] = tuple(Secret(k) for k in raw["api_keys"] or ())
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
            **nested,
            **raw,
        )
    except TypeError as exc:
        raise ConfigError(str(exc)) from exc
