"""Per-tenant metrics of the fair share (issue 33; router/tenant_metrics.py): blocks held against
the share and requests waiting, from the cluster's fair share; admission waits by tenant; the
fair-share preemption series made at 0; labels bounded to the configured tenants, `default`
and `other`.

The live test runs a simulated cluster behind one router with Redis, `vtc` and two tenants of
weights 1 and 3, called with the official `openai` client, and reads /metrics."""

from __future__ import annotations

import asyncio
import re
from typing import Any

import aiohttp
from openai import AsyncOpenAI

from policies.fair_share import ClusterWaiter, Occupancy
from router.admission import Admission, AdmissionSettings
from router.metrics import RouterMetrics
from router.tenant_metrics import ShareGauges, TenantWaits
from tests.conftest import MODEL, sim_cluster


def _sample(text: str, name: str, **labels: str) -> float | None:
    """One sample of a /metrics text; None when absent."""
    want = sorted(f'{k}="{v}"' for k, v in labels.items())
    for line in text.splitlines():
        m = re.match(r"^(\w+)\{([^}]*)\} (\S+)$", line)
        if m and m[1] == name and sorted(m[2].split(",")) == want:
            return float(m[3])
    return None


def _text(metrics: RouterMetrics) -> str:
    return metrics.render().decode()


def test_share_gauges_bound_their_labels_and_reset_to_zero() -> None:
    metrics = RouterMetrics()
    gauges = ShareGauges(metrics, ["a", "b"])
    occupancy = Occupancy(400, {"a": 30, "b": 250, "stranger": 7}, {"a": 1, "b": 3}, frozenset())
    occupancy = Occupancy(400, occupancy.held, occupancy.weights, frozenset({"a", "b"}))
    waiters = [
        ClusterWaiter("r1", 0, "a", 0.0, 2, 0.3),
        ClusterWaiter("r2", 0, "a", 0.0, 1, 0.1),
        ClusterWaiter("r2", 0, "elsewhere", 0.0, 4, 0.1),
    ]
    gauges.update(occupancy, waiters)
    text = _text(metrics)
    held, share = (
        "disagg_router_tenant_decode_blocks_held",
        "disagg_router_tenant_decode_share_blocks",
    )
    waiting = "disagg_router_tenant_waiting"
    assert _sample(text, held, tenant="a") == 30 and _sample(text, held, tenant="b") == 250
    assert _sample(text, share, tenant="a") == 100 and _sample(text, share, tenant="b") == 300
    assert _sample(text, waiting, tenant="a") == 3 and _sample(text, waiting, tenant="b") == 0
    # Names this replica does not know are one label, `other`; `default` is always there.
    assert _sample(text, held, tenant="other") == 7 and _sample(text, waiting, tenant="other") == 4
    assert _sample(text, held, tenant="default") == 0
    assert _sample(text, held, tenant="stranger") is None
    assert _sample(text, waiting, tenant="elsewhere") is None

    # Once nothing is held or waits, every label goes back to 0 (none is left at its last value).
    gauges.update(Occupancy(400, {}, {"a": 1, "b": 3}, frozenset()), [])
    text = _text(metrics)
    for tenant in ("a", "b", "other", "default"):
        assert _sample(text, held, tenant=tenant) == 0, tenant
        assert _sample(text, waiting, tenant=tenant) == 0, tenant
    # With no one active, a tenant's share is the whole pool (itself counted).
    assert _sample(text, share, tenant="a") == 400


def test_share_gauges_update_at_most_once_a_period_unless_quiet() -> None:
    now = [0.0]
    metrics = RouterMetrics()
    gauges = ShareGauges(metrics, ["a"], period_s=1.0, clock=lambda: now[0])
    held = "disagg_router_tenant_decode_blocks_held"

    def busy(blocks: int) -> None:
        gauges.update(Occupancy(100, {"a": blocks}, {}, frozenset({"a"})), [])

    busy(10)
    now[0] = 0.5
    busy(20)  # within the period: skipped
    assert _sample(_text(metrics), held, tenant="a") == 10
    now[0] = 1.0
    busy(30)
    assert _sample(_text(metrics), held, tenant="a") == 30
    now[0] = 1.2
    gauges.update(Occupancy(100, {}, {}, frozenset()), [])  # quiet: shown at once
    assert _sample(_text(metrics), held, tenant="a") == 0


async def test_admission_waits_are_observed_by_tenant() -> None:
    """A request admitted at once is observed at 0 s; one that waited, at its wait."""
    from policies.base import AdmissionCost, Tenant, WaitingRequest
    from policies.fairness import VTCFairness

    now = [100.0]
    metrics = RouterMetrics()
    adm = Admission(AdmissionSettings(fairness="vtc"), VTCFairness(), clock=lambda: now[0])
    adm.wait_observer = TenantWaits(metrics)
    a, b = Tenant("a", 1.0), Tenant("b", 3.0)
    cost = AdmissionCost(10.0, 5)
    adm.admitted(WaitingRequest(adm.ticket(), a, 0, cost))
    ticket = adm.ticket()
    loop = asyncio.get_running_loop()
    waiter = asyncio.create_task(
        adm.wait(0, ticket, loop.time() + 30, WaitingRequest(ticket, b, 0, cost))
    )
    await asyncio.sleep(0)
    now[0] += 2.5
    adm.notify()
    assert await waiter >= 1
    adm.admitted(WaitingRequest(ticket, b, 0, cost))
    text = _text(metrics)
    name = "disagg_router_tenant_admission_wait_seconds"
    assert _sample(text, name + "_count", tenant="a") == 1
    assert _sample(text, name + "_sum", tenant="a") == 0
    assert _sample(text, name + "_count", tenant="b") == 1
    assert _sample(text, name + "_sum", tenant="b") == 2.5
    assert _sample(text, name + "_bucket", tenant="b", le="2.0") == 0
    assert _sample(text, name + "_bucket", tenant="b", le="5.0") == 1


# -- live -------------------------------------------------------------------------------------

KEYS = {"a": "sk-metrics-a-5e0c7b2d9f4a1386", "b": "sk-metrics-b-0d9c3e7a1b5f8246"}


async def _answer(url: str, tenant: str, max_tokens: int) -> str:
    async with AsyncOpenAI(
        base_url=url + "/v1", api_key=KEYS[tenant], max_retries=0, timeout=60
    ) as client:
        resp = await client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": f"{tenant} asks"}],
            max_tokens=max_tokens,
            extra_headers={"X-Sim-Output-Tokens": str(max_tokens)},
        )
    return resp.choices[0].message.content or ""


async def _scrape(session: aiohttp.ClientSession, url: str) -> str:
    async with session.get(url + "/metrics") as resp:
        assert resp.status == 200
        return await resp.text()


async def _until(session: aiohttp.ClientSession, url: str, ok: Any) -> str:
    """/metrics once `ok(text)` holds (polled, up to ~40 s on a loaded machine; no timing is
    asserted)."""
    text = ""
    for _ in range(2000):
        text = await _scrape(session, url)
        if ok(text):
            return text
        await asyncio.sleep(0.02)
    raise AssertionError(f"never held; last /metrics:\n{text}")


async def test_live_gauges_waits_and_preemption_series(redis_prefix: str) -> None:
    tenants = [
        {"name": "a", "weight": 1, "keys": [KEYS["a"]]},
        {"name": "b", "weight": 3, "keys": [KEYS["b"]]},
    ]
    held = "disagg_router_tenant_decode_blocks_held"
    share = "disagg_router_tenant_decode_share_blocks"
    async with (
        sim_cluster(
            redis_prefix=redis_prefix,
            # Answers of ~2.5 s: the gauges update at most once a second while busy.
            time_scale=2.0,
            tenants=tenants,
            admission={"fairness": "vtc"},
        ) as c,
        aiohttp.ClientSession() as session,
    ):
        url = c.router_url
        # Long answers of both tenants in flight: while both hold, each one's share is its
        # weight's part of the pool.
        calls = [asyncio.create_task(_answer(url, t, 600)) for t in ("a", "b", "b")]
        text = await _until(
            session,
            url,
            lambda t: (
                (_sample(t, held, tenant="a") or 0) > 0 and (_sample(t, held, tenant="b") or 0) > 0
            ),
        )
        capacity = 4096  # sim_cluster's one decode worker
        assert _sample(text, share, tenant="a") == capacity / 4
        assert _sample(text, share, tenant="b") == capacity * 3 / 4
        answers = await asyncio.gather(*calls)
        assert all(answers)
        # Once they end, the gauges come back to 0 (the sync's last rounds).
        text = await _until(
            session,
            url,
            lambda t: _sample(t, held, tenant="a") == 0 and _sample(t, held, tenant="b") == 0,
        )
        waits = "disagg_router_tenant_admission_wait_seconds_count"
        assert _sample(text, waits, tenant="a") == 1 and _sample(text, waits, tenant="b") == 2
        assert _sample(text, "disagg_router_tenant_waiting", tenant="b") == 0
        for tenant in ("a", "b", "default"):
            series = "disagg_router_tenant_preemptions_total"
            assert _sample(text, series, tenant=tenant, reason="fair_share") == 0, tenant


async def test_a_preempted_stream_is_counted_for_its_tenant(redis_prefix: str) -> None:
    """The test setting preempts a stream after 30 tokens: it resumes, and the preemption is
    counted for its tenant, with its reason (and for no other tenant)."""
    tenants = [
        {"name": "a", "weight": 1, "keys": [KEYS["a"]]},
        {"name": "b", "weight": 3, "keys": [KEYS["b"]]},
    ]
    async with (
        sim_cluster(
            redis_prefix=redis_prefix,
            decode=2,
            time_scale=50.0,
            tenants=tenants,
            preemption={"force_after_tokens": 30},
        ) as c,
        aiohttp.ClientSession() as session,
        AsyncOpenAI(
            base_url=c.router_url + "/v1", api_key=KEYS["a"], max_retries=0, timeout=60
        ) as client,
    ):
        stream = await client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "a long story, preempted"}],
            max_tokens=120,
            stream=True,
            extra_headers={"X-Sim-Output-Tokens": "90"},
        )
        parts = [
            chunk.choices[0].delta.content or ""
            async for chunk in stream
            if chunk.choices and chunk.choices[0].delta.content
        ]
        assert len("".join(parts)) > 0
        text = await _scrape(session, c.router_url)
    series = "disagg_router_tenant_preemptions_total"
    assert _sample(text, series, tenant="a", reason="forced") == 1
    assert _sample(text, series, tenant="b", reason="forced") is None
    assert _sample(text, "disagg_router_preemptions_total", reason="forced") == 1
