"""The shape of a simulated cluster: its workers, their links, and how the router behaves.

One frozen value describes a whole run, so two runs with equal configs (and seeds) are the same
experiment. Workers carry their own `PerfModel`, so heterogeneous fleets (H100 prefill, L40S
decode, ...) are just different `SimWorkerSpec`s; `ClusterConfig.homogeneous` builds the usual case.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import TYPE_CHECKING, Literal, TypedDict

from policies.base import KVLayout
from policies.costmodel import PerfModel, perf_model
from policies.role_pauses import ENGINE_RECONFIG_PAUSE_S

if TYPE_CHECKING:
    from typing_extensions import Unpack  # typing's own from Python 3.12

__all__ = [
    "SimWorkerSpec",
    "ClusterConfig",
    "ClusterKnobs",
    "ClusterFields",
    "OnFull",
    "Admission",
    "Affinity",
]

OnFull = Literal["preempt", "refuse"]
Admission = Literal["instant", "predictive"]
# What the router is told of the workers' prefix caches (disagg_tools/simcluster/prefix_facts.py).
Affinity = Literal["exact", "exact_prefill", "estimated", "none", "oracle"]
AFFINITIES = ("exact", "exact_prefill", "estimated", "none", "oracle")


@dataclass(frozen=True, slots=True)
class SimWorkerSpec:
    """One GPU worker (or one TP group acting as one worker)."""

    worker_id: str
    perf: PerfModel
    group: str = "default"
    # None = the cluster's shared layout; set per worker to test layout-mismatch handling.
    layout: KVLayout | None = None
    # None = the perf model's KV capacity; tests set small numbers to force memory pressure.
    capacity_blocks: int | None = None

    @property
    def kv_capacity_blocks(self) -> int:
        if self.capacity_blocks is not None:
            return self.capacity_blocks
        return self.perf.kv_capacity_blocks


@dataclass(frozen=True, slots=True)
class ClusterConfig:
    """A cluster and a router mode. See `disagg_tools.simcluster.engine.simulate` for how each knob
    is used."""

    prefill: tuple[SimWorkerSpec, ...]
    decode: tuple[SimWorkerSpec, ...]
    model: str = "llama-3-8b"
    layout: KVLayout = KVLayout()
    # (prefill group, decode group) -> bytes/s; pairs not listed use the default.
    links: Mapping[tuple[str, str], float] = field(default_factory=dict)
    default_link_bytes_per_s: float = 50e9
    link_latency_s: float = 0.0005
    # Router mode: reserve decode room before prefill (ours) or place and hope (the peers).
    reserve: bool = True
    # What a decode worker does when its KV is full at a handoff in the peers' mode: evict its
    # newest sequence (vLLM's recompute preemption) or refuse, leaving the KV stranded on P
    # until room appears. With `reserve` such a handoff always waits on P (it can only happen
    # after overruns or a predictive admission). A sequence that grows past the physical KV
    # preempts the newest sequence in every mode: there is nowhere else for it to go.
    on_full: OnFull = "preempt"
    admission: Admission = "instant"
    # Requests the policy rejects wait here (FIFO) until room or their TTFT deadline.
    queue_limit: int = 1024
    # Longest wait in the admission queue (the router's `admission.max_wait_s`); None: the TTFT
    # SLO, as before. A fairness run waits longer so that backlogged tenants stay backlogged.
    max_wait_s: float | None = None
    # Backpressure: a prefill worker does not start a prompt whose KV would push its stranded
    # bytes past this (0 = no cap). A single prompt larger than the cap still runs alone.
    stranded_cap_bytes: int = 0
    # Prefix cache per prefill worker, in prefix-hash blocks (0 = off), and the tokens per
    # hash id (Mooncake's traces use 512).
    prefix_cache_blocks: int = 0
    prefix_block_tokens: int = 512
    # Exact prefix caches on both pools (`prefix_cache_blocks` each) and what the placement
    # policy sees of them (simcluster/prefix_facts.py). None: the prefill-only LRU above, seen
    # through `recent_prefixes` (the simulator as it was before issue 22).
    affinity: Affinity | None = None
    # Delay of a worker's KV events (stored/removed) on their way into the router's index.
    kv_event_lag_s: float = 0.0
    # Debug: at every placement, check the router's index equals the caches (with no lag).
    check_views: bool = False
    # Client max_tokens; outputs longer than it are cut there, as a real server would.
    max_tokens: int = 4096
    # Multiplicative uniform noise on prefill times (0 = the cost model exactly).
    prefill_jitter: float = 0.0
    # -- Mirroring the live simulated cluster (router + `disagg_tools.sim.worker` processes); all
    # off by default, so the simulator charges the cost model exactly.
    # `python -m disagg_tools.launcher.validate --calibrate` measures and sets them. Times are
    # simulated (real-cluster) seconds: a live cost of w wall seconds at time scale S is w * S
    # here.
    # Fixed per-request cost of the live path that the cost model does not know: HTTP hops
    # (client -> router -> P -> router -> D -> P's KV endpoint ... -> router -> client), store
    # round trips, router work, timer overshoot of the prefill and transfer sleeps. Charged as a
    # delay between admission and the prefill worker's queue, so TTFT (and E2E) rise by it.
    router_overhead_s: float = 0.0
    # Extra time per decode step on top of the perf model's own `step_overhead_s` (the live
    # worker's event-loop work per step and its sleep's overshoot); every token gap rises by it.
    step_overhead_s: float = 0.0
    # Timer granularity: each prefill, KV transfer and decode step lasts a whole number of
    # quanta (rounded half to even), as uvloop rounds every sleep to whole milliseconds
    # (live: 1 ms x time scale). 0 = exact.
    timer_quantum_s: float = 0.0
    # True: a sequence whose KV lands during a decode step gets its first token at the end of
    # that step, as `disagg_tools.sim.decode_engine.DecodeEngine` (the live simulated worker) adds
    # it to the
    # running set at once. False (vLLM): it joins at the next step boundary.
    join_mid_step: bool = False
    # -- Elastic roles (docs/elastic-roles.md): every worker is `kv_both` and a `RolePolicy`
    # (passed to `simulate`) moves workers between the pools; `prefill` and `decode` give the
    # initial split. A switch drains the worker, pauses it, then serves. The pause is the live
    # router's for the `engine` kind modelled (policies/role_pauses.py: vllm 0, sglang 2 s, sim
    # 0), unless `reconfig_pause_s` gives one. The default engine is sglang, the 2 s pause the
    # cells of docs/elastic-roles.md were measured with (vLLM's kv_both pauses 0: the drain is
    # its whole cost).
    elastic: bool = False
    engine: str = "sglang"
    reconfig_pause_s: float | None = None
    # Past this much draining, sequences still resident on a worker leaving decode are resumed
    # on another decode worker with their exact tokens (None = they always finish where they are).
    drain_deadline_s: float | None = 5.0
    # How often the role policy decides, and the window its demand rates are smoothed over.
    role_interval_s: float = 1.0
    role_window_s: float = 15.0
    # -- Both arrangements, one cost model. `local_prefill`: decode workers are `kv_both` and may
    # prefill a request themselves (`DecodeView.can_prefill`; the placement policy chooses per
    # request: local, no transfer, the batch stalls for it; or remote through the prefill pool).
    # With no prefill workers that is the time-shared arrangement (every request on one GPU).
    local_prefill: bool = False
    # KV transfers queue on the links they use: one at a time out of a prefill worker's NIC and
    # into a decode worker's (False: every transfer gets the whole link, as before).
    link_contention: bool = False
    # The router's in-flight corrections (policies/overruns.py,
    # disagg_tools/simcluster/feedback.py): live
    # overruns raise their class's estimate; forced growth keeps a margin back on its worker.
    inflight_feedback: bool = True
    overrun_margin: bool = True
    margin_half_life_s: float = 60.0
    margin_max_share: float = 0.25
    # Preemption with exact resume (issue 31; router/request/preemption.py, the router's
    # `preemption` settings): a live answer that must grow its reservation on a full decode
    # worker stops one of its own tenant's streams there (policies/preemption.py, newest
    # dispatch first, itself included), which gives its room back and resumes as a new request
    # (prompt + the tokens it produced, re-prefilled, its whole remaining max_tokens reserved,
    # waiting in admission up to `preemption_resume_wait_s`). Off: the growth is forced past
    # capacity as before (the engine then preempts and recomputes on its own). A stream is
    # preempted at most `preemption_max_per_stream` times; then its growth is forced (counted).
    preemption: bool = True
    preemption_max_per_stream: int = 2
    preemption_resume_wait_s: float = 60.0

    def __post_init__(self) -> None:
        if not self.prefill and not self.decode:
            raise ValueError("a cluster needs workers")
        if not self.decode:
            raise ValueError("a cluster needs at least one decode worker")
        if not self.prefill and not self.local_prefill:
            raise ValueError("with no prefill worker, decode workers must prefill (local_prefill)")
        ids = [w.worker_id for w in (*self.prefill, *self.decode)]
        if len(set(ids)) != len(ids):
            raise ValueError("worker ids must be unique")
        if self.on_full not in ("preempt", "refuse"):
            raise ValueError(f"on_full must be 'preempt' or 'refuse', not {self.on_full!r}")
        if self.admission not in ("instant", "predictive"):
            raise ValueError(f"admission must be 'instant' or 'predictive', not {self.admission!r}")
        if self.queue_limit < 0 or self.max_tokens < 1 or not 0 <= self.prefill_jitter < 1:
            raise ValueError("queue_limit >= 0, max_tokens >= 1, 0 <= prefill_jitter < 1")
        if min(self.router_overhead_s, self.step_overhead_s, self.timer_quantum_s) < 0:
            raise ValueError("router_overhead_s, step_overhead_s, timer_quantum_s must be >= 0")
        if self.elastic and not self.prefill:
            raise ValueError("an elastic cluster starts with at least one prefill worker")
        if self.engine not in ENGINE_RECONFIG_PAUSE_S:
            raise ValueError(f"engine must be one of {sorted(ENGINE_RECONFIG_PAUSE_S)}")
        if self.pause_s < 0 or (self.drain_deadline_s or 0.0) < 0:
            raise ValueError("reconfig_pause_s and drain_deadline_s must be >= 0")
        if self.role_interval_s <= 0 or self.role_window_s <= 0:
            raise ValueError("role_interval_s and role_window_s must be > 0")
        if self.affinity is not None:
            if self.affinity not in AFFINITIES:
                raise ValueError(f"affinity must be one of {AFFINITIES} or None")
            if self.elastic:
                raise ValueError("exact prefix caches are not modelled with elastic roles")
        if self.preemption_max_per_stream < 0 or self.preemption_resume_wait_s <= 0:
            raise ValueError("preemption_max_per_stream >= 0, preemption_resume_wait_s > 0")
        if self.kv_event_lag_s < 0 or self.prefix_cache_blocks < 0:
            raise ValueError("kv_event_lag_s and prefix_cache_blocks must be >= 0")
        # A frozen config should not share a dict the caller can still mutate.
        object.__setattr__(self, "links", MappingProxyType(dict(self.links)))

    @property
    def pause_s(self) -> float:
        """The reconfiguration pause of a switch: `reconfig_pause_s`, or the engine's."""
        if self.reconfig_pause_s is not None:
            return self.reconfig_pause_s
        return ENGINE_RECONFIG_PAUSE_S[self.engine]

    def layout_of(self, spec: SimWorkerSpec) -> KVLayout:
        return spec.layout or self.layout

    @property
    def kv_bytes_per_token(self) -> int:
        return self.decode[0].perf.kv_bytes_per_token

    def link_bytes_per_s(self, prefill_group: str, decode_group: str) -> float:
        return self.links.get((prefill_group, decode_group), self.default_link_bytes_per_s)

    def with_(self, **changes: Unpack[ClusterFields]) -> ClusterConfig:
        return replace(self, **changes)

    @classmethod
    def homogeneous(
        cls,
        n_prefill: int = 2,
        n_decode: int = 6,
        model: str = "llama-3-8b",
        gpu: str = "h100",
        *,
        tp_size: int | None = None,
        decode_gpu: str | None = None,
        link_bytes_per_s: float | None = None,
        capacity_blocks: int | None = None,
        **kwargs: Unpack[ClusterKnobs],
    ) -> ClusterConfig:
        """N prefill and M decode workers of one model; decode may use another GPU.

        The default link is the GPU's scale-out NIC (×TP), the bottleneck across nodes.
        """
        p_perf = perf_model(model, gpu, tp_size)
        d_perf = perf_model(model, decode_gpu or gpu, tp_size)
        m = p_perf.model
        layout = KVLayout(
            model=model,
            kv_heads=m.kv_heads,
            head_dim=m.head_dim,
            block_size=d_perf.block_size,
            tp_size=p_perf.tp_size,
        )
        # A prefill spec carries the decode capacity too: an elastic worker may decode.
        prefill = tuple(
            SimWorkerSpec(f"p{i}", p_perf, "prefill", capacity_blocks=capacity_blocks)
            for i in range(n_prefill)
        )
        decode = tuple(
            SimWorkerSpec(f"d{i}", d_perf, "decode", capacity_blocks=capacity_blocks)
            for i in range(n_decode)
        )
        if link_bytes_per_s is None:
            link_bytes_per_s = min(p_perf.gpu.nic_bytes_per_s, d_perf.gpu.nic_bytes_per_s)
            link_bytes_per_s *= p_perf.tp_size
        kwargs.setdefault("links", {("prefill", "decode"): link_bytes_per_s})
        kwargs.setdefault("default_link_bytes_per_s", link_bytes_per_s)
        return cls(prefill, decode, model=model, layout=layout, **kwargs)

    def __repr__(self) -> str:
        return (
            f"ClusterConfig({len(self.prefill)}P+{len(self.decode)}D {self.model}, "
            f"reserve={self.reserve}, on_full={self.on_full}, admission={self.admission}"
            + (f", elastic, {self.engine} pause={self.pause_s}s" if self.elastic else "")
            + ")"
        )


class ClusterKnobs(TypedDict, total=False):
    """The keyword arguments `ClusterConfig.homogeneous` passes on: every field but the workers,
    the model and the layout, which it builds. Kept beside the dataclass so a call with a
    misspelt knob or a wrong type fails the type check, not a run."""

    links: Mapping[tuple[str, str], float]
    default_link_bytes_per_s: float
    link_latency_s: float
    reserve: bool
    on_full: OnFull
    admission: Admission
    queue_limit: int
    max_wait_s: float | None
    stranded_cap_bytes: int
    prefix_cache_blocks: int
    prefix_block_tokens: int
    affinity: Affinity | None
    kv_event_lag_s: float
    check_views: bool
    max_tokens: int
    prefill_jitter: float
    router_overhead_s: float
    step_overhead_s: float
    timer_quantum_s: float
    join_mid_step: bool
    elastic: bool
    engine: str
    reconfig_pause_s: float | None
    drain_deadline_s: float | None
    role_interval_s: float
    role_window_s: float
    local_prefill: bool
    link_contention: bool
    inflight_feedback: bool
    overrun_margin: bool
    margin_half_life_s: float
    margin_max_share: float
    preemption: bool
    preemption_max_per_stream: int
    preemption_resume_wait_s: float


class ClusterFields(ClusterKnobs, total=False):
    """Every field of `ClusterConfig`: what `ClusterConfig.with_` may change."""

    prefill: tuple[SimWorkerSpec, ...]
    decode: tuple[SimWorkerSpec, ...]
    model: str
    layout: KVLayout
