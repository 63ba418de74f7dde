"""The placement and output-length extension points, and the snapshot types they see.

Everything here is pure data: a policy gets a frozen snapshot of the request and of the
cluster and returns a decision. No I/O, no clocks, no HTTP objects, so the same policy object
runs in the live router and in the discrete-event cluster simulator (docs/design.md §6).

    RequestInfo ─┐
                 ├─> PlacementPolicy.place() ─> Placement(candidates) | Rejection(reason, retry)
    ClusterView ─┘

    RequestInfo + OutputHistograms ─> OutputLengthEstimator.estimate() ─> OutputEstimate

    RoleSnapshot ─> RolePolicy.decide() ─> RolePlan(switches: RoleSwitch(worker, to_role, reason))

    WaitingRequest(tenant, class, ticket, cost) ─> FairnessPolicy: enqueue / pick / admit / settle
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Literal, Protocol, runtime_checkable

__all__ = [
    "KVLayout",
    "OutputEstimate",
    "RequestInfo",
    "PrefillView",
    "DecodeView",
    "ClusterView",
    "Candidate",
    "Placement",
    "Rejection",
    "Decision",
    "PlacementPolicy",
    "OutputLengthEstimator",
    "OutputHistograms",
    "blocks_for",
    "extra_choice_tokens",
    "Role",
    "RoleState",
    "RoleWorkerView",
    "RoleSnapshot",
    "RoleSwitch",
    "RolePlan",
    "RolePolicy",
    "Tenant",
    "AdmissionCost",
    "WaitingRequest",
    "Charge",
    "FairnessPolicy",
]


def blocks_for(tokens: int, block_size: int) -> int:
    """KV blocks needed to hold `tokens` tokens (ceil division; at least one block)."""
    return max(1, -(-max(0, tokens) // block_size))


def extra_choice_tokens(prompt_tokens: int, n: int, block_size: int) -> int:
    """Tokens of KV that choices 2..n of an `n`-choice answer hold beyond one choice's.

    The choices of one request share the prompt's full blocks (prefix caching), but each has
    its own copy of the prompt's last, partial block and rounds its own output up to whole
    blocks. Counting, for each extra choice, that partial block's tokens plus one block less
    a token makes `blocks_for(prompt + n * output + this, block_size)` an upper bound of the
    blocks the n choices hold (`floor(prompt / bs) + n * ceil((prompt % bs + output) / bs)`)."""
    if n <= 1:
        return 0
    return (n - 1) * (prompt_tokens % block_size + block_size - 1)


@dataclass(frozen=True, slots=True)
class KVLayout:
    """What must match between a prefill and a decode worker for a KV handoff to be valid.

    vLLM checks this only inside its KV handshake, invisible over HTTP (docs/design.md §3), so the
    router pairs only workers whose descriptors are identical.
    """

    engine: str = "sim"
    engine_version: str = "0"
    model: str = ""
    dtype: str = "bfloat16"
    kv_heads: int = 0
    head_dim: int = 0
    block_size: int = 16
    tp_size: int = 1
    connector: str = "NixlConnector"
    connector_version: str = "0"

    @property
    def key(self) -> str:
        return "|".join(
            str(v)
            for v in (
                self.engine,
                self.engine_version,
                self.model,
                self.dtype,
                self.kv_heads,
                self.head_dim,
                self.block_size,
                self.tp_size,
                self.connector,
                self.connector_version,
            )
        )


@dataclass(frozen=True, slots=True)
class OutputEstimate:
    """Estimated output length of one request.

    `quantiles` maps a probability (0.5, 0.9, ...) to a token count. `reserve_tokens` is the
    number the policy should hold decode room for: an upper quantile, capped by max_tokens.
    """

    reserve_tokens: int
    quantiles: Mapping[float, int] = field(default_factory=dict)
    source: str = "max_tokens"


@dataclass(frozen=True, slots=True)
class RequestInfo:
    request_id: str
    model: str
    prompt_tokens: int
    max_tokens: int
    estimate: OutputEstimate | None = None
    prefix_hashes: tuple[int, ...] = ()
    priority: int = 0
    arrival_s: float = 0.0
    slo_ttft_s: float | None = None
    slo_itl_s: float | None = None
    hint_output_tokens: int | None = None
    # Whether the hint comes from a caller trusted to lower a reservation with it (router
    # setting `trust_hints`; tenants mark their own). An untrusted hint may only raise one.
    hint_trusted: bool = False
    # Choices in the answer (the request's `n`), and the decode block size their partial
    # blocks are counted in (the largest of the decode workers': an upper bound).
    n: int = 1
    block_size: int = 16
    # Whose request it is: a named tenant's answers teach its own estimator classes first
    # (policies/estimators.py `class_keys_for`). "" or `default` (no tenants configured): the
    # shared classes, as before tenants existed.
    tenant: str = ""
    # The LoRA adapter the request names (its `model`; `model` above is then the adapter's base
    # model); "": none. Placement sees only workers that hold it or may load it (docs/lora.md).
    lora: str = ""

    @property
    def reserve_choice_tokens(self) -> int:
        """Output tokens to reserve for one choice: the estimate's upper quantile, else the cap."""
        if self.estimate is None:
            return self.max_tokens
        return max(1, min(self.max_tokens, self.estimate.reserve_tokens))

    @property
    def expected_choice_tokens(self) -> int:
        """Output tokens one choice is expected to take: the estimate's median where it has one
        (capped by max_tokens), else what is reserved. What a request is charged up front — its
        fair share (policies/fairness.py `admission_charge`), its tenant's tokens per minute
        (router/request/quota.py) — and corrected with the real count at its end."""
        median = self.estimate.quantiles.get(0.5) if self.estimate is not None else None
        if median is None:
            return self.reserve_choice_tokens
        return max(0, min(self.max_tokens, median))

    @property
    def reserve_output_tokens(self) -> int:
        """Output tokens to reserve for, every choice counted: n choices decode side by side,
        each holding its own output (and its own partial prompt block, `extra_choice_tokens`),
        so `prompt_tokens + reserve_output_tokens` is the KV the whole answer holds."""
        per_choice = self.reserve_choice_tokens
        if self.n <= 1:
            return per_choice
        return self.n * per_choice + extra_choice_tokens(
            self.prompt_tokens, self.n, self.block_size
        )


@dataclass(frozen=True, slots=True)
class PrefillView:
    """One prefill worker as the router's accounting sees it at snapshot time."""

    worker_id: str
    layout: KVLayout
    healthy: bool = True
    group: str = "default"
    # Prompt tokens queued on this worker, including requests still in prefill.
    queued_prompt_tokens: int = 0
    inflight: int = 0
    # Measured (or modelled) prefill throughput, prompt tokens per second.
    prefill_tokens_per_s: float = 10_000.0
    stranded_bytes: int = 0
    stranded_cap_bytes: int = 0  # 0 = no cap
    # Prefix block hashes this worker prefilled recently (prefix-cache affinity, estimated).
    recent_prefixes: frozenset[int] = frozenset()
    # Exact: the tokens at the start of this request's prompt that the worker's prefix cache
    # holds, from its own KV events (policies/token_blocks.py names the blocks). None: not
    # known (no events from this worker): placement falls back to `recent_prefixes`.
    cached_prefix_tokens: int | None = None
    # Seconds before this worker can serve the request's LoRA adapter: 0 held (or no adapter),
    # the expected load time where the router will load it first (router/workers/loras.py).
    lora_load_s: float = 0.0

    @property
    def under_stranded_cap(self) -> bool:
        return self.stranded_cap_bytes <= 0 or self.stranded_bytes < self.stranded_cap_bytes


@dataclass(frozen=True, slots=True)
class DecodeView:
    """One decode worker: its KV room and its batch, as the router's accounting sees it."""

    worker_id: str
    layout: KVLayout
    capacity_blocks: int
    reserved_blocks: int = 0
    used_blocks: int = 0
    resident_seqs: int = 0
    healthy: bool = True
    group: str = "default"
    # Linear decode step model: step_s = step_base_s + step_s_per_block * blocks in the batch.
    step_base_s: float = 0.005
    step_s_per_block: float = 0.0
    # A decode worker that can also prefill locally (conditional disaggregation).
    can_prefill: bool = False
    prefill_tokens_per_s: float = 10_000.0
    queued_prompt_tokens: int = 0
    # Exact, as on PrefillView: this request's leading prompt tokens the decode worker's own
    # prefix cache holds (only the rest of the KV need cross the link; a local prefill computes
    # only the rest). None: not known.
    cached_prefix_tokens: int | None = None
    lora_load_s: float = 0.0  # as on PrefillView: the adapter's load before the request runs

    @property
    def free_blocks(self) -> int:
        return self.capacity_blocks - max(self.reserved_blocks, self.used_blocks)

    def step_time_s(self, extra_blocks: int = 0) -> float:
        blocks = max(self.reserved_blocks, self.used_blocks) + extra_blocks
        return self.step_base_s + self.step_s_per_block * blocks


@dataclass(frozen=True, slots=True)
class ClusterView:
    prefill: tuple[PrefillView, ...]
    decode: tuple[DecodeView, ...]
    kv_bytes_per_token: int
    # Link bandwidth in bytes/s between a prefill group and a decode group.
    links: Mapping[tuple[str, str], float] = field(default_factory=dict)
    default_link_bytes_per_s: float = 50e9
    # Per-link setup latency (connection, handshake, first-byte) in seconds.
    link_latency_s: float = 0.0005

    def link_bytes_per_s(self, prefill_group: str, decode_group: str) -> float:
        return self.links.get((prefill_group, decode_group), self.default_link_bytes_per_s)

    def transfer_s(self, prompt_tokens: int, prefill_group: str, decode_group: str) -> float:
        bw = self.link_bytes_per_s(prefill_group, decode_group)
        return self.link_latency_s + prompt_tokens * self.kv_bytes_per_token / bw


@dataclass(frozen=True, slots=True)
class Candidate:
    """One (prefill, decode) pair to try. `prefill_id` None = the decode worker prefills locally."""

    prefill_id: str | None
    decode_id: str
    reserve_blocks: int
    predicted_ttft_s: float = 0.0
    predicted_itl_s: float = 0.0


@dataclass(frozen=True, slots=True)
class Placement:
    candidates: tuple[Candidate, ...]


@dataclass(frozen=True, slots=True)
class Rejection:
    reason: str
    retry_after_s: float = 1.0


Decision = Placement | Rejection

# class key -> {bucket upper bound (tokens) -> count}; see policies.estimators for the buckets.
OutputHistograms = Mapping[str, Mapping[int, int]]


@runtime_checkable
class PlacementPolicy(Protocol):
    """Chooses where a request runs. Pure and synchronous; deterministic under its seed."""

    name: str

    def place(self, request: RequestInfo, view: ClusterView) -> Decision: ...


@runtime_checkable
class OutputLengthEstimator(Protocol):
    """Estimates how long an answer will be, from shared statistics. Pure and synchronous.

    The router (or the simulator) fetches `histograms` for `class_keys(request)` from the state
    store, calls `estimate`, and after the request ends records the true length under the same
    keys with `bucket_of(n)`.
    """

    name: str

    def class_keys(self, request: RequestInfo) -> tuple[str, ...]: ...

    def estimate(self, request: RequestInfo, histograms: OutputHistograms) -> OutputEstimate: ...

    def bucket_of(self, output_tokens: int) -> int: ...


# -- roles: which kv_both workers serve prefill and which decode -------------------------------

Role = Literal["prefill", "decode"]
# active: serving `role`; draining: leaving the other role for `role` (finishing what it holds,
# taking nothing new); paused: drained, in the reconfiguration pause before serving `role`.
RoleState = Literal["active", "draining", "paused"]


@dataclass(frozen=True, slots=True)
class RoleWorkerView:
    """One worker as a role policy sees it. `role` is where it serves or is heading to.

    Both sides' load fields are filled for whatever the worker holds now: a worker draining out
    of decode still shows its resident blocks, one draining out of prefill its queue.
    """

    worker_id: str
    role: Role
    state: RoleState = "active"
    # False: a worker started for one role only (not `kv_both`); it counts, but never moves.
    can_switch: bool = True
    # When it entered `role` (the start of its drain, for a worker in transition).
    since_s: float = float("-inf")
    # Prefill side: prompt tokens queued (incl. the one in prefill) and its throughput on the
    # recent mix of prompts (tokens/s, prefix-cache hits excluded).
    queued_prompt_tokens: int = 0
    prefill_tokens_per_s: float = 10_000.0
    # Decode side: KV blocks and what the router's accounting holds of them (reservations or
    # use, whichever is larger), resident sequences, and its linear step-time model.
    capacity_blocks: int = 0
    held_blocks: int = 0
    # Of those, blocks reserved for requests whose KV has not arrived yet (queued for, or in,
    # prefill): held because the prefill pool has not got to them, not because decode is busy.
    pending_blocks: int = 0
    resident_seqs: int = 0
    step_base_s: float = 0.005
    step_s_per_block: float = 0.0

    @property
    def serving(self) -> bool:
        return self.state == "active"

    def step_time_s(self) -> float:
        return self.step_base_s + self.step_s_per_block * self.held_blocks


@dataclass(frozen=True, slots=True)
class RoleSnapshot:
    """The cluster's demand on both phases, as the router's accounting saw it at `now_s`.

    Rates are smoothed by the caller over a window much longer than a reconfiguration pause
    (the simulator: an exponential window of `ClusterConfig.role_window_s`).
    """

    now_s: float
    workers: tuple[RoleWorkerView, ...]
    # Prompt tokens arriving per second that prefill must compute (prefix-cache hits excluded).
    prefill_demand_tokens_per_s: float = 0.0
    # The largest prompt-token queue of the prefill pool in the recent window (decayed peak):
    # bursty traffic breaks the TTFT SLO at a low mean load, and the peak is what shows it.
    peak_queued_prompt_tokens: float = 0.0
    # KV blocks wanted by requests the router is holding back for lack of decode room.
    decode_waiting_blocks: int = 0
    # Prompt tokens of those held-back requests (they will need prefill too).
    decode_waiting_prompt_tokens: int = 0
    # KV blocks the decode pool should hold at the current arrival rate (Little's law: blocks
    # reserved per second × how long a request holds them); 0 = not known. The held blocks
    # lag a rise in demand by a request's lifetime; this does not.
    decode_demand_blocks: float = 0.0
    # How long a request holds its decode room (seconds; 0 = not known): turns the blocks of
    # requests waiting for room into the wait they see, judged against the TTFT SLO.
    decode_hold_s: float = 0.0
    slo_ttft_s: float = 2.0
    slo_itl_s: float = 0.1
    # The modelled pause between a drained worker and its first work in the new role.
    reconfig_pause_s: float = 0.0
    # Start times of the switches of the last minute (every replica's, through the store).
    recent_switches_s: tuple[float, ...] = ()


@dataclass(frozen=True, slots=True)
class RoleSwitch:
    """Start draining `worker_id` out of its role; it serves `to_role` after the pause."""

    worker_id: str
    to_role: Role
    reason: str = ""


@dataclass(frozen=True, slots=True)
class RolePlan:
    """A role policy's answer: the switches to start now (often none) and the pressures it saw
    (1.0 = the phase at its SLO-bound capacity), for metrics and the admin API."""

    switches: tuple[RoleSwitch, ...] = ()
    prefill_pressure: float = 0.0
    decode_pressure: float = 0.0
    note: str = ""


@runtime_checkable
class RolePolicy(Protocol):
    """Decides which kv_both workers serve prefill and which decode. Pure and synchronous;
    deterministic under its seed (no clock but `snapshot.now_s`, no I/O)."""

    name: str

    def decide(self, snapshot: RoleSnapshot) -> RolePlan: ...


# -- admission order among tenants: who gets the room that frees (docs/policies.md, fair share) --


@dataclass(frozen=True, slots=True)
class Tenant:
    """Who a request is for. `weight` (> 0) is its share of what is scarce, relative to the other
    tenants'; `priority` is its priority class (lower first, as vLLM's request priority)."""

    name: str
    weight: float = 1.0
    priority: int = 0

    def __post_init__(self) -> None:
        if not self.weight > 0:  # also refuses NaN
            raise ValueError(f"tenant {self.name!r}: weight must be > 0, got {self.weight}")


@dataclass(frozen=True, slots=True)
class AdmissionCost:
    """What one request takes of what is scarce in a disaggregated cluster: the decode room it
    holds (blocks reserved × seconds held, from the reservation before its prefill to the release
    at its end) and the prefill time it needs (prompt tokens to compute). Estimated when it
    waits; measured when it ends. A fairness policy weighs the two into one number."""

    decode_block_s: float
    prefill_tokens: int


@dataclass(frozen=True, slots=True)
class WaitingRequest:
    """One request asking for admission. `ticket` is its place in line (the router's
    `Admission.ticket()`, kept across its re-waits: unique, increasing with arrival); `priority`
    its class (lower first), which the caller derives from the request and its tenant;
    `since_s` when it began to wait, on the caller's clock."""

    ticket: int
    tenant: Tenant
    priority: int
    cost: AdmissionCost
    since_s: float = 0.0


@dataclass(frozen=True, slots=True)
class Charge:
    """What a policy charged a tenant when it admitted a request, handed back with the actual
    cost at the end (`FairnessPolicy.settle`), so the policy keeps no record per request."""

    tenant: str
    priority: int
    units: float
    weight: float
    blocks: int = 0  # the decode blocks its reservation held when admitted (the caller's)


@runtime_checkable
class FairnessPolicy(Protocol):
    """Orders the admission queue: which waiting request gets the room that frees next. Pure
    and synchronous, deterministic (no clock but `now_s`, ties by ticket); it keeps the waiting
    requests in its own queues. A tenant is idle while it has nothing waiting; its next
    `enqueue` (or an `admit` that did not wait) is its return.

    - `enqueue`: the request waits (again: a ticket already waiting is left as it is);
    - `withdraw`: it stops waiting without being admitted (deadline, cancel); unknown: ignored;
    - `pick`: the request that goes next, not removed; `skip` names tickets the caller already
      tried this round (woken, no room), so it asks for the next in line; None: nobody (else);
    - `admit`: the request got its room: removed if it waited, and charged at its estimate;
    - `settle`: the request ended: charge the difference between `actual` and the estimate.
    """

    name: str

    def enqueue(self, request: WaitingRequest) -> None: ...

    def withdraw(self, ticket: int) -> None: ...

    def pick(self, now_s: float, skip: Collection[int] = ()) -> WaitingRequest | None: ...

    def admit(self, request: WaitingRequest) -> Charge: ...

    def settle(self, charge: Charge, actual: AdmissionCost) -> None: ...
