"""Per-tenant output-length estimates (issue 31, "poisoned estimate"): one tenant's answers move
only its own estimates (policies/tenant_classes.py, policies/estimators.py).

The pure tests play the router's loop — classes -> histograms -> estimate -> record keys ->
record — on a dict standing for the store; the live test runs it through the router and
simulated workers, with two tenants' keys: tenant qc's 25 answers of 4 tokens under max_tokens
2,000 must not size tenant b's n = 16 x 2,000 request on ~4 tokens a choice.
"""

from __future__ import annotations

import asyncio
import math
import random
import re
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import aiohttp
import pytest

from disagg_tools.simcluster.config import ClusterConfig
from disagg_tools.simcluster.engine import simulate
from disagg_tools.simcluster.tenants import TenantRequest
from policies.base import OutputEstimate, OutputHistograms, RequestInfo
from policies.estimators import (
    HintEstimator,
    MaxTokensEstimator,
    OnlineQuantileEstimator,
    bucket_of,
    class_keys_for,
    histogram_quantiles,
)
from policies.overruns import LiveOverruns
from policies.registry import PolicyLoadError, load_estimator
from policies.tenant_classes import (
    SHARED_TENANTS,
    record_keys_for,
    record_keys_of,
    record_rule,
)
from policies.two_sided import TwoSidedPolicy
from router.tenants import DEFAULT_TENANT
from tests.conftest import MODEL, sim_cluster

CAP = 2000
MIN = 20
Store = dict[str, dict[int, int]]


def _request(tenant: str = "", max_tokens: int = CAP, **kw: Any) -> RequestInfo:
    return RequestInfo(
        request_id="r", model=MODEL, prompt_tokens=100, max_tokens=max_tokens, tenant=tenant, **kw
    )


def _serve(est: Any, store: Store, request: RequestInfo, length: int) -> OutputEstimate:
    """One request through the router's loop: estimate on the histograms of its classes, then
    record its answer where `record_keys_of` says (decided on the counts it was estimated on)."""
    keys = est.class_keys(request)
    read: OutputHistograms = {k: dict(store.get(k, {})) for k in keys}
    estimate: OutputEstimate = est.estimate(request, read)
    bucket = est.bucket_of(length)
    for key in record_keys_of(est, request, read, keys):
        hist = store.setdefault(key, {})
        hist[bucket] = hist.get(bucket, 0) + 1
    return estimate


def _estimate(est: Any, store: Store, request: RequestInfo) -> OutputEstimate:
    keys = est.class_keys(request)
    return est.estimate(request, {k: store.get(k, {}) for k in keys})  # type: ignore[no-any-return]


def _total(hist: Mapping[int, int]) -> int:
    return sum(hist.values())


# -- no tenants: nothing changes -----------------------------------------------------------------


def test_without_tenants_the_classes_and_records_are_the_shared_ones() -> None:
    expected = (f"m={MODEL}|p=256|a=2048", f"m={MODEL}|a=2048", "*|a=2048")
    assert DEFAULT_TENANT in SHARED_TENANTS  # the router's tenant when none are configured
    est = OnlineQuantileEstimator()
    for tenant in ("", DEFAULT_TENANT):
        request = _request(tenant)
        assert class_keys_for(request) == expected
        assert est.class_keys(request) == expected
        # Recorded into every class whatever the counts, as before tenants.
        full = {k: {4: 10_000} for k in expected}
        assert record_keys_of(est, request, full) == expected
        assert record_keys_of(MaxTokensEstimator(), request, full) == expected
    hinted = _request(hint_output_tokens=300)
    assert class_keys_for(hinted) == (f"m={MODEL}|p=256|a=2048|h=304", *expected)


def test_a_named_tenant_reads_its_own_classes_then_the_shared_ones() -> None:
    keys = class_keys_for(_request("qc"))
    shared = class_keys_for(_request())
    assert keys == tuple(f"t=qc|{k}" for k in shared) + shared


# -- the poisoning, pure -----------------------------------------------------------------


def test_a_poisoner_lowers_only_its_own_estimate_first_in_a_cold_cluster() -> None:
    """Issue 31's order: qc's 25 answers of 4 tokens come first. Another tenant, cold, reserves
    max_tokens (the shared classes hold one tenant's answers: no prior), not ~4 tokens; qc's
    own estimate drops to its answers."""
    est = OnlineQuantileEstimator(quantile=0.9, min_samples=MIN)
    store: Store = {}
    for _ in range(25):
        _serve(est, store, _request("qc"), 4)
    victim = _estimate(est, store, _request("b", n=16))
    assert victim.reserve_tokens == CAP, victim
    assert _request("b", n=16, estimate=victim).reserve_output_tokens >= 16 * CAP
    own = _estimate(est, store, _request("qc"))
    assert own.reserve_tokens == 4 and own.source.startswith("class t=qc|"), own
    # qc fed the shared classes its first min_samples answers, no more.
    assert all(_total(store[k]) == MIN for k in class_keys_for(_request()))


def test_a_poisoner_does_not_pull_the_prior_below_the_honest_answers() -> None:
    """Two honest tenants warm the shared classes (answers of 1,500 tokens), then qc sends 500
    answers of 4 tokens. A third tenant, cold, reserves from the prior at the honest length;
    the honest tenants keep their own estimate; qc's own drops to 4."""
    est = OnlineQuantileEstimator(quantile=0.9, min_samples=MIN)
    store: Store = {}
    honest = bucket_of(1500)
    for _ in range(30):
        for tenant in ("a", "b"):
            _serve(est, store, _request(tenant), 1500)
    before = _estimate(est, store, _request("new"))
    assert before.reserve_tokens == honest and before.source.startswith("prior class"), before
    for _ in range(500):
        _serve(est, store, _request("qc"), 4)
    after = _estimate(est, store, _request("new"))
    assert after.reserve_tokens == honest, after
    assert _estimate(est, store, _request("a")).reserve_tokens == honest
    assert _estimate(est, store, _request("qc")).reserve_tokens == 4
    for key in class_keys_for(_request()):  # qc's share of the prior: its first MIN answers
        assert store[key].get(bucket_of(4), 0) == MIN


def test_one_tenant_alone_never_warms_the_prior() -> None:
    """However many answers one tenant has, the shared classes hold min_samples of them: fewer
    than prior_tenants x min_samples, so a cold tenant reserves max_tokens."""
    est = OnlineQuantileEstimator(min_samples=MIN)
    store: Store = {}
    for _ in range(300):
        _serve(est, store, _request("solo"), 700)
    assert _estimate(est, store, _request("other")).reserve_tokens == CAP
    assert _estimate(est, store, _request("solo")).reserve_tokens == bucket_of(700)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_no_tenant_holds_more_than_its_share_nor_pulls_the_prior_below_the_others(
    seed: int,
) -> None:
    """Four honest tenants with spread-out answers and a poisoner, interleaved at random (the
    poisoner sends as much as the four together): in every shared class the poisoner holds at
    most max(min_samples, share x total) answers, and the prior a cold tenant reserves is at
    least the others' own q-quantile there (the raised prior quantile's guarantee)."""
    rng = random.Random(seed)
    est = OnlineQuantileEstimator(quantile=0.9, min_samples=MIN, max_prior_share=0.25)
    store: Store = {}
    honest_lengths: list[int] = []
    for _ in range(800):
        if rng.random() < 0.5:
            _serve(est, store, _request("qc"), 4)
        else:
            length = rng.randint(200, 1900)
            honest_lengths.append(length)
            _serve(est, store, _request(rng.choice("abcd")), length)
    poison = bucket_of(4)
    for key in class_keys_for(_request()):
        hist = store[key]
        total = _total(hist)
        assert hist.get(poison, 0) <= max(MIN, math.ceil(0.25 * total)), (key, hist)
        others = {b: n for b, n in hist.items() if b != poison}
        _, honest_q = histogram_quantiles(others, [0.9])
        prior = est.estimate(_request("new"), {key: hist})
        assert prior.source.startswith(f"prior class {key}"), prior
        assert prior.reserve_tokens >= honest_q[0.9], (key, prior, honest_q)


def test_record_keys_bound_each_shared_class_by_its_own_counts() -> None:
    shared = class_keys_for(_request())
    keys = class_keys_for(_request("t"))
    narrow, model, widest = shared
    hist = {
        f"t=t|{narrow}": {8: 5},  # below min_samples: feeds the shared class
        f"t=t|{model}": {8: 25},  # at max(20, 0.25 x 80) = 20 and above: does not
        model: {8: 80},
        f"t=t|{widest}": {8: 25},  # below 0.25 x 200 = 50: feeds it
        widest: {8: 200},
    }
    got = record_keys_for("t", keys, hist, min_samples=20, max_prior_share=0.25)
    assert got == (*keys[:3], narrow, widest)


def test_a_tenants_live_overruns_count_in_its_own_classes_only() -> None:
    est = OnlineQuantileEstimator(min_samples=MIN)
    live = LiveOverruns(est.bucket_of)
    keys = class_keys_for(_request("qc"))
    live.overran("r1", keys, 1500)
    completed: OutputHistograms = {k: {} for k in keys}
    merged = live.with_live(completed)
    for key in keys:
        assert bool(merged[key]) == key.startswith("t=qc|"), (key, merged[key])


def test_a_hinted_request_of_a_tenant_keeps_the_advisory_rule() -> None:
    """An untrusted hint may only raise a tenant's estimate: its plain own class is read."""
    est = OnlineQuantileEstimator(min_samples=MIN)
    store: Store = {}
    for _ in range(MIN):
        _serve(est, store, _request("a"), 900)
    hinted = _request("a", hint_output_tokens=10)
    for _ in range(MIN):
        _serve(est, store, hinted, 10)
    got = _estimate(est, store, hinted)
    assert got.reserve_tokens == bucket_of(900), got
    assert _estimate(est, store, replace(hinted, hint_trusted=True)).reserve_tokens == 10
    # The hint estimator feeds the shared classes by its fallback's bounds.
    bounded = OnlineQuantileEstimator(min_samples=5, max_prior_share=0.5)
    assert record_rule(HintEstimator(fallback=bounded)) == (5, 0.5)
    assert record_rule(HintEstimator()) == (MIN, 0.25)  # max_tokens: the defaults


def test_the_bounds_are_the_estimators_settings() -> None:
    """`estimator_args` in the router's configuration (and the simulator's estimator) set them;
    a bound that would not bound is refused at load."""
    est = load_estimator("online_quantile", {"prior_tenants": 3, "max_prior_share": 0.5})
    assert isinstance(est, OnlineQuantileEstimator)
    assert (est.prior_tenants, est.max_prior_share) == (3.0, 0.5)
    assert record_rule(est) == (MIN, 0.5)
    for bad in ({"prior_tenants": 0.5}, {"max_prior_share": 0}, {"max_prior_share": 1.5}):
        with pytest.raises(PolicyLoadError):
            load_estimator("online_quantile", bad)


# -- the simulator runs the same rule ------------------------------------------------------------


class _Recording:
    """The online estimator, noting each estimate by tenant (the simulator calls it as the
    router does, and records where `record_keys_of` says, with this one's defaults)."""

    def __init__(self) -> None:
        self.inner = OnlineQuantileEstimator(quantile=0.9, min_samples=MIN)
        self.name = "online_quantile"
        self.seen: list[tuple[str, int]] = []

    def class_keys(self, request: RequestInfo) -> tuple[str, ...]:
        return self.inner.class_keys(request)

    def estimate(self, request: RequestInfo, histograms: OutputHistograms) -> OutputEstimate:
        got = self.inner.estimate(request, histograms)
        self.seen.append((request.tenant, got.reserve_tokens))
        return got

    def bucket_of(self, n: int) -> int:
        return self.inner.bucket_of(n)


def test_the_simulator_keeps_a_poisoners_answers_out_of_another_tenants_estimate() -> None:
    """25 of qc's answers of 4 tokens, then b's requests (answers of 1,500): every estimate of
    b's is max_tokens until b's own class warms, then b's own answers' bucket — never ~4."""
    requests = [
        TenantRequest(arrival_s=i * 0.5, prompt_tokens=100, output_tokens=4, tenant="qc")
        for i in range(25)
    ] + [
        TenantRequest(arrival_s=100 + i * 5.0, prompt_tokens=100, output_tokens=1500, tenant="b")
        for i in range(30)
    ]
    est = _Recording()
    cfg = ClusterConfig.homogeneous(1, 1, capacity_blocks=4000).with_(max_tokens=CAP)
    result = simulate(requests, cfg, TwoSidedPolicy(), est)
    assert sum(1 for r in result.records if r.outcome == "ok") == len(requests)
    b_estimates = [reserve for tenant, reserve in est.seen if tenant == "b"]
    assert b_estimates and min(b_estimates) >= bucket_of(1500), b_estimates
    assert [reserve for tenant, reserve in est.seen if tenant == "qc"][-1] <= 16


# -- live: the router with two tenants' keys -----------------------------------------------------

CHAT = "/v1/chat/completions"
KEY_QC = "sk-tenant-qc-5d1e8b2a7c4f90e3a6b1"
KEY_B = "sk-tenant-b-2c9f4a7e1d6b83a05e7c"
WAIT_S = 120.0
_SAMPLE = re.compile(r"^(\w+)\{([^}]*)\} (\S+)$")


async def _predicted(url: str) -> dict[str, float]:
    """The router's predicted_output_tokens histogram: {le: cumulative count}."""
    async with aiohttp.ClientSession() as s, s.get(url + "/metrics") as r:
        text = await r.text()
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m and m[1] == "disagg_router_predicted_output_tokens_bucket":
            out[dict(re.findall(r'(\w+)="([^"]*)"', m[2]))["le"]] = float(m[3])
    return out


async def _chat(
    s: aiohttp.ClientSession, url: str, key: str, n: int, answer_tokens: int, rid: str
) -> dict[str, Any]:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": f"question {rid}"}],
        "max_tokens": CAP,
        "n": n,
    }
    headers = {
        "Authorization": f"Bearer {key}",
        "X-Request-Id": rid,
        "X-Sim-Output-Tokens": str(answer_tokens),
    }
    async with s.post(url + CHAT, json=body, headers=headers) as resp:
        data = await resp.json()
        assert resp.status == 200, (rid, resp.status, data)
        return dict(data)


async def _reserved_for_one(url: str, send: Any) -> float:
    """The reservation (output tokens, all choices) the router made for the one request `send`
    makes: the lowest predicted_output_tokens bucket its observation landed in."""
    before = await _predicted(url)
    await send()
    after = await _predicted(url)
    delta = {le: after[le] - before.get(le, 0.0) for le in after}
    assert delta["+Inf"] == 1, delta
    return min(float(le) for le, d in delta.items() if d == 1)


async def test_live_a_tenants_short_answers_do_not_size_another_tenants_reservation(
    redis_prefix: str,
) -> None:
    """Issue 31's poisoned estimate through the router: tenant qc's 25 requests of max_tokens
    2,000 stop after 4 tokens; then tenant b's n = 16 request reserves for max_tokens (16 x
    2,000: b and the prior are cold), not for ~4 tokens a choice — while qc's own next request
    does reserve for its short answers."""
    tenants = [
        {"name": "qc", "keys": [KEY_QC]},
        {"name": "b", "keys": [KEY_B]},
    ]
    async with sim_cluster(
        prefill=1,
        decode=1,
        redis_prefix=redis_prefix,
        kv_blocks=3000,
        time_scale=5000.0,
        tenants=tenants,
        estimates={
            "estimator": "online_quantile",
            "estimator_args": {"quantile": 0.9, "min_samples": MIN},
        },
        loops={"histogram_refresh_s": 0.1},
    ) as c:
        gw = c.parts
        url = c.router_url
        gate = asyncio.Semaphore(4)
        async with aiohttp.ClientSession() as s:

            async def poison(i: int) -> None:
                async with gate:
                    got = await _chat(s, url, KEY_QC, 1, 4, f"qc-{i}")
                assert got["usage"]["completion_tokens"] == 4

            await asyncio.gather(*(poison(i) for i in range(25)))

            # Every answer recorded, and the router's cache has read it: qc's estimate is ~4.
            qc_probe = _request("qc")
            loop = asyncio.get_running_loop()
            deadline = loop.time() + WAIT_S
            while True:
                keys = gw.estimator.class_keys(qc_probe)
                cached = await gw.histograms.get(keys)
                if gw.estimator.estimate(qc_probe, cached).reserve_tokens <= 16:
                    break
                assert loop.time() < deadline, ("qc's estimate never learned", cached)
                await asyncio.sleep(0.05)

            reserved_b = await _reserved_for_one(url, lambda: _chat(s, url, KEY_B, 16, 8, "b-wide"))
            assert reserved_b > 16 * CAP / 2, reserved_b  # max_tokens' bucket, not ~16 x 4
            reserved_qc = await _reserved_for_one(url, lambda: _chat(s, url, KEY_QC, 1, 4, "qc"))
            assert reserved_qc <= 16, reserved_qc
