"""The settings' groups: each a frozen dataclass that checks itself (router/config.py composes
them into `Settings`).

Every field carries a one-line explanation in its metadata (`setting(..., doc=...)`): the
reference page docs/configuration.md is generated from it
(`python -m disagg_tools.launcher.config_doc`), and a test keeps the two equal.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import MISSING, dataclass, field
from pathlib import Path
from typing import Any

from policies.role_pauses import reconfig_pauses
from router.worker_spec import ConfigError, Secret

__all__ = [
    "ApiSettings",
    "AuthSettings",
    "BreakerSettings",
    "DiscoverySettings",
    "EstimateSettings",
    "LeaseSettings",
    "LoopSettings",
    "OverrunSettings",
    "PreemptionSettings",
    "RetrySettings",
    "RoleSettings",
    "ServerSettings",
    "StoreSettings",
    "Timeouts",
    "UpstreamSettings",
    "check_selector",
    "setting",
]


def setting(
    default: Any = MISSING,
    *,
    doc: str,
    factory: Callable[[], Any] | None = None,
    show: bool = True,
    key: str | None = None,
) -> Any:
    """A dataclass field with its explanation (`doc`) for the reference page; `show=False`
    keeps it out of the repr; `key` is its name in the file when that is not the field's own
    ("" for a field the file cannot set)."""
    metadata: dict[str, str] = {"doc": doc} if key is None else {"doc": doc, "key": key}
    if factory is not None:
        return field(default_factory=factory, metadata=metadata, repr=show)
    return field(default=default, metadata=metadata, repr=show)


def _positive(group: str, owner: object, *names: str) -> None:
    for name in names:
        if getattr(owner, name) <= 0:
            raise ConfigError(f"{group}.{name} must be > 0")


@dataclass(frozen=True, slots=True)
class ServerSettings:
    """The router's own HTTP server (router/edge/server.py)."""

    host: str = setting("127.0.0.1", doc="address the router listens on")
    port: int = setting(8000, doc="TCP port the router listens on (0: any free port)")
    listen_backlog: int = setting(
        4096,
        doc="the listening socket's accept queue; a burst beyond it is dropped by the kernel "
        "and retried by clients after 1, 2, 4... s (the kernel caps it at somaxconn)",
    )
    max_body_bytes: int = setting(8 * 1024 * 1024, doc="largest request body accepted (413)")
    front_door: str = setting(
        "lean",
        doc="lean: chat and completions requests of the common shape on the router's own "
        "HTTP/1.1 protocol, any other request (and its connection) handed to aiohttp's "
        "(router/edge/lean_door.py) | aiohttp: every request through aiohttp's server",
    )
    shutdown_grace_s: float = setting(
        20.0,
        doc="on SIGTERM, running requests get this long to finish; the rest end with an SSE "
        "error frame (below Kubernetes' default 30 s termination grace period)",
    )

    def __post_init__(self) -> None:
        if not 0 < self.port < 65536 and self.port != 0:
            raise ConfigError(f"server.port: {self.port} is not a TCP port")
        if self.shutdown_grace_s < 0:
            raise ConfigError("server.shutdown_grace_s must be >= 0")
        if self.front_door not in ("aiohttp", "lean"):
            raise ConfigError(f"server.front_door must be aiohttp or lean, not {self.front_door!r}")


@dataclass(frozen=True, slots=True)
class StoreSettings:
    """The shared state store (Redis) the replicas coordinate through."""

    url: str | None = setting(
        None, doc="Redis URL (redis://, rediss://); unset: an in-process store, one replica only"
    )
    key_prefix: str = setting("dr:", doc="prefix of every key the router writes in Redis")
    max_connections: int = setting(64, doc="connections to Redis at most")
    pool_timeout_s: float = setting(
        10.0,
        doc="a call finding every connection busy waits this long, then its request is shed "
        "with 429 (docs/reliability.md)",
    )

    def __post_init__(self) -> None:
        if self.max_connections < 1:
            raise ConfigError("store.max_connections must be >= 1")
        _positive("store", self, "pool_timeout_s")


@dataclass(frozen=True, slots=True)
class AuthSettings:
    """Who may call the router (router/edge/auth.py); tenants' keys are in `tenants`."""

    api_keys: tuple[Secret, ...] = setting(
        (), doc="client API keys accepted; none (and no tenant keys): no client authentication"
    )
    admin_token: Secret = setting(
        Secret(""), doc="token of the admin API's write side (register, remove); empty: disabled"
    )
    admin_read_token: Secret = setting(
        Secret(""),
        doc="read-only token for the admin GETs (/admin/state, /admin/workers, /admin/scaling, "
        "/admin/roles); they need it (or admin_token) once client keys or this are set",
    )
    forward_client_auth: bool = setting(
        False, doc="pass the client's `authorization` header on to the workers"
    )
    public_metrics: bool = setting(
        True,
        doc="/metrics answers without a key; false: it needs a client key, the admin token or "
        "the read-only token",
    )
    public_openapi: bool = setting(
        True, doc="/openapi.json answers without a key; false: as public_metrics"
    )

    def __post_init__(self) -> None:
        # A plain key becomes a Secret here: it never prints from then on.
        object.__setattr__(self, "api_keys", tuple(Secret(k) for k in self.api_keys or ()))
        object.__setattr__(self, "admin_token", Secret(self.admin_token or ""))
        object.__setattr__(self, "admin_read_token", Secret(self.admin_read_token or ""))


@dataclass(frozen=True, slots=True)
class LoopSettings:
    """The background loops' periods (router/loop_timing.py, router/workers/)."""

    state_refresh_s: float = setting(
        0.1, doc="how often the shared state (other replicas' reservations) is re-read"
    )
    health_interval_s: float = setting(2.0, doc="how often each worker's health is probed")
    health_idle_interval_s: float = setting(
        8.0,
        doc="while every worker is healthy and this replica is quiet, the probe interval "
        "doubles up to this; <= health_interval_s: never back off",
    )
    health_timeout_s: float = setting(
        5.0,
        doc="a probe slower than this counts as failed; two failures in a row take a worker "
        "out of rotation",
    )
    histogram_refresh_s: float = setting(
        1.0, doc="how often the shared output-length histograms are re-read"
    )
    stranded_reap_s: float = setting(1.0, doc="how often expired stranded-KV entries are reaped")
    registry_refresh_s: float = setting(
        1.0,
        doc="how often a busy replica re-reads the shared worker registry; a quiet one reads "
        "it when the store's change feed says it changed (seen within this bound either way)",
    )
    registry_quiet_wait_s: float = setting(
        30.0,
        doc="the longest a quiet replica waits on the registry's change feed before reading "
        "the registry anyway (what no event shows: a FLUSHALL on a running Redis); at most "
        "half the store-loss marker's TTL",
    )
    load_poll_s: float = setting(
        1.0, doc="how often workers' /metrics (vLLM) or /get_load (SGLang) are read; 0: off"
    )
    load_max_age_s: float = setting(
        3.0, doc="older load readings are not trusted (never taken as idle)"
    )

    def __post_init__(self) -> None:
        _positive("loops", self, "health_interval_s", "health_timeout_s", "registry_quiet_wait_s")


@dataclass(frozen=True, slots=True)
class LeaseSettings:
    """How long a replica's holdings live in the store without being renewed."""

    reservation_s: float = setting(
        30.0, doc="a reservation's lease: a crashed replica's reservations free after this"
    )
    kv_s: float = setting(30.0, doc="a stranded KV entry's lease (prefilled, not yet pulled)")

    def __post_init__(self) -> None:
        _positive("leases", self, "reservation_s", "kv_s")


@dataclass(frozen=True, slots=True)
class UpstreamSettings:
    """How the router talks to its workers."""

    connections: int = setting(4096, doc="connections to the workers at most (all together)")
    relay: str = setting(
        "splice",
        doc="how the PD legs reach the workers and decode streams the client: splice (raw "
        "keep-alive client for the prefill and decode legs, writing whole SSE events to the "
        "client's transport; http:// workers) or aiohttp (also what https:// workers always "
        "use)",
    )
    forward_headers: tuple[str, ...] = setting(
        ("x-sim-output-tokens", "traceparent", "tracestate"),
        doc="client headers passed through to the workers",
    )
    assemble_non_streaming: bool = setting(
        True,
        doc="non-streaming requests are streamed from decode and assembled into one answer "
        "(the TTFT, idle and KV-handoff deadlines hold); false: the worker answers whole",
    )

    def __post_init__(self) -> None:
        object.__setattr__(
            self, "forward_headers", tuple(str(h).lower() for h in self.forward_headers)
        )
        if self.relay not in ("aiohttp", "splice"):
            raise ConfigError(f"upstream.relay: must be aiohttp or splice, not {self.relay!r}")


@dataclass(frozen=True, slots=True)
class EstimateSettings:
    """How a request's prompt and output lengths are estimated (policies/estimators.py,
    router/tokens/)."""

    estimator: str = setting(
        "online_quantile", doc="output-length estimator: a name or a dotted path"
    )
    estimator_args: Mapping[str, Any] = setting(doc="the estimator's arguments", factory=dict)
    trust_hints: bool = setting(
        False,
        doc="X-Expected-Output-Tokens may lower a reservation below the estimate (untrusted, "
        "a hint can only raise it)",
    )
    chars_per_token: float = setting(
        4.0, doc="prompt tokens estimated from characters when a model has no tokenizer"
    )
    tokenizers: Mapping[str, str] = setting(
        doc="served model name -> a directory holding its tokenizer.json (chat: with "
        "tokenizer_config.json / chat_template.jinja), for exact prompt token counts",
        factory=dict,
    )

    def __post_init__(self) -> None:
        if not isinstance(self.tokenizers, Mapping):
            raise ConfigError("estimates.tokenizers: a mapping of model name to directory")
        for model, directory in self.tokenizers.items():
            if not (Path(str(directory)) / "tokenizer.json").is_file():
                raise ConfigError(
                    f"estimates.tokenizers.{model}: no tokenizer.json in {directory!r}"
                )


@dataclass(frozen=True, slots=True)
class OverrunSettings:
    """Decode room kept back per worker after forced growth there (policies/overruns.py)."""

    margin_half_life_s: float = setting(60.0, doc="the excess over capacity halves every this long")
    margin_max_share: float = setting(0.25, doc="at most this share of the capacity is kept back")

    def __post_init__(self) -> None:
        _positive("overruns", self, "margin_half_life_s")
        if not 0 <= self.margin_max_share < 1:
            raise ConfigError("overruns.margin_max_share must be within [0, 1)")


@dataclass(frozen=True, slots=True)
class ApiSettings:
    """Limits and choices of the OpenAI-compatible API (router/openai/)."""

    max_n: int = setting(128, doc="the largest `n` (choices per request); larger is a 400")
    responses_split: bool = setting(
        True,
        doc="stateless /v1/responses through prefill/decode when a NIXL-pull prefill worker "
        "serves the model; false: whole on one worker (vLLM before 0.32)",
    )

    def __post_init__(self) -> None:
        if self.max_n < 1:
            raise ConfigError("api.max_n must be >= 1")


@dataclass(frozen=True, slots=True)
class Timeouts:
    """Deadlines of a request's legs and of the client side (0 turns a client one off)."""

    connect_s: float = setting(5.0, doc="connecting to a worker")
    prefill_s: float = setting(120.0, doc="the whole prefill leg, queueing included")
    ttft_s: float = setting(120.0, doc="decode: from sending to the first byte of its answer")
    idle_s: float = setting(60.0, doc="no byte from the decode stream for this long ends it")
    total_s: float | None = setting(None, doc="optional cap on a whole request")
    header_s: float = setting(
        10.0, doc="a request head must be whole within this of the connection or its first byte"
    )
    body_s: float = setting(
        30.0, doc="a request body must be whole within this of the handler asking (408)"
    )
    keepalive_s: float = setting(75.0, doc="an idle keep-alive client connection is closed")
    client_stall_s: float = setting(
        30.0,
        doc="a client taking no bytes this long while some are queued for it is dropped (its "
        "decode leg aborted, its reservation released)",
    )

    def __post_init__(self) -> None:
        for name in ("header_s", "body_s", "client_stall_s"):
            if getattr(self, name) < 0:
                raise ConfigError(f"timeouts.{name} must be >= 0 (0 turns it off)")
        if self.keepalive_s <= 0:
            raise ConfigError("timeouts.keepalive_s must be > 0")


@dataclass(frozen=True, slots=True)
class BreakerSettings:
    """A worker's circuit breaker (router/workers/breaker.py)."""

    failures_to_open: int = setting(3, doc="failures in a row that open the breaker")
    cooldown_s: float = setting(2.0, doc="first wait before a half-open probe")
    max_cooldown_s: float = setting(60.0, doc="the wait doubles on each failed probe up to this")
    half_open_probes: int = setting(1, doc="requests let through while half open")


@dataclass(frozen=True, slots=True)
class RetrySettings:
    """Retries: at most `max_attempts` per request (SRE book: 3), within a cluster-wide budget
    of `budget_ratio` x recent requests + `budget_min_per_s` over `budget_window_s` (Finagle)."""

    max_attempts: int = setting(3, doc="tries of one request at most")
    budget_ratio: float = setting(0.2, doc="retries allowed per recent request, cluster-wide")
    budget_min_per_s: float = setting(10.0, doc="retries per second allowed whatever the ratio")
    budget_window_s: float = setting(10.0, doc="the window the budget counts requests over")
    backoff_base_s: float = setting(0.02, doc="first pause before a retry (doubles each time)")
    backoff_max_s: float = setting(1.0, doc="the longest pause before a retry")

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ConfigError("retry.max_attempts must be >= 1")


@dataclass(frozen=True, slots=True)
class PreemptionSettings:
    """Preemption with exact resume (router/request/preemption.py): a live stream that must
    grow where there is no room (its decode worker full, or its tenant at its block limit) is
    stopped and resumed from the text it has sent, instead of over-committing the worker."""

    enabled: bool = setting(True, doc="preempt instead of over-committing a full worker")
    max_per_stream: int = setting(
        2, doc="times one request may be preempted; then its growth is forced (counted)"
    )
    resume_wait_s: float = setting(
        60.0,
        doc="a preempted stream's continuation waits this long for room (the client sees a "
        "pause), then its stream ends with an error frame",
    )
    release_wait_s: float = setting(
        2.0,
        doc="a growth waits this long for the room of the streams preempted for it, then is forced",
    )
    force_after_tokens: int = setting(
        0, doc="TESTS ONLY: preempt every stream once after this many tokens (0: never)"
    )

    def __post_init__(self) -> None:
        if self.max_per_stream < 0:
            raise ConfigError("preemption.max_per_stream must be >= 0")
        if self.resume_wait_s <= 0 or self.release_wait_s < 0:
            raise ConfigError("preemption.resume_wait_s must be > 0, release_wait_s >= 0")
        if self.force_after_tokens < 0:
            raise ConfigError("preemption.force_after_tokens must be >= 0")


@dataclass(frozen=True, slots=True)
class RoleSettings:
    """The role manager (router/control/role_manager.py): which `both` workers serve prefill,
    which decode."""

    policy: str = setting("static", doc="static | elastic | a dotted path (policies/registry.py)")
    policy_args: Mapping[str, Any] = setting(doc="the role policy's arguments", factory=dict)
    interval_s: float = setting(2.0, doc="how often the replica holding the lease decides")
    settle_s: float = setting(
        2.0,
        doc="a drained worker waits at least this before its new role (every replica must have "
        "seen the drain: a registry refresh)",
    )
    drain_deadline_s: float = setting(
        30.0,
        doc="a worker leaving decode whose streams still run after this has them resumed "
        "elsewhere; one leaving prefill has its stranded KV reaped",
    )
    reconfig_pause_s: float | Mapping[str, float] | None = setting(
        None,
        doc="pause between a drained worker and its first work in the new role: seconds for "
        "every engine kind, or {adapter: seconds} over policies/role_pauses.py's defaults",
    )
    engine_switch_timeout_s: float = setting(
        300.0,
        doc="an SGLang engine's role switch (POST /pd_role_switch) must answer within this, "
        "else it is asked again later",
    )
    window_s: float = setting(
        30.0, doc="the demand signals' smoothing window (prompt tokens/s, queue peak)"
    )
    local_prefill: bool = setting(
        False,
        doc="a `both` worker in the decode role may still prefill its own requests when "
        "placement prefers it; false: every request's KV moves from prefill to decode",
    )

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


_SELECTOR_TERM = re.compile(
    r"""^\s*(?:
        !?\s*[A-Za-z0-9._/-]+                                   # key, !key
      | [A-Za-z0-9._/-]+\s*(?:==?|!=)\s*[A-Za-z0-9._-]*         # key=value, key!=value
      | [A-Za-z0-9._/-]+\s+(?:in|notin)\s*\(\s*[A-Za-z0-9._,\s-]*\)  # key in (a, b)
      | [A-Za-z0-9._/-]+\s*[<>]\s*-?\d+                         # key>3
    )\s*$""",
    re.VERBOSE,
)


def _selector_terms(text: str) -> list[str]:
    """A label selector's terms: split on the commas outside parentheses."""
    terms, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += ch == "("
        depth -= ch == ")"
        if ch == "," and depth == 0:
            terms.append(text[start:i])
            start = i + 1
    terms.append(text[start:])
    return terms


def check_selector(name: str, text: str) -> None:
    """A Kubernetes label selector (`app=vllm,role in (prefill)`), checked before the API
    server sees it: a typo fails at start-up with the setting's name, not as a 400 later."""
    if len(text) > 1024 or not all(_SELECTOR_TERM.match(t) for t in _selector_terms(text)):
        raise ConfigError(
            f"discovery.{name}: {text!r} is not a label selector (key=value, key!=value, "
            "key in (a,b), key notin (a,b), key, !key; comma-separated)"
        )


_DISCOVERY_ROLES = ("prefill", "decode", "both")


@dataclass(frozen=True, slots=True)
class DiscoverySettings:
    """Where the workers come from (router/workers/kube/): `static` (the `workers:` list and
    the admin API) or `kubernetes` (pods by a label selector per role, list + watch;
    docs/kubernetes.md). The Helm chart renders this group from its `discovery:` values."""

    kind: str = setting("static", doc="static | kubernetes")
    namespace: str = setting(
        "",
        doc="namespace whose pods are watched; empty: the router pod's own (its service "
        "account's namespace file), else `default`",
    )
    source: str = setting(
        "pods",
        doc="pods: readiness from each pod's Ready condition; endpointslices: from the "
        "EndpointSlices' endpoint conditions (pods are still read for labels and ports)",
    )
    prefill_selector: str = setting("", doc="label selector of the prefill pods; empty: none")
    decode_selector: str = setting("", doc="label selector of the decode pods; empty: none")
    both_selector: str = setting(
        "", doc="label selector of pods serving both phases (elastic roles); empty: none"
    )
    adapter: str = setting("vllm", doc="the discovered engines' protocol: vllm | sglang | "
                           "mooncake | sim")  # fmt: skip
    scheme: str = setting("http", doc="http | https: how the router reaches the engines")
    port_name: str = setting(
        "http", doc="the engine's HTTP port: the container port of this name, if the pod has one"
    )
    port_annotation: str = setting(
        "disagg-router.io/port", doc="else this pod annotation's number, if set"
    )
    port: int = setting(8000, doc="else this port (`role_ports` per role first)")
    role_ports: Mapping[str, int] = setting(
        doc="per role, the port when no named port or annotation gives it, e.g. "
        "{prefill: 8000, decode: 8200}",
        factory=dict,
    )
    bootstrap_port_annotation: str = setting(
        "sglang.ai/bootstrap-port",
        doc="an SGLang/Mooncake prefill's KV bootstrap port: this annotation (as SGLang's "
        "router reads it), then the container port `bootstrap_port_name`; neither: read "
        "from the engine's /server_info",
    )
    bootstrap_port_name: str = setting("bootstrap", doc="see bootstrap_port_annotation")
    kv_events_port_name: str = setting(
        "kv-events",
        doc="vLLM KV events: the container port of this name is the ZeroMQ PUB endpoint; "
        "absent: no events for that pod",
    )
    kv_events_replay_port_name: str = setting(
        "kv-replay", doc="the KV events' replay (ROUTER) endpoint's container port, optional"
    )
    kv_events_topic: str = setting("", doc="the KV events' topic (empty: every topic)")
    model_label: str = setting(
        "", doc="the served model from this pod label; empty: the first of `models`"
    )
    revision_label: str = setting(
        "",
        doc="the worker's revision from this pod label; empty: `pod-template-hash` (shown in "
        "/admin/workers; pairing goes by the KV layout)",
    )
    layout_annotation: str = setting(
        "disagg-router.io/kv-layout",
        doc='a pod annotation holding KV layout fields as JSON ({"dtype": "fp8", ...}): '
        "what HTTP cannot tell; they win over what the engine reports",
    )
    discover_layout: bool = setting(
        True, doc="read each pod's KV layout from its engine before it is used"
    )
    kv_blocks: int | None = setting(
        None, doc="decode capacity (blocks) of a discovered worker; default: the perf profile's"
    )
    kubeconfig: str = setting(
        "",
        doc="a kubeconfig file; empty: the in-cluster service account (KUBERNETES_SERVICE_HOST),"
        " else $KUBECONFIG or ~/.kube/config",
    )
    backoff_s: float = setting(1.0, doc="first wait after an API error (doubles, with jitter)")
    backoff_max_s: float = setting(30.0, doc="longest wait between API retries")
    watch_timeout_s: int = setting(
        300, doc="each watch asks the server to end it after this (then it is resumed)"
    )

    def __post_init__(self) -> None:
        choices = {
            "kind": ("static", "kubernetes"),
            "source": ("pods", "endpointslices"),
            "adapter": ("vllm", "sglang", "mooncake", "sim"),
            "scheme": ("http", "https"),
        }
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ConfigError(
                    f"discovery.{name}: {getattr(self, name)!r} is not one of {', '.join(allowed)}"
                )
        selectors = {r: getattr(self, f"{r}_selector") for r in _DISCOVERY_ROLES}
        for role, text in selectors.items():
            if not isinstance(text, str):
                raise ConfigError(f"discovery.{role}_selector: expected a string")
            if text.strip():
                check_selector(f"{role}_selector", text)
        if self.kind == "kubernetes" and not any(t.strip() for t in selectors.values()):
            raise ConfigError(
                "discovery.kind kubernetes needs at least one of discovery.prefill_selector, "
                "decode_selector, both_selector"
            )
        ports = dict(self.role_ports or {})
        for role, number in ports.items():
            if role not in _DISCOVERY_ROLES:
                raise ConfigError(f"discovery.role_ports: {role!r} is not prefill|decode|both")
            _port(f"discovery.role_ports.{role}", number)
        object.__setattr__(self, "role_ports", ports)
        _port("discovery.port", self.port)
        if self.kv_blocks is not None and (
            isinstance(self.kv_blocks, bool) or not isinstance(self.kv_blocks, int)
            or self.kv_blocks < 1
        ):  # fmt: skip
            raise ConfigError("discovery.kv_blocks must be an integer >= 1 (or unset)")
        _positive("discovery", self, "backoff_s", "backoff_max_s", "watch_timeout_s")
        if self.backoff_max_s < self.backoff_s:
            raise ConfigError("discovery.backoff_max_s must be >= discovery.backoff_s")

    @property
    def enabled(self) -> bool:
        return self.kind == "kubernetes"

    def selectors(self) -> dict[str, str]:
        """{role: selector} of the roles watched."""
        return {
            r: getattr(self, f"{r}_selector").strip()
            for r in _DISCOVERY_ROLES
            if getattr(self, f"{r}_selector").strip()
        }


def _port(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value < 65536:
        raise ConfigError(f"{name}: {value!r} is not a TCP port")
