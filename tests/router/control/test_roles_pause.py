"""The reconfiguration pause, timed live (issue 26): a drained `both` worker stays out of both
pools for its engine kind's pause (`roles.reconfig_pause_s`, policies/role_pauses.py) before it
serves its new role; the policy is told the same number."""

from __future__ import annotations

import time

import aiohttp
import pytest

from disagg_tools.sim.worker import WorkerConfig, running_worker
from policies.role_pauses import ENGINE_RECONFIG_PAUSE_S, reconfig_pauses
from router.config import RoleSettings
from router.control.role_manager import ROLES
from router.workers.role_signals import QueuePeak, role_snapshot
from tests.app_parts import parts
from tests.conftest import MODEL, running_router
from tests.router.edge.test_admin import TOKEN, _settings

AUTH = {"Authorization": f"Bearer {TOKEN}"}
PAUSE_S = 1.0
SETTLE_S = 0.2


def test_the_pause_table_by_engine_kind() -> None:
    assert reconfig_pauses(None) == dict(ENGINE_RECONFIG_PAUSE_S)
    assert set(reconfig_pauses(3).values()) == {3.0}
    table = reconfig_pauses({"sim": 1.5})
    assert table["sim"] == 1.5 and table["sglang"] == ENGINE_RECONFIG_PAUSE_S["sglang"]
    assert RoleSettings(reconfig_pause_s={"sim": 1.5}).pause_for("sim") == 1.5
    assert RoleSettings().pause_for("vllm") == 0.0  # kv_both: nothing restarts
    for bad in (-1, float("nan"), "2", {"sim": -0.5}, True):
        with pytest.raises(ValueError):
            RoleSettings(reconfig_pause_s=bad)  # type: ignore[arg-type]


async def test_a_drained_worker_waits_out_its_engines_pause(redis_prefix: str) -> None:
    async with (
        running_worker(
            WorkerConfig(role="both", worker_id="b0", model=MODEL, kv_blocks=4096)
        ) as u0,
        running_worker(
            WorkerConfig(role="both", worker_id="b1", model=MODEL, kv_blocks=4096)
        ) as u1,
    ):
        workers = [
            {"id": wid, "url": url, "role": "both", "adapter": "sim", "kv_blocks": 4096}
            for wid, url in (("b0", u0), ("b1", u1))
        ]
        roles = {"interval_s": 0.05, "settle_s": SETTLE_S, "reconfig_pause_s": {"sim": PAUSE_S}}
        settings = _settings(redis_prefix, workers, roles=roles)
        async with running_router(settings) as (url, app), aiohttp.ClientSession() as s:
            manager = app[ROLES]
            # The policy is told the same pause.
            snapshot = role_snapshot(
                parts(app).pools.workers.values(), parts(app).settings,
                arriving_tokens_per_s=0.0, peak=QueuePeak(1.0), recent_switches_s=(),
            )  # fmt: skip
            assert snapshot.reconfig_pause_s == PAUSE_S
            started = time.monotonic()
            body = {"role": "prefill"}
            async with s.post(f"{url}/admin/workers/b1/role", json=body, headers=AUTH) as r:
                assert r.status == 200, await r.text()
            draining_seen = 0.0
            while time.monotonic() - started < 15:
                w = parts(app).pools.workers["b1"]
                if w.current_role == "prefill":
                    break
                if w.current_role == "draining-to-prefill":
                    draining_seen = time.monotonic() - started
                    # In neither pool meanwhile: no placement can land on it.
                    pools = parts(app).pools
                    assert "b1" not in {x.spec.id for x in pools.members.prefill_workers}
                    assert "b1" not in {x.spec.id for x in pools.members.decode_workers}
                await _sleep()
            elapsed = time.monotonic() - started
            assert parts(app).pools.workers["b1"].current_role == "prefill"
            # Settle, then the pause: never sooner (nothing was held, so the drain ended at
            # the settle).
            assert elapsed >= SETTLE_S + PAUSE_S, elapsed
            assert draining_seen >= SETTLE_S + PAUSE_S * 0.8, draining_seen
            drained = [e for e in manager.events if e.trigger == "drained"]
            assert drained and "paused" in drained[-1].reason, manager.events


async def _sleep() -> None:
    import asyncio

    await asyncio.sleep(0.02)
