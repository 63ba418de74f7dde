"""Issue 15 on real vLLM: two CPU engines started with the NIXL connector and
`"kv_role": "kv_both"` behind the router, which moves b1 from decode to prefill and back while
requests flow (docs/elastic-roles.md, "Live"). Greedy answers stay exactly a single engine's; the
engines' `prompt_tokens_by_source` counters show each phase's handoffs went the phase's way
(prefill computes, decode pulls `external_kv_transfer`).

Two engines of their own (module scope, started once for the file); b0 alone, with no
`kv_transfer_params`, is the single-engine reference. The swap keeps the decode pool non-empty
(b0 joins decode before b1 leaves it): requests arriving while no prefill is serving wait in the
admission queue, none fails."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from router.config import merged_settings, settings_from_mapping
from router.control.role_manager import ROLES
from tests.conftest import running_router
from tests.real_vllm.conftest import (
    START_TIMEOUT_S,
    RealRouter,
    VllmCluster,
    VllmServer,
    ask,
    missing_reason,
    nixl_handshake,
    reference,
    router_settings,
    unique_prompt,
    wait_for,
)

pytestmark = pytest.mark.real_vllm

TOKEN = "kv-both-admin"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture(scope="module")
def both_pair() -> Iterator[VllmCluster]:
    reason = missing_reason()
    if reason is not None:
        pytest.skip(reason)
    workdir = Path(tempfile.mkdtemp(prefix="real-vllm-both-"))
    b0, b1 = VllmServer("b0", "kv_both", workdir), VllmServer("b1", "kv_both", workdir)
    pair = VllmCluster(prefill=b0, decodes=[b1], workdir=workdir)
    t0 = time.monotonic()
    try:
        for s in pair.servers:
            s.start()
        deadline = t0 + START_TIMEOUT_S
        for s in pair.servers:
            s.wait_ready(deadline)
        # Both directions' NIXL side channels, before any test traffic.
        nixl_handshake(b0, b1, deadline)
        nixl_handshake(b1, b0, deadline)
        print(f"\nreal vLLM: kv_both pair ready in {time.monotonic() - t0:.1f} s")
        yield pair
    finally:
        pair.stop()
        shutil.rmtree(workdir, ignore_errors=True)


@contextlib.asynccontextmanager
async def _router(pair: VllmCluster, prefix: str) -> AsyncIterator[RealRouter]:
    raw = router_settings(pair, prefix)
    for w in raw["workers"]:
        w["role"] = "both"
        w["kv_blocks"] = pair.decodes[0].num_gpu_blocks()
    raw = merged_settings(
        raw,
        {
            "auth": {"admin_token": TOKEN},
            "loops": {"registry_refresh_s": 0.2},
            "roles": {"interval_s": 0.2, "settle_s": 0.5, "drain_deadline_s": 120},
            "admission": {"max_wait_s": 120},
        },
    )
    async with running_router(settings_from_mapping(raw)) as (url, app):
        yield RealRouter(url=url, app=app, cluster=pair)


async def _force(
    s: aiohttp.ClientSession, r: RealRouter, wid: str, role: str, force: bool = False
) -> None:
    body = {"role": role, "force": force}
    async with s.post(f"{r.url}/admin/workers/{wid}/role", json=body, headers=AUTH) as x:
        assert x.status == 200, await x.text()


async def _until_role(r: RealRouter, wid: str, role: str) -> None:
    pools = r.parts.pools
    await wait_for(lambda: pools.workers[wid].current_role == role, 120, f"{wid} {role}")


def _counters(pair: VllmCluster) -> dict[str, dict[str, float]]:
    return {s.name: s.prompt_tokens_by_source() for s in pair.servers}


def _delta(
    a: dict[str, dict[str, float]], b: dict[str, dict[str, float]], w: str, src: str
) -> float:
    return b[w].get(src, 0.0) - a[w].get(src, 0.0)


async def _batch(r: RealRouter, cases: list[tuple[str, str, bool]], refs: dict[str, str]) -> int:
    """Ask each case through the router; every answer must be the single engine's. Returns the
    prompt tokens sent."""
    sent = 0
    async with r.client() as client:
        answers = await asyncio.gather(
            *(ask(client, kind, prompt, 8, stream=stream) for kind, prompt, stream in cases)
        )
    for (kind, prompt, _), (text, usage) in zip(cases, answers, strict=True):
        assert text == refs[prompt], (kind, prompt)
        if usage is not None:
            sent += usage.prompt_tokens
    return sent


async def test_the_router_moves_a_kv_both_engine_decode_to_prefill_and_back(
    both_pair: VllmCluster, redis_prefix: str
) -> None:
    b0 = both_pair.prefill
    kinds = ("chat", "completions")
    phases = {
        name: [(kinds[i % 2], unique_prompt(10 + 7 * i, name), i % 2 == 0) for i in range(4)]
        for name in ("a", "flow1", "b", "flow2", "c")
    }
    refs: dict[str, str] = {}
    for cases in phases.values():
        for kind, prompt, _ in cases:
            refs[prompt] = await reference(b0, kind, prompt, 8)

    async with _router(both_pair, redis_prefix) as r, aiohttp.ClientSession() as s:
        # Phase a: b0 prefill, b1 decode. The guard counts only workers in rotation (issue 31):
        # b1 leaves the prefill pool once b0 serves there, not while b0 is on its way.
        await _force(s, r, "b0", "prefill")
        await _until_role(r, "b0", "prefill")
        await _force(s, r, "b1", "decode")
        await _until_role(r, "b1", "decode")
        before = _counters(both_pair)
        sent = await _batch(r, phases["a"], refs)
        after = _counters(both_pair)
        assert sent > 0
        assert _delta(before, after, "b1", "external_kv_transfer") == sent
        assert _delta(before, after, "b0", "external_kv_transfer") == 0
        assert _delta(before, after, "b1", "local_compute") == 0

        # The swap, requests flowing: b0 heads to decode, b1 to prefill. Each switch empties
        # a pool for a while (the admin API's guard counts no worker on its way: forced); with
        # both on their way, every pool refills by itself and requests wait for room meanwhile.
        await _force(s, r, "b0", "decode", force=True)
        await _force(s, r, "b1", "prefill", force=True)
        flow = asyncio.create_task(_batch(r, phases["flow1"], refs))
        await _until_role(r, "b0", "decode")
        await _until_role(r, "b1", "prefill")
        await flow

        # Phase b: the handoffs go the new way, b1 -> b0.
        before = _counters(both_pair)
        sent = await _batch(r, phases["b"], refs)
        after = _counters(both_pair)
        assert _delta(before, after, "b0", "external_kv_transfer") == sent
        assert _delta(before, after, "b1", "external_kv_transfer") == 0
        assert _delta(before, after, "b0", "local_compute") == 0

        # And back, requests flowing: b1 heads to decode again, b0 to prefill.
        await _force(s, r, "b1", "decode", force=True)
        await _force(s, r, "b0", "prefill", force=True)
        flow = asyncio.create_task(_batch(r, phases["flow2"], refs))
        await _until_role(r, "b1", "decode")
        await _until_role(r, "b0", "prefill")
        await flow

        before = _counters(both_pair)
        sent = await _batch(r, phases["c"], refs)
        after = _counters(both_pair)
        assert _delta(before, after, "b1", "external_kv_transfer") == sent
        assert _delta(before, after, "b0", "external_kv_transfer") == 0

        events: list[dict[str, Any]] = r.app[ROLES].report()["events"]
        drained = [(e["worker"], e["to"]) for e in events if e["trigger"] == "drained"]
        # The last swap's two drains end in either order (both switches started together).
        assert ("b1", "prefill") in drained and ("b0", "prefill") in drained[-2:]
        store = r.parts.store

        async def nothing_held() -> Any:
            # The last answers' releases and unstrands may still be on their way (background
            # jobs once the client has its answer): wait for them, then nothing may be left.
            usage = await store.decode_usage(["b0", "b1"])
            stranded = await store.stranded_bytes(["b0", "b1"])
            held = {w: u.reservations for w, u in usage.items()}, stranded
            return True if held == ({"b0": 0, "b1": 0}, {"b0": 0, "b1": 0}) else held

        await wait_for(nothing_held, 10, "no reservation and no stranded KV left")
