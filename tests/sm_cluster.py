"""The small cluster the reservation state machine drives (tests/system/test_state_machine.py).

Everything runs on one asyncio loop in a thread of its own (`LoopThread`), so the machine's
synchronous rules hand it coroutines and the cluster keeps streaming between steps:

- a private `redis-server` (tests/redis_server.py) that can be SIGKILLed and restarted empty;
- simulated workers (disagg_tools/sim/), each stoppable and restartable on its own port;
- router replicas in process, sharing the store; a replica is killed abruptly by making its
  store unreachable first (every call raises, as a dead process's would never arrive), then
  tearing it down: nothing it held is released, its reservations must expire by lease.

Each replica's store is wrapped by a `Tracker`, which records the store calls in flight (sent,
answer not yet seen by the router) and every reservation made. That is what makes the
invariants exact: the snapshot (tests/sm_invariants.py) reads Redis with a *blocking* client
from inside the loop, so no router code runs while it reads, and the only difference between
the store and the routers' view is the calls the tracker lists as in flight.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import inspect
import itertools
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, TypeVar

from aiohttp import web

from disagg_tools.sim.worker import WorkerConfig, running_worker
from router.config import settings_from_mapping
from router.edge.app import create_app
from router.edge.server import RouterRunner, serving
from router.logs import REQUEST_ID
from state.base import StoreError
from tests.app_parts import AppParts
from tests.conftest import MODEL
from tests.redis_server import PrivateRedis
from tests.sm_tenants import TENANTS, PreemptionWatch, QuotaWatch

__all__ = ["Cluster", "LoopThread", "RidInfo", "Tracker", "TOKEN"]

T = TypeVar("T")
TOKEN = "sm-admin-token"
LEASE_S = 3.0  # reservation lease: a killed replica's room comes back within it
TIME_SCALE = 20.0
BLOCK = 16
# The store calls whose effect on reservations or the ledger the router learns from their
# answer: in flight, the store may be ahead of the router's view.
TRACKED = ("reserve", "renew_many", "renew", "resize", "finish", "release", "strand", "unstrand")
STORE_CALLS = (
    *TRACKED,
    "set_capacity",
    "decode_usage",
    "mark_ready",
    "stranded_bytes",
    "reap_stranded",
    "note_request",
    "try_retry",
    "record_output",
    "output_histograms",
    "register_worker",
    "unregister_worker",
    "registered_workers",
    "set_drained",
    "drained_workers",
    "worker_roles",
    "set_role",
    "forget_role",
    "hold_lease",
    "release_lease",
    "check_marker",
    "ping",
    "registry_view",
    "usage_view",
    "take_quota",
    "resize_quota_hold",
    "settle_quota",
    "renew_quota_holds",
    "tenant_keys",
    "restore_tenant_keys",
    "restore_registry",
    "registry_and_usage_view",
    "publish_demand",
    "replica_demands",
    "drain_marks",
)


class LoopThread:
    """An event loop running in a daemon thread; `run` waits for a coroutine's result."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 60.0) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()


class ErrorLog(logging.Handler):
    """Every ERROR the router logs (an unhandled error's traceback among them): a violation.
    The last warnings are kept for the report of one."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[str] = []
        self.warnings: collections.deque[str] = collections.deque(maxlen=20)

    def emit(self, record: logging.LogRecord) -> None:
        line = self.format(record)
        if record.levelno >= logging.ERROR:
            self.records.append(line)
        else:
            self.warnings.append(f"{record.created:.3f} {line}")


@dataclass
class RidInfo:
    replica: int
    worker: str
    initial: int  # blocks held by the reserve
    request_id: str | None


@dataclass
class Tracker:
    """Store calls in flight and every reservation made, across replicas."""

    inflight: dict[int, tuple[int, str, frozenset[str]]] = field(default_factory=dict)
    rids: dict[str, RidInfo] = field(default_factory=dict)
    # id -> the tracked calls that touched it: (call, replica, start, end, outcome); for the
    # report of a violation
    history: dict[str, list[tuple[str, int, float, float, str]]] = field(default_factory=dict)
    # ids a renewal put back after the store lost them (a reset, a deleted worker's keys):
    # held again over capacity if need be, on top of whatever took their room meanwhile
    put_back: set[str] = field(default_factory=set)
    # id -> its blocks as last known (reserved, resized); id -> the blocks forced resizes added
    # past what the store could give (issue 31: growth with no room preempts first; what is
    # still forced is the only room a worker may be reserved past its capacity by)
    sizes: dict[str, int] = field(default_factory=dict)
    forced: dict[str, int] = field(default_factory=dict)
    _seq: itertools.count[int] = field(default_factory=itertools.count)

    def wrap(self, store: Any, replica: int) -> None:
        for name in TRACKED:
            real = getattr(store, name)
            setattr(store, name, self._wrapped(name, real, replica))

    def _wrapped(
        self, name: str, real: Callable[..., Awaitable[Any]], replica: int
    ) -> Callable[..., Awaitable[Any]]:
        sig = inspect.signature(real)

        async def call(*args: Any, **kwargs: Any) -> Any:
            bound = sig.bind(*args, **kwargs).arguments
            worker, rids = _touched(name, bound)
            key = next(self._seq)
            self.inflight[key] = (replica, worker, rids)
            if name == "resize" and bound.get("force"):
                rid = bound["reservation_id"]
                delta = bound["blocks"] - self.sizes.get(rid, 0)
                # Counted before the call: it may land whatever the router hears.
                self.forced[rid] = self.forced.get(rid, 0) + max(0, delta)
            start, outcome = time.time(), "cancelled"
            try:
                result = await real(*args, **kwargs)
                outcome = repr(result)[:60]
            except Exception as exc:
                outcome = repr(exc)[:60]
                raise
            finally:
                # Still in flight for a moment: a call awaited through asyncio.gather (the
                # renewals) reaches its caller a few loop iterations after it returns here.
                asyncio.get_running_loop().call_later(0.05, self.inflight.pop, key, None)
                for rid in rids:
                    self.history.setdefault(rid, []).append(
                        (name, replica, start, time.time(), outcome)
                    )
            if name == "renew_many":
                self.put_back.update(result)
            if name == "reserve" and result:
                rid = bound["reservation_id"]
                self.rids[rid] = RidInfo(replica, worker, bound["blocks"], REQUEST_ID.get())
                self.sizes[rid] = bound["blocks"]
            if name == "resize" and result:
                self.sizes[bound["reservation_id"]] = bound["blocks"]
            return result

        return call

    def inflight_rids(self) -> set[str]:
        return {rid for _, _, rids in self.inflight.values() for rid in rids}


def _touched(name: str, a: dict[str, Any]) -> tuple[str, frozenset[str]]:
    """(worker, reservation or ledger ids) a tracked call may change."""
    if name in ("reserve", "renew", "resize", "release"):
        rids = {a["reservation_id"]}
        intent = a.get("intent")
        if intent is not None:
            rids.add(intent.request_id)
        return a["worker_id"], frozenset(rids)
    if name == "renew_many":
        return a["worker_id"], frozenset(a["reservations"])
    if name in ("strand", "unstrand"):
        return a["prefill_id"], frozenset({a["request_id"]})
    ids = {step[1] for step in (a.get("release"), a.get("unstrand")) if step is not None}
    return "", frozenset(ids)


@dataclass
class Worker:
    config: WorkerConfig
    stack: contextlib.AsyncExitStack | None = None
    url: str = ""

    @property
    def up(self) -> bool:
        return self.stack is not None

    async def start(self) -> None:
        self.stack = contextlib.AsyncExitStack()
        self.url = await self.stack.enter_async_context(running_worker(self.config))
        if self.config.port == 0:  # the same port on every restart: the router knows it
            port = int(self.url.rsplit(":", 1)[1])
            self.config = WorkerConfig(**{**_fields(self.config), "port": port})

    async def stop(self) -> None:
        stack, self.stack = self.stack, None
        if stack is not None:
            await stack.aclose()


def _fields(cfg: WorkerConfig) -> dict[str, Any]:
    return {f: getattr(cfg, f) for f in cfg.__dataclass_fields__}


@dataclass
class Replica:
    index: int
    app: web.Application
    url: str
    stack: contextlib.AsyncExitStack
    alive: bool = True

    @property
    def parts(self) -> AppParts:
        return AppParts(self.app)


def _worker_config(role: str, wid: str, kv_blocks: int) -> WorkerConfig:
    return WorkerConfig(
        role=role,
        worker_id=wid,
        model=MODEL,
        kv_blocks=kv_blocks,
        time_scale=TIME_SCALE,
        kv_lease_s=30.0 * TIME_SCALE,
        mean_output_tokens=48,
    )


@dataclass
class Cluster:
    """p0, p1 prefill; d0, d1 decode; b0 `both` (decode at first); r0 a decode worker the
    machine registers and deletes through the admin API."""

    decode_blocks: int = 400
    redis: PrivateRedis = field(default_factory=PrivateRedis)
    tracker: Tracker = field(default_factory=Tracker)
    workers: dict[str, Worker] = field(default_factory=dict)
    replicas: list[Replica] = field(default_factory=list)
    # reservation id -> the time its lease must have ended by (its replica was killed)
    orphans: dict[str, float] = field(default_factory=dict)
    reset_until: float = 0.0  # a Redis restarted empty: the routers put back by then
    # A deleted worker's keys go with it (state/ unregister_worker), live reservations too:
    # the streams still on it have theirs put back by the next renewal tick (<= 1 s).
    deleted_until: dict[str, float] = field(default_factory=dict)
    redis_up: bool = True
    errors: ErrorLog = field(default_factory=ErrorLog)
    preemptions: PreemptionWatch = field(default_factory=PreemptionWatch)
    quotas: QuotaWatch = field(init=False)

    def __post_init__(self) -> None:
        self.quotas = QuotaWatch(self.tracker, self.preemptions)

    CONFIGURED = (("prefill", "p0"), ("prefill", "p1"), ("decode", "d0"), ("decode", "d1"))

    async def start(self) -> None:
        logging.getLogger("router").addHandler(self.errors)
        self.redis.start()
        for role, wid in (*self.CONFIGURED, ("both", "b0"), ("decode", "r0")):
            blocks = self.decode_blocks if role != "prefill" else 4096
            self.workers[wid] = Worker(_worker_config(role, wid, blocks))
            await self.workers[wid].start()
        for _ in range(2):
            await self.start_replica()

    def entry(self, wid: str) -> dict[str, Any]:
        w = self.workers[wid]
        entry: dict[str, Any] = {"id": wid, "url": w.url, "role": w.config.role, "adapter": "sim"}
        if w.config.role != "prefill":
            entry["kv_blocks"] = w.config.kv_blocks
        return entry

    def settings(self) -> Any:
        workers = [self.entry(wid) for _, wid in self.CONFIGURED] + [self.entry("b0")]
        return settings_from_mapping(
            {
                "model": MODEL,
                "perf": {"model": MODEL, "gpu": "h100"},
                "store": {"url": self.redis.url, "key_prefix": "dr:", "pool_timeout_s": 1.0},
                "workers": workers,
                "auth": {"admin_token": TOKEN},
                # Requests come with a tenant's key (tests/sm_tenants.py); preemption is on
                # (the default). Estimates learn from a few answers, so a burst poisons them.
                "tenants": TENANTS,
                "estimates": {"estimator_args": {"min_samples": 4}},
                "leases": {"reservation_s": LEASE_S, "kv_s": 2.0},
                "loops": {
                    "stranded_reap_s": 0.25,
                    "health_interval_s": 0.2,
                    "health_idle_interval_s": 0.2,
                    "health_timeout_s": 1.0,
                    "state_refresh_s": 0.05,
                    "registry_refresh_s": 0.2,
                    "histogram_refresh_s": 0.2,
                    "load_poll_s": 0,
                },
                "server": {"shutdown_grace_s": 0.5},
                # A small queue, so the tenants' shares of it (router/admission.py) get a say.
                "admission": {"max_wait_s": 1.0, "max_waiters": 12},
                "timeouts": {
                    "prefill_s": 3.0,
                    "ttft_s": 4.0,
                    "idle_s": 2.0,
                    "connect_s": 1.0,
                    "client_stall_s": 4.0,
                },
                "retry": {"backoff_base_s": 0.005, "backoff_max_s": 0.02},
                "breaker": {"cooldown_s": 0.5},
                "roles": {"interval_s": 0.2, "settle_s": 0.3, "drain_deadline_s": 1.5},
            }
        )

    async def start_replica(self) -> Replica:
        stack = contextlib.AsyncExitStack()
        settings = self.settings()
        app = create_app(settings)
        runner = await stack.enter_async_context(
            serving(app, "127.0.0.1", 0, settings.timeouts, shutdown_timeout=1.0)
        )
        assert isinstance(runner, RouterRunner)
        replica = Replica(
            len(self.replicas), app, f"http://127.0.0.1:{runner.addresses[0][1]}", stack
        )
        self.tracker.wrap(replica.parts.store, replica.index)
        self.quotas.wrap(replica.parts.store, replica.index)
        self.preemptions.wrap(replica.parts, replica.index)
        self.replicas.append(replica)
        return replica

    @property
    def alive(self) -> list[Replica]:
        return [r for r in self.replicas if r.alive]

    async def kill_replica(self, replica: Replica) -> None:
        """As a SIGKILL would: from now on nothing this replica does reaches the store."""
        replica.alive = False
        store = replica.parts.store

        async def unreachable(*args: Any, **kwargs: Any) -> Any:
            raise StoreError("this replica was killed")

        for name in STORE_CALLS:
            setattr(store, name, unreachable)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(replica.stack.aclose(), 15.0)
        # Every lease it renewed ends one lease after its last renewal, which was before now.
        # Any id it touched: a reserve cancelled by the kill may have landed all the same.
        gone = time.time() + LEASE_S + 0.25
        for rid, calls in self.tracker.history.items():
            if any(rep == replica.index for _, rep, _, _, _ in calls):
                self.orphans[rid] = gone

    async def kill_redis(self) -> None:
        self.redis_up = False
        self.redis.kill()

    async def restart_redis(self) -> None:
        self.redis.start()  # empty
        self.redis_up = True
        # The routers see the reset within a registry refresh and put back what they hold;
        # renewals put back any that raced it within a renewal tick.
        self.reset_until = time.time() + 3.0

    async def close(self) -> None:
        for r in self.alive:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(r.stack.aclose(), 20.0)
            r.alive = False
        for w in self.workers.values():
            await w.stop()
        self.redis.kill()
        logging.getLogger("router").removeHandler(self.errors)
