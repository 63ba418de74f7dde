"""The state of one simulated worker, reached by every handler through `app[WORKER]`."""

from __future__ import annotations

import asyncio
import time
from collections import deque
from typing import Any

import aiohttp
from aiohttp import web

from policies.costmodel import perf_model

from .decode_engine import BlockPool, DecodeEngine, KvLedger, PrefillQueue
from .faults import FaultState
from .kv_events import KvEventPublisher, SimPrefixCache, load_tokenizer
from .lora import LoraState
from .rooms import RoomTable
from .sim_metrics import SimMetrics
from .worker_config import WorkerConfig

__all__ = ["Worker", "WORKER", "RECENT_REQUESTS"]

RECENT_REQUESTS = 256


class Worker:
    """Everything one simulated worker holds; one per app, reached through `app[WORKER]`."""

    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        # The role served now: config.role until POST /pd_role_switch flips it (sim.role_switch).
        # Everything deciding how to serve reads this, never config.role.
        self.role: str = config.role
        # A flip's teardown/rebuild is running; a failed one left the instance unhealthy.
        self.role_switching = False
        self.role_switch_unhealthy = False
        self.perf = perf_model(
            config.model, config.gpu, config.tp_size, block_size=config.block_size
        )
        self.max_model_len = config.max_model_len or self.perf.model.max_model_len
        self.faults = FaultState(config.faults)
        self.pool = BlockPool(config.kv_blocks or self.perf.kv_capacity_blocks)
        self.prefill = PrefillQueue(self.perf, self.time_factor)
        self.metrics = SimMetrics(
            config.model_name,
            running=lambda: self.engine.running + self.prefill.running,
            waiting=lambda: self.prefill.waiting + self.engine.preempted,
            kv_usage=lambda: self.pool.used / self.pool.capacity,
        )
        self.metrics.export_cache_config(self.pool.capacity, config.block_size)
        self.engine = DecodeEngine(
            self.perf, self.pool, self.metrics, self.time_factor, config.block_size
        )
        self.ledger = KvLedger(self.pool, config.engine_id, time.monotonic, self.metrics)
        self.recent: deque[dict[str, Any]] = deque(maxlen=RECENT_REQUESTS)
        self.inflight: dict[asyncio.Task[Any], web.Request] = {}
        self.inflight_changed = asyncio.Event()
        self.session: aiohttp.ClientSession | None = None
        self.loras = LoraState(config.lora, config.model_name, self.time_factor)  # sim.lora
        self.rooms = RoomTable()  # SGLang PD: prefilled KV by bootstrap_room (sim.bootstrap)
        self.bootstrap_port: int | None = None  # bound port of the bootstrap listener, if any
        # The prefix cache and its KV events, when an endpoint is configured (sim.kv_events).
        self.kv_events: SimPrefixCache | None = (
            SimPrefixCache(
                self.pool.capacity,
                config.block_size,
                KvEventPublisher(config.kv_events_endpoint, config.kv_events_replay_endpoint),
                load_tokenizer(config.tokenizer) if config.tokenizer else None,
            )
            if config.kv_events_endpoint
            else None
        )

    def time_factor(self) -> float:
        """Real seconds per simulated second, including an injected slowdown."""
        return self.faults.slow_factor / self.config.time_scale

    @property
    def lease_s(self) -> float:
        return self.config.kv_lease_s / self.config.time_scale

    def state(self) -> dict[str, Any]:
        self.ledger.reap()
        return {
            "worker_id": self.config.name,
            "role": self.role,
            "role_switching": self.role_switching,
            "role_switch_unhealthy": self.role_switch_unhealthy,
            "engine_id": self.config.engine_id,
            "model": self.config.model_name,
            "block_size": self.config.block_size,
            "capacity_blocks": self.pool.capacity,
            "blocks_in_use": self.pool.used,
            "resident_sequences": self.engine.running,
            "preempted_sequences": self.engine.preempted,
            "waiting_prefills": self.prefill.waiting,
            "running_prefills": self.prefill.running,
            "queued_prefill_tokens": self.prefill.queued_tokens,
            "pending_kv": self.ledger.describe(),
            "bootstrap_rooms": len(self.rooms),
            "inflight_requests": len(self.inflight),
            "counters": dict(self.metrics.counts),
            "faults": self.faults.snapshot(),
            "lora": self.loras.describe(),
        }

    def __repr__(self) -> str:
        return f"Worker({self.config.name!r}, {self.pool}, {self.engine}, {self.ledger})"


WORKER = web.AppKey("sim_worker", Worker)
