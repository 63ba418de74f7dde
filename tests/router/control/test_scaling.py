"""Autoscaling signals: the pure recommendation (policies/scaling.py) and the live one
(router/control/scaling.py, GET /admin/scaling and the metrics) under a load step."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest

from policies.costmodel import perf_model
from policies.scaling import (
    DecodeDemand,
    PrefillDemand,
    ScalingSLO,
    max_batch_at_itl,
    recommend_decode,
    recommend_prefill,
)
from router.control.scaling import DemandMeter
from tests.conftest import MODEL, sim_cluster

CHAT = "/v1/chat/completions"
PERF = perf_model("llama-3-8b", "h100")
SLO = ScalingSLO()


def test_prefill_count_is_demand_over_rate_at_the_slo() -> None:
    rate = PERF.prefill_tokens_per_s(SLO.typical_prompt_tokens) * SLO.utilization
    idle = recommend_prefill(PrefillDemand(0.0, 0, 2), PERF, SLO)
    assert idle.recommended == SLO.min_replicas and idle.current == 2
    assert recommend_prefill(PrefillDemand(rate * 2.5, 0, 1), PERF, SLO).recommended == 3
    # Queued tokens must clear within the TTFT SLO: they count as a rate over it.
    queued = recommend_prefill(PrefillDemand(0.0, int(rate * SLO.ttft_slo_s * 4), 1), PERF, SLO)
    assert queued.recommended == 4
    tight = ScalingSLO(ttft_slo_s=SLO.ttft_slo_s / 2)
    assert (
        recommend_prefill(
            PrefillDemand(0.0, int(rate * SLO.ttft_slo_s * 4), 1), PERF, tight
        ).recommended
        == 8
    )


def test_decode_count_follows_kv_sequences_and_tokens() -> None:
    base = DecodeDemand(
        resident_seqs=0,
        reserved_blocks=0,
        capacity_blocks=1000,
        output_tokens_per_s=0.0,
        replicas=2,
    )
    assert recommend_decode(base, PERF, SLO).recommended == 1
    # 2,000 blocks held on pools of 500 blocks a worker, at 80 %: 5 workers, bound by KV.
    kv = DecodeDemand(100, 2000, 1000, 0.0, 2)
    rec = recommend_decode(kv, PERF, SLO)
    assert (rec.recommended, rec.bound_by) == (5, "kv_blocks")
    # Roomy workers: the ITL SLO caps the batch, so many short sequences need more workers.
    batch = max_batch_at_itl(PERF, 64, SLO.itl_slo_s)
    assert PERF.decode_step_s(64 * batch, batch) <= SLO.itl_slo_s
    assert PERF.decode_step_s(64 * (batch + 1), batch + 1) > SLO.itl_slo_s
    many = DecodeDemand(batch * 3, batch * 3 * 4, 10**7, 0.0, 1)
    rec = recommend_decode(many, PERF, SLO)
    assert rec.bound_by in ("sequences", "output_tokens_per_s") and rec.recommended >= 3
    # More output tokens per second asked: never fewer workers.
    more = recommend_decode(DecodeDemand(10, 40, 10**6, 10**6, 1), PERF, SLO)
    assert (
        more.recommended
        > recommend_decode(DecodeDemand(10, 40, 10**6, 0, 1), PERF, SLO).recommended
    )


def test_bad_slos_are_refused() -> None:
    for bad in ({"utilization": 0}, {"ttft_slo_s": 0}, {"window_s": -1}, {"min_replicas": -1}):
        with pytest.raises(ValueError):
            ScalingSLO(**bad)  # type: ignore[arg-type]


def test_demand_meter_rates_over_the_window() -> None:
    now = [100.0]
    meter = DemandMeter(10.0, clock=lambda: now[0])
    now[0] = 120.0  # up for longer than the window
    meter.note_arrival("m", 5000)
    meter.note_output("m", 300)
    assert meter.arriving_tokens_per_s("m") == 500.0
    assert meter.output_tokens_per_s("m") == 30.0
    now[0] = 131.5  # out of the window
    assert meter.arriving_tokens_per_s("m") == 0.0
    assert meter.models() == {"m"}


async def _scaling(s: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    async with s.get(url + "/admin/scaling") as r:
        assert r.status == 200
        body = await r.json()
    (row,) = [m for m in body["models"] if m["model"] == MODEL]
    return dict(row)


async def test_a_load_step_moves_each_pool_the_right_way() -> None:
    async with (
        sim_cluster(
            prefill=1,
            decode=2,
            redis_prefix=None,
            kv_blocks=8192,
            worker_overrides={"d0": {"time_scale": 1.0}, "d1": {"time_scale": 1.0}},
            # An ITL SLO just above an 8B model's weights-only step on an H100 (8.3 ms): a
            # decode worker can then hold only a handful of sequences within it.
            scaling={"window_s": 60.0, "itl_slo_s": 0.0085},
        ) as cluster,
        aiohttp.ClientSession() as s,
    ):
        url = cluster.router_url
        idle = await _scaling(s, url)
        assert idle["prefill"]["recommendation"]["recommended"] == 1
        assert idle["decode"]["recommendation"]["recommended"] == 1
        assert idle["decode"]["recommendation"]["current"] == 2

        # Prompt-heavy: long prompts, one token each. The prefill pool must grow.
        prompt = "lorem ipsum " * 10_000  # ~30k tokens at 4 characters a token

        async def prefill_heavy(i: int) -> None:
            body = {
                "model": MODEL,
                "messages": [{"role": "user", "content": f"{i} {prompt}"}],
                "max_tokens": 1,
            }
            async with s.post(url + CHAT, json=body) as r:
                assert r.status == 200, await r.text()

        for chunk in range(4):
            await asyncio.gather(*(prefill_heavy(chunk * 4 + i) for i in range(4)))
        for _ in range(100):  # the releases reach the next store refresh
            heavy = await _scaling(s, url)
            if heavy["decode"]["demand"]["resident_seqs"] == 0:
                break
            await asyncio.sleep(0.05)
        p_rec = heavy["prefill"]["recommendation"]
        assert heavy["prefill"]["demand"]["arriving_tokens_per_s"] > 0
        assert p_rec["recommended"] > idle["prefill"]["recommendation"]["recommended"], heavy
        assert heavy["decode"]["demand"]["resident_seqs"] == 0

        # Decode-heavy: short prompts, long answers in flight on small KV pools.
        started = [asyncio.Event() for _ in range(12)]
        release = asyncio.Event()

        async def decode_heavy(i: int) -> None:
            body = {
                "model": MODEL,
                "messages": [{"role": "user", "content": f"long {i}"}],
                "max_tokens": 400,
                "stream": True,
            }
            async with s.post(url + CHAT, json=body, headers={"X-Sim-Output-Tokens": "400"}) as r:
                assert r.status == 200, await r.text()
                async for line in r.content:
                    if line.startswith(b"data: "):
                        started[i].set()
                        if release.is_set():
                            break

        streams = [asyncio.ensure_future(decode_heavy(i)) for i in range(12)]
        try:
            async with asyncio.timeout(60):
                await asyncio.gather(*(ev.wait() for ev in started))
            during = None
            for _ in range(100):  # the store refresh counts every replica's reservations
                during = await _scaling(s, url)
                if during["decode"]["demand"]["resident_seqs"] >= 12:
                    break
                await asyncio.sleep(0.05)
            assert during is not None
            d = during["decode"]
            assert d["demand"]["reserved_blocks"] > 0
            assert d["demand"]["capacity_blocks"] == 2 * 8192
            assert (
                d["recommendation"]["recommended"]
                > heavy["decode"]["recommendation"]["recommended"]
            ), during
            metrics = await (await s.get(url + "/metrics")).text()
            assert (
                f'disagg_router_scaling_recommended_replicas{{model="{MODEL}",pool="decode"}} '
                f"{float(d['recommendation']['recommended'])}" in metrics
            ) or (
                f'disagg_router_scaling_recommended_replicas{{model="{MODEL}",pool="decode"}}'
                in metrics
            )
            assert "disagg_router_scaling_prefill_arriving_tokens_per_second" in metrics
        finally:
            release.set()
            for t in streams:
                t.cancel()
            await asyncio.gather(*streams, return_exceptions=True)
