"""The router's Prometheus metrics, on a registry of its own (one per app, no globals).

Hot-path rule: nothing here is touched per relayed chunk; a stream's token count is added once,
when it ends. The labelled metrics a request touches are reached through a `Labelled` (`*_by`):
its children looked up once per label set, not through prometheus_client's `labels()` each time.
"""

from __future__ import annotations

from typing import Generic, TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

__all__ = ["Labelled", "RouterMetrics"]

M = TypeVar("M", Counter, Gauge, Histogram)


class Labelled(Generic[M]):
    """A labelled metric's children, each looked up once: `by(*values)` is `metric.labels(*values)`
    (the values in the order of the metric's label names) at a dict lookup's cost, 0.1 us
    instead of 1.4 (prometheus_client validates the names and takes a lock each time). The
    metric keeps every child it ever made too, and the router removes none, so this holds
    nothing it would not."""

    __slots__ = ("metric", "_children")

    def __init__(self, metric: M) -> None:
        self.metric: M = metric
        self._children: dict[tuple[str, ...], M] = {}

    def __call__(self, *values: str) -> M:
        child = self._children.get(values)
        if child is None:
            child = self._children[values] = self.metric.labels(*values)
        return child

    def __repr__(self) -> str:
        return f"Labelled({self.metric._name}, {len(self._children)} children)"


_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1)
_TOKEN_BUCKETS = (1, 4, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)


class RouterMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        p = "disagg_router_"
        self.requests = Counter(
            p + "requests",
            "Client requests by route and final status",
            ["route", "status"],
            registry=r,
        )
        self.ttft = Histogram(
            p + "ttft_seconds",
            "Time to first token as the client sees it",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.duration = Histogram(
            p + "request_duration_seconds",
            "Whole request, end to end",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.prefill_seconds = Histogram(
            p + "prefill_seconds",
            "Prefill leg duration",
            ["worker"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.placements = Counter(
            p + "placements",
            "Requests placed, by prefill and decode worker",
            ["prefill", "decode"],
            registry=r,
        )
        self.rejections = Counter(
            p + "rejections", "Requests refused for lack of decode room", ["reason"], registry=r
        )
        self.reserve_conflicts = Counter(
            p + "reserve_conflicts",
            "Candidates whose reservation failed (another replica took the room)",
            registry=r,
        )
        self.reserved_blocks = Gauge(
            p + "reserved_blocks",
            "Decode KV blocks reserved (all replicas, last refresh)",
            ["worker"],
            registry=r,
        )
        self.capacity_blocks = Gauge(
            p + "decode_capacity_blocks",
            "Decode KV capacity in blocks, per worker (what reservations count against)",
            ["worker"],
            registry=r,
        )
        self.time_per_output_token = Histogram(
            p + "time_per_output_token_seconds",
            "Per request: (end - first token) / (output tokens - 1), the mean inter-token "
            "latency the client saw (observed once a request, not per token)",
            buckets=_TPOT_BUCKETS,
            registry=r,
        )
        self.active_reservations = Gauge(
            p + "active_reservations", "Reservations held by this replica", registry=r
        )
        self.stranded_bytes = Gauge(
            p + "stranded_kv_bytes",
            "KV bytes built by prefill and not yet accepted by decode",
            ["worker"],
            registry=r,
        )
        self.upstream_errors = Counter(
            p + "upstream_errors", "Worker failures by side and kind", ["side", "kind"], registry=r
        )
        self.tokens_relayed = Counter(
            p + "tokens_relayed", "Output tokens relayed to clients", registry=r
        )
        self.client_disconnects = Counter(
            p + "client_disconnects", "Clients that went away before the answer ended", registry=r
        )
        self.output_tokens = Histogram(
            p + "output_tokens",
            "True output length per request",
            buckets=_TOKEN_BUCKETS,
            registry=r,
        )
        self.predicted_output_tokens = Histogram(
            p + "predicted_output_tokens",
            "Output tokens reserved for, per request",
            buckets=_TOKEN_BUCKETS,
            registry=r,
        )
        self.reservation_overruns = Counter(
            p + "reservation_overruns", "Sequences that outgrew their reservation", registry=r
        )
        self.reservation_forced_growth = Counter(
            p + "reservation_forced_growth",
            "Reservations grown past the decode worker's capacity (the answer outgrew the "
            "estimate and the worker had no free room: the count follows use)",
            registry=r,
        )
        self.preemptions = Counter(
            p + "preemptions",
            "Live streams preempted (their decode stopped, their room given back, the stream "
            "resumed from the text sent), by why: the decode worker had no room for a growth "
            "(worker_full), the tenant was at its block limit (tenant_limit), room taken back "
            "for a tenant under its share (fair_share) or for a more urgent class (priority), "
            "or a test setting (forced)",
            ["reason"],
            registry=r,
        )
        self.preempted_tokens = Counter(
            p + "preempted_tokens",
            "Tokens the preempted streams had produced, re-prefilled by their continuation",
            registry=r,
        )
        self.retries = Counter(
            p + "retries", "Attempts after the first, by the side that failed", ["side"], registry=r
        )
        self.resumes = Counter(
            p + "resumes",
            "Streams continued on a new pair after the decode failed mid-stream",
            registry=r,
        )
        self.retry_budget_exhausted = Counter(
            p + "retry_budget_exhausted", "Retries refused by the cluster-wide budget", registry=r
        )
        self.stranded_expired = Counter(
            p + "stranded_kv_expired",
            "Stranded KV entries reaped after the KV lease",
            ["worker"],
            registry=r,
        )
        self.stranded_byte_seconds = Gauge(
            p + "stranded_kv_byte_seconds",
            "Stranded KV bytes integrated over time (this replica's view)",
            registry=r,
        )
        self.admission_waiting = Gauge(
            p + "admission_waiting", "Requests waiting for decode room", registry=r
        )
        self.estimate_relative_error = Histogram(
            p + "estimate_relative_error",
            "(reserved - actual) / actual output tokens",
            buckets=(-1, -0.5, -0.25, -0.1, 0, 0.1, 0.25, 0.5, 1, 2, 4, 8),
            registry=r,
        )
        self.breaker_state = Gauge(
            p + "breaker_open", "1 if the worker's circuit is open", ["worker"], registry=r
        )
        self.admitted_on_forecast = Counter(
            p + "admitted_on_forecast",
            "Reservations admitted on decode room forecast to free (predictive admission)",
            registry=r,
        )
        self.unpaired_workers = Gauge(
            p + "unpaired_workers", "Workers with no partner of the same KV layout", registry=r
        )
        self.worker_healthy = Gauge(
            p + "worker_healthy", "1 if the worker is in rotation", ["worker", "role"], registry=r
        )
        self.worker_drained = Gauge(
            p + "worker_drained",
            "1 while an operator has drained the worker (no new placements)",
            ["worker", "role"],
            registry=r,
        )

        self.store_up = Gauge(
            p + "store_up", "1 while the shared state store answers this replica", registry=r
        )
        self.store_resets = Counter(
            p + "store_resets",
            "Times the store was found to have lost its data (e.g. Redis restarted empty) and "
            "this replica put back what it holds",
            registry=r,
        )
        self.owed_store_steps = Gauge(
            p + "owed_store_steps",
            "Releases, unstrands and strands the store has not taken yet (retried every second)",
            registry=r,
        )
        self.background_task_failures = Counter(
            p + "background_task_failures",
            "Background tasks that ended with an error, by task",
            ["task"],
            registry=r,
        )
        # -- elastic roles (router/control/role_manager.py) ----------------------------------------
        self.worker_role = Gauge(
            p + "worker_role",
            "1 for a `both` worker's current role (prefill, decode, draining-to-prefill, "
            "draining-to-decode), 0 for the others",
            ["worker", "role"],
            registry=r,
        )
        self.role_switches = Counter(
            p + "role_switches",
            "Role switches started (a drain toward to_role), by what started them",
            ["worker", "to_role", "trigger"],
            registry=r,
        )
        self.role_decisions = Counter(
            p + "role_decisions",
            "Role policy decisions of this replica (while it held the lease), by outcome",
            ["note"],
            registry=r,
        )
        self.role_pressure = Gauge(
            p + "role_pressure",
            "Each phase's pressure at the last role decision (1.0 = at its SLO-bound capacity)",
            ["phase"],
            registry=r,
        )
        self.role_leader = Gauge(
            p + "role_leader", "1 while this replica holds the role manager's lease", registry=r
        )
        self.role_migrations = Counter(
            p + "role_migrations",
            "Decode streams cut past the drain deadline of a worker leaving decode (resumed "
            "elsewhere)",
            ["worker"],
            registry=r,
        )
        self.role_engine_switches = Counter(
            p + "role_engine_switches",
            "SGLang engines' runtime role switches (POST /pd_role_switch) asked by this replica, "
            "by outcome (ok, busy, broken, refused, unreachable)",
            ["worker", "to_role", "outcome"],
            registry=r,
        )
        # -- autoscaling signals (router/control/scaling.py), set at each scrape -------------------
        self.prefill_arriving_tokens = Gauge(
            p + "scaling_prefill_arriving_tokens_per_second",
            "Prompt tokens arriving for prefill per second (this replica, over scaling.window_s)",
            ["model"],
            registry=r,
        )
        self.prefill_queued_tokens = Gauge(
            p + "scaling_prefill_queued_tokens",
            "Prompt tokens dispatched for prefill and not answered yet (this replica)",
            ["model"],
            registry=r,
        )
        self.decode_resident_seqs = Gauge(
            p + "scaling_decode_resident_sequences",
            "Sequences holding decode room (every replica's reservations)",
            ["model"],
            registry=r,
        )
        self.decode_kv_blocks = Gauge(
            p + "scaling_decode_kv_blocks",
            "Decode KV blocks: kind=reserved (all replicas) or capacity (workers in rotation)",
            ["model", "kind"],
            registry=r,
        )
        self.decode_output_tokens = Gauge(
            p + "scaling_decode_output_tokens_per_second",
            "Output tokens streamed per second (this replica, over scaling.window_s)",
            ["model"],
            registry=r,
        )
        # KV events (router/workers/kv_events.py): each worker's prefix cache from its engine.
        self.kv_events_batches = Counter(
            p + "kv_events_batches",
            "KV-event batches applied to a worker's index",
            ["worker"],
            registry=r,
        )
        self.kv_events_gaps = Counter(
            p + "kv_events_gaps",
            "Sequence gaps in a worker's KV events (batches lost on the way)",
            ["worker"],
            registry=r,
        )
        self.kv_events_replays = Counter(
            p + "kv_events_replays",
            "Replays of missed KV-event batches, by outcome (ok, failed)",
            ["worker", "outcome"],
            registry=r,
        )
        self.kv_events_index_drops = Counter(
            p + "kv_events_index_drops",
            "A worker's KV index emptied: gap, restart, cleared, malformed, overflow, start",
            ["worker", "reason"],
            registry=r,
        )
        self.kv_events_malformed = Counter(
            p + "kv_events_malformed",
            "KV-event messages or events that are not vLLM's format",
            ["worker"],
            registry=r,
        )
        self.kv_events_refused = Counter(
            p + "kv_events_refused",
            "KV-event batches refused: batch_bytes, batch_blocks, capacity (index dropped)",
            ["worker", "reason"],
            registry=r,
        )
        self.kv_events_index_blocks = Gauge(
            p + "kv_events_index_blocks",
            "Blocks in a worker's KV index (what its events say it holds)",
            ["worker"],
            registry=r,
        )
        self.pool_replicas = Gauge(
            p + "scaling_pool_replicas",
            "Workers in rotation in the pool (healthy, not drained)",
            ["pool", "model"],
            registry=r,
        )
        self.recommended_replicas = Gauge(
            p + "scaling_recommended_replicas",
            "Workers the pool needs for its demand at the SLOs (policies/scaling.py)",
            ["pool", "model"],
            registry=r,
        )
        self.prompt_tokens_source = Counter(
            p + "prompt_tokens_source",
            "Requests by how their prompt was counted: the model's tokenizer, the client's "
            "token ids, or the character estimate (router/tokens/)",
            ["source"],
            registry=r,
        )

        # -- per tenant (router/tenants.py): the label set is bounded, tenants are configured;
        # the open mode's anonymous tenant is `default` ------------------------------------
        self.tenant_requests = Counter(
            p + "tenant_requests",
            "Generation requests by tenant and final HTTP status",
            ["tenant", "status"],
            registry=r,
        )
        self.tenant_prompt_tokens = Counter(
            p + "tenant_prompt_tokens",
            "Prompt tokens of answered requests, by tenant",
            ["tenant"],
            registry=r,
        )
        self.tenant_output_tokens = Counter(
            p + "tenant_output_tokens",
            "Output tokens of answered requests, by tenant",
            ["tenant"],
            registry=r,
        )
        self.tenant_block_seconds = Counter(
            p + "tenant_reserved_block_seconds",
            "Decode KV blocks reserved x seconds held, by tenant (at each release)",
            ["tenant"],
            registry=r,
        )
        self.tenant_rejections = Counter(
            p + "tenant_rejections",
            "429s by tenant and reason: lack of decode room (the reasons of rejections_total) "
            "or the tenant's limit (requests_per_minute, tokens_per_minute, max_reserved_blocks)",
            ["tenant", "reason"],
            registry=r,
        )
        self.tenant_ttft = Histogram(
            p + "tenant_ttft_seconds",
            "Time to first token, by tenant",
            ["tenant"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.tenant_tpot = Histogram(
            p + "tenant_time_per_output_token_seconds",
            "Per request: the mean inter-token latency the client saw, by tenant "
            "(as time_per_output_token_seconds)",
            ["tenant"],
            buckets=_TPOT_BUCKETS,
            registry=r,
        )
        # The fair share's view per tenant (issue 33; router/tenant_metrics.py sets them).
        self.tenant_admission_wait = Histogram(
            p + "tenant_admission_wait_seconds",
            "Time an admitted request waited in the admission queue (0: none), by tenant",
            ["tenant"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.tenant_preemptions = Counter(
            p + "tenant_preemptions",
            "Streams of the tenant preempted and resumed, by reason (as preemptions_total)",
            ["tenant", "reason"],
            registry=r,
        )
        self.tenant_decode_blocks_held = Gauge(
            p + "tenant_decode_blocks_held",
            "Decode KV blocks the tenant's admitted requests hold over the cluster, as of the "
            "last fair-share sync (vtc with admission.fair_cluster)",
            ["tenant"],
            registry=r,
        )
        self.tenant_decode_share_blocks = Gauge(
            p + "tenant_decode_share_blocks",
            "The tenant's share of the decode pool in blocks: capacity x its weight / the "
            "weights of the tenants holding or waiting (itself counted), same sync",
            ["tenant"],
            registry=r,
        )
        self.tenant_waiting = Gauge(
            p + "tenant_waiting",
            "Requests of the tenant waiting for room on any replica, same sync",
            ["tenant"],
            registry=r,
        )

        # The children a request touches (router/edge/front_door.py, router/request/).
        self.requests_by = Labelled(self.requests)  # route, status
        self.tenant_requests_by = Labelled(self.tenant_requests)  # tenant, status
        self.placements_by = Labelled(self.placements)  # prefill, decode
        self.prefill_seconds_by = Labelled(self.prefill_seconds)  # worker
        self.tenant_prompt_tokens_by = Labelled(self.tenant_prompt_tokens)
        self.tenant_output_tokens_by = Labelled(self.tenant_output_tokens)
        self.tenant_block_seconds_by = Labelled(self.tenant_block_seconds)
        self.tenant_ttft_by = Labelled(self.tenant_ttft)
        self.tenant_tpot_by = Labelled(self.tenant_tpot)
        self.tenant_admission_wait_by = Labelled(self.tenant_admission_wait)
        self.tenant_preemptions_by = Labelled(self.tenant_preemptions)  # tenant, reason

    def render(self) -> bytes:
        return generate_latest(self.registry)
