"""Elastic roles decided on the whole cluster's demand (issue 26, "cluster-wide signals"): every
replica publishes its own prefill demand to the store each role tick, the one holding the role
lease decides on the sum (router/control/role_manager.py, router/workers/role_signals.py).

- The store's demand table (`publish_demand`, `replica_demands`): memory, Redis, Redis Cluster,
  entries older than the max age dropped.
- Three router replicas on one Redis prefix in front of three simulated `both` workers: the
  prompt tokens queued through the two replicas that do not decide give the leader the same
  snapshot and the same decision as the leader queueing all of them itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from typing import Any

import pytest
from aiohttp import web

from disagg_tools.sim.worker import WorkerConfig, running_worker
from policies.base import RolePlan, RoleSnapshot
from policies.role_policies import ElasticRoles
from router.control.role_manager import ROLES
from router.workers.role_signals import ReplicaDemand, summed
from state import StateStore
from tests.app_parts import parts
from tests.conftest import MODEL, running_router
from tests.router.edge.test_admin import _settings
from tests.state.test_state_conformance import SteppedClock, clocked, prefix, redis_cluster

__all__ = ["clocked", "prefix", "redis_cluster"]

WORKERS = ("b0", "b1", "b2")


# -- the store ---------------------------------------------------------------------------------


async def test_every_replicas_demand_is_read_until_it_is_too_old(
    clocked: tuple[StateStore, SteppedClock],
) -> None:
    store, clock = clocked
    await store.publish_demand("r1", '{"a": 1}', 6.0)
    clock.advance(4.0)
    await store.publish_demand("r2", '{"a": 2}', 6.0)
    assert await store.replica_demands(6.0) == {"r1": '{"a": 1}', "r2": '{"a": 2}'}
    clock.advance(2.5)  # r1 is 6.5 s old: dropped
    assert await store.replica_demands(6.0) == {"r2": '{"a": 2}'}
    await store.publish_demand("r2", "x|y", 6.0)  # the payload is opaque, '|' included
    assert await store.replica_demands(6.0) == {"r2": "x|y"}
    clock.advance(10.0)
    assert await store.replica_demands(6.0) == {}


def test_demands_add_up_and_a_foreign_payload_is_skipped() -> None:
    a = ReplicaDemand(100.0, {"b0": 5, "b1": 1})
    b = ReplicaDemand.decode(ReplicaDemand(50.5, {"b0": 7}).encode())
    assert b == ReplicaDemand(50.5, {"b0": 7})
    assert summed([a, b]) == ReplicaDemand(150.5, {"b0": 12, "b1": 1})
    for junk in ("", "[]", '{"a": -1, "q": {}}', '{"a": "x", "q": {}}', '{"q": {}}', "{"):
        assert ReplicaDemand.decode(junk) is None, junk


# -- three replicas ----------------------------------------------------------------------------


@dataclass
class Recording:
    """The leader's policy, recording what it is asked and deciding nothing (the roles stay put,
    so both rounds of the test see the same split)."""

    inner: ElasticRoles
    name: str = "recording"
    asked: list[tuple[RoleSnapshot, RolePlan]] = field(default_factory=list)

    def decide(self, snapshot: RoleSnapshot) -> RolePlan:
        plan = self.inner.decide(snapshot)
        self.asked.append((snapshot, plan))
        return replace(plan, switches=())


@contextlib.asynccontextmanager
async def _replicas(prefix: str) -> AsyncIterator[list[web.Application]]:
    async with contextlib.AsyncExitStack() as stack:
        workers: list[dict[str, Any]] = []
        for wid in WORKERS:
            config = WorkerConfig(role="both", worker_id=wid, model=MODEL, kv_blocks=4096)
            url = await stack.enter_async_context(running_worker(config))
            workers.append(
                {"id": wid, "url": url, "role": "both", "adapter": "sim", "kv_blocks": 4096}
            )
        roles = {"interval_s": 0.1, "settle_s": 0.1}
        settings = _settings(prefix, workers, roles=roles)
        apps = [(await stack.enter_async_context(running_router(settings)))[1] for _ in "abc"]
        yield apps


async def _leader(apps: list[web.Application]) -> web.Application:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        leaders = [app for app in apps if app[ROLES].leader]
        if len(leaders) == 1:
            return leaders[0]
        await asyncio.sleep(0.05)
    raise AssertionError("no single replica holds the role lease")


def _queue(app: web.Application, tokens: int) -> None:
    parts(app).pools.workers["b0"].queued_prompt_tokens = tokens


async def _next_decision(recording: Recording) -> tuple[RoleSnapshot, RolePlan]:
    """A decision made after every replica has published at least once more."""
    seen = len(recording.asked)
    deadline = time.monotonic() + 10
    while len(recording.asked) < seen + 3:  # 3 ticks: each replica ticked since
        assert time.monotonic() < deadline, "the leader stopped deciding"
        await asyncio.sleep(0.05)
    return recording.asked[-1]


async def test_the_leader_decides_on_every_replicas_demand(redis_prefix: str) -> None:
    async with _replicas(redis_prefix) as apps:
        leader = await _leader(apps)
        others = [app for app in apps if app is not leader]
        recording = Recording(ElasticRoles(min_time_in_role_s=0.0, reverse_after_s=0.0))
        leader[ROLES].policy = recording  # type: ignore[assignment]

        # One replica takes all of it: 2M prompt tokens queued on b0 through the leader.
        _queue(leader, 2_000_000)
        alone, alone_plan = await _next_decision(recording)
        _queue(leader, 0)
        # The same demand through the two other replicas, half each; the leader has none.
        for app in others:
            _queue(app, 1_000_000)
        spread, spread_plan = await _next_decision(recording)
        assert leader[ROLES].report()["replicas_summed"] == 3

        def queued(s: RoleSnapshot) -> dict[str, int]:
            return {w.worker_id: w.queued_prompt_tokens for w in s.workers}

        assert queued(alone) == queued(spread) == {"b0": 2_000_000, "b1": 0, "b2": 0}
        assert alone.peak_queued_prompt_tokens == pytest.approx(2_000_000, rel=0.05)
        assert spread.peak_queued_prompt_tokens >= 2_000_000 * 0.95
        assert spread_plan.prefill_pressure == pytest.approx(alone_plan.prefill_pressure, rel=0.05)
        assert [(s.worker_id, s.to_role) for s in spread_plan.switches] == [
            (s.worker_id, s.to_role) for s in alone_plan.switches
        ]
        assert alone_plan.switches, alone_plan  # a deep prefill queue: a worker should move

        # A replica that stops publishing drops out within three ticks.
        for app in others:
            _queue(app, 0)
        quiet, _ = await _next_decision(recording)
        assert queued(quiet)["b0"] == 0
