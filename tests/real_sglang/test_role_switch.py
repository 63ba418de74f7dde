"""Issues 23 and 26: the role manager drives SGLang's runtime role switch on a real engine. d1 is
started as a decode with `--enable-pd-role-switch` and registered as `both`; under streaming
traffic through the official openai client it is moved decode -> prefill (drained, then
`POST /pd_role_switch`, then prefills are placed on it, its KV pulled by d0) and back. Every
greedy answer equals one plain SGLang server's; nothing stays reserved."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import pytest

from router.config import settings_from_mapping
from router.control.role_manager import ROLES
from tests.app_parts import parts
from tests.conftest import running_router
from tests.real_sglang.conftest import (
    SglangCluster,
    SglangRouter,
    router_settings,
    server_info,
    unique_prompt,
)
from tests.real_sglang.test_failures import nothing_reserved
from tests.real_sglang.test_outputs import ask, reference_client
from tests.router.control.test_roles_live import _placements

pytestmark = pytest.mark.real_sglang

MAX_TOKENS = 32
SWITCH_TIMEOUT_S = 300.0  # a drain, a rebuild on 2 loaded cores, the probes that read it


def serving(info: dict[str, Any]) -> str:
    """The role SGLang's scheduler serves now (its top-level args keep the start-up one)."""
    mode: str = info["internal_states"][0]["disaggregation_mode"]
    return mode


async def until(cond: Callable[[], bool], what: str, timeout_s: float = SWITCH_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"never within {timeout_s:.0f} s: {what}")
        await asyncio.sleep(0.1)


class Traffic:
    """Greedy streams over a fixed set of prompts, two at a time, each checked against the
    plain server's answer."""

    def __init__(self, router: SglangRouter, want: dict[str, str]) -> None:
        self.client = router.client()
        self.want = want
        self.done = 0
        self.failures: list[str] = []
        self._stop = asyncio.Event()

    async def _one(self, prompt: str) -> None:
        try:
            got, _ = await ask(self.client, "chat", prompt, stream=True, max_tokens=MAX_TOKENS)
        except Exception as exc:  # recorded, asserted on by the test
            self.failures.append(f"{prompt!r}: {exc!r}")
            return
        if got != self.want[prompt]:
            self.failures.append(f"{prompt!r}: {got!r} != {self.want[prompt]!r}")
        self.done += 1

    async def flow(self) -> None:
        prompts = list(self.want)
        i = 0
        while not self._stop.is_set():
            await asyncio.gather(*(self._one(prompts[(i + k) % len(prompts)]) for k in (0, 1)))
            i += 2

    async def stop(self, flow: asyncio.Task[None]) -> None:
        self._stop.set()
        await flow
        await self.client.close()


async def test_a_decode_engine_switched_to_prefill_and_back_under_traffic(
    sglang_cluster: SglangCluster, redis_prefix: str
) -> None:
    cluster = sglang_cluster
    cluster.ensure_running()
    d1 = cluster.decodes[1]
    assert d1.role_switch and server_info(d1)["enable_pd_role_switch"] is True
    raw = router_settings(
        cluster,
        redis_prefix,
        roles={"interval_s": 0.2, "settle_s": 0.5, "drain_deadline_s": 10.0},
    )
    for w in raw["workers"]:
        if w["id"] == d1.name:
            w["role"] = "both"  # one engine, one role at a time: the router switches it
    prompts = [unique_prompt(16) for _ in range(6)]
    async with reference_client(cluster.ref) as ref:
        want = {
            p: (await ask(ref, "chat", p, stream=False, max_tokens=MAX_TOKENS))[0] for p in prompts
        }

    async with running_router(settings_from_mapping(raw)) as (url, app):
        router = SglangRouter(url=url, app=app, cluster=cluster)
        worker = parts(app).pools.workers[d1.name]
        manager = app[ROLES]
        await until(lambda: worker.available and worker.current_role == "decode", "d1 decode")
        traffic = Traffic(router, want)
        flow = asyncio.create_task(traffic.flow())
        try:
            await until(lambda: traffic.done >= 4, "traffic flows")
            await until(lambda: _placements([app], decode=d1.name) > 0, "decodes on d1")

            # decode -> prefill: drained, the engine switched, then prefills placed on it.
            t0 = time.monotonic()
            await manager.force(d1.name, "prefill")
            await until(lambda: worker.current_role == "prefill", "d1 serves prefill")
            print(f"\nd1 decode -> prefill: {time.monotonic() - t0:.2f} s")
            assert serving(server_info(d1)) == "prefill"
            assert server_info(d1)["disaggregation_mode"] == "decode"  # the start-up args
            decodes_on_d1 = _placements([app], decode=d1.name)
            await until(lambda: _placements([app], prefill=d1.name) > 0, "prefills on d1")
            done = traffic.done
            await until(lambda: traffic.done >= done + 4, "traffic with d1 as a prefill")
            assert _placements([app], decode=d1.name) == decodes_on_d1

            # And back: prefill -> decode.
            t0 = time.monotonic()
            await manager.force(d1.name, "decode")
            await until(lambda: worker.current_role == "decode", "d1 serves decode again")
            print(f"d1 prefill -> decode: {time.monotonic() - t0:.2f} s")
            assert serving(server_info(d1)) == "decode"
            await until(
                lambda: _placements([app], decode=d1.name) > decodes_on_d1, "decodes on d1 again"
            )
            done = traffic.done
            await until(lambda: traffic.done >= done + 4, "traffic with d1 as a decode")
        finally:
            await traffic.stop(flow)
        metrics = parts(app).metrics.registry
        for role in ("prefill", "decode"):
            labels = {"worker": d1.name, "to_role": role, "outcome": "ok"}
            assert (
                metrics.get_sample_value("disagg_router_role_engine_switches_total", labels) == 1
            ), manager.report()
        assert traffic.failures == []
        assert traffic.done >= 12
        await nothing_reserved(router)
