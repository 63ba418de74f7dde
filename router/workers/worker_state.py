"""One worker as this router replica sees it: its configuration, health, what is placed on it.

A `WorkerState` is a plain record. Several objects write to it, each its own fields: the
membership (router/workers/membership.py) creates it, the health prober its health and layout,
the local accounting and the state refresher the load figures, the registry sync its drain and
role, the request path what it has in flight.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from router.worker_spec import WorkerSpec
from router.workers.breaker import CircuitBreaker
from router.workers.discovery import LoadSnapshot
from router.workers.prefixes import RecentPrefixes
from state.base import DrainMark, WorkerRole

__all__ = ["WorkerState"]


@dataclass(slots=True)
class WorkerState:
    spec: WorkerSpec
    healthy: bool = True
    consecutive_failures: int = 0
    inflight: int = 0
    queued_prompt_tokens: int = 0  # prompts dispatched for prefill, answer not yet back
    resident_seqs: int = 0  # decode streams open on this worker (this replica)
    capacity_blocks: int = 0
    reserved_blocks: int = 0  # all replicas, from the store, adjusted locally
    reservations: int = 0  # live reservations of all replicas, at the last refresh
    # Reservations this replica has placed here and is still writing to the store: counted in
    # placement so that a burst's concurrent placements see one another instead of all taking
    # the same momentarily emptiest worker.
    pending_blocks: int = 0
    stranded_bytes: int = 0
    recent_prefixes: RecentPrefixes = field(default_factory=RecentPrefixes)
    breaker: CircuitBreaker = field(default_factory=CircuitBreaker)
    load: LoadSnapshot | None = None  # the worker's own report, when polled (`took_load`)
    # The blocks the router's accounting held here when that report came (reserved + pending):
    # what the report is compared with (`used_blocks`). None: a report set without it.
    load_reserved: int | None = None
    dynamic: bool = False  # registered through the admin API (not from the config file)
    registration: str | None = None  # a dynamic worker's registry entry, to put back if lost
    # False until a `discover_layout` worker has told its layout: never paired on a guess.
    layout_known: bool = True
    drained: bool = False  # an operator's drain (router/workers/drain.py): no new placements
    # A discovered worker's pod as this replica's own watch last saw it: Ready and not
    # Terminating (router/workers/kube/). False takes it out of rotation at once, before the
    # shared drain mark has gone round the store; its streams finish.
    pod_ready: bool = True
    # The store's record of its last drain or undrain (None: none known): what this replica
    # puts back if the store loses it, compared by time with the other replicas' views.
    drain_mark: DrainMark | None = None
    # A `both` worker's current role from the store (router/control/role_manager.py); None: never
    # given one,
    # it serves as it always has (decode, prefilling its own requests when the policy says).
    role_state: WorkerRole | None = None
    # An SGLang `both` worker (spec.switches_engine_role): the role its engine serves, as its
    # /server_info last said or a role switch of this replica's made it (None: not read yet;
    # "both": not in PD mode), whether it can switch (--enable-pd-role-switch), and the message
    # of a switch that left it broken (cleared by a later switch that works, or when the
    # worker fails its probes: what comes back is a restarted process).
    engine_role: str | None = None
    engine_switchable: bool = False
    engine_broken: str | None = None
    # Its decode CUDA graphs as it last reported them serving decode (SGLang's internal
    # states), handed back when it is switched to decode again (router/workers/engine_role.py).
    decode_graphs: Mapping[str, Any] = field(default_factory=dict)
    # Its decode streams open on this replica, so that a drain past its deadline can cut them
    # (they resume elsewhere with the tokens sent so far).
    open_streams: set[Any] = field(default_factory=set)

    @property
    def worker_id(self) -> str:
        return self.spec.id

    @property
    def current_role(self) -> str:
        """prefill | decode | both (a `both` worker with no role yet) | draining-to-<role>.

        An SGLang engine with no role record serves the role it was started in; one whose
        engine does not serve its recorded role yet (a switch another replica made, not yet
        read here; an engine restarted in its start-up role) is on its way there: in neither
        pool, for no request may reach an engine in the other role."""
        record = self.role_state
        if self.spec.role != "both":
            return self.spec.role
        if not self.spec.switches_engine_role:
            return self.spec.role if record is None else record.role
        if record is None:
            return self.engine_role or "both"
        if self.engine_behind:
            return f"draining-to-{record.role}"
        return record.role

    @property
    def engine_can_switch(self) -> bool:
        """An SGLang `both` engine that can be switched: in PD mode, started with
        --enable-pd-role-switch (as its /server_info last said)."""
        return self.engine_switchable and self.engine_role in ("prefill", "decode")

    @property
    def engine_behind(self) -> bool:
        """An SGLang engine that does not serve the role its record gives (yet): the prober
        reads its /server_info at each probe until it does."""
        record = self.role_state
        return (
            self.spec.switches_engine_role
            and record is not None
            and record.role in ("prefill", "decode")
            and self.engine_role != record.role
        )

    @property
    def in_prefill_pool(self) -> bool:
        return self.current_role == "prefill"

    @property
    def in_decode_pool(self) -> bool:
        return self.current_role in ("decode", "both")

    @property
    def available(self) -> bool:
        """In rotation: passing health probes, its circuit breaker lets a request through, not
        drained, and (a discovered worker) its pod Ready."""
        return (
            self.healthy
            and self.layout_known
            and not self.drained
            and self.pod_ready
            and self.breaker.allows()
        )

    def took_load(self, load: LoadSnapshot) -> None:
        """The worker's own load report, just read: kept with the router's accounting of the
        same moment."""
        self.load = load
        self.load_reserved = self.reserved_blocks + self.pending_blocks

    def used_blocks(self, load: LoadSnapshot) -> int:
        """The KV blocks the worker holds now by its report `load` (0: no usage reported).

        A report is as old as the last poll (`loops.load_poll_s`, 1 s), and the room the
        router releases meanwhile is free at once: the worker frees an answer's KV when it
        ends. So only what the worker held *beyond* the router's reservations when it reported
        (KV of answers that outgrew theirs, other clients' requests) is carried forward, on top
        of the reservations held now. Taking the report as it was instead kept a worker whose
        streams all ended looking full until the next poll: no admission for up to a second
        (issue 33's flood bench: the victim's TTFT p99 1.3-1.5 s, from these stalls)."""
        if load.kv_usage is None:
            return 0
        reported = int(load.kv_usage * self.capacity_blocks)
        if self.load_reserved is None:
            return reported
        beyond = reported - self.load_reserved
        return self.reserved_blocks + self.pending_blocks + beyond if beyond > 0 else 0

    def __repr__(self) -> str:
        return (
            f"WorkerState({self.spec.id} {self.spec.role} healthy={self.healthy} "
            f"queued={self.queued_prompt_tokens} seqs={self.resident_seqs} "
            f"reserved={self.reserved_blocks}/{self.capacity_blocks} "
            f"stranded={self.stranded_bytes})"
        )
