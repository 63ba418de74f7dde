"""Corrections in flight (policies/overruns.py): live overruns raise their class's estimate before
any of them completes, and forced growth keeps room back on its worker for a while."""

from __future__ import annotations

import pytest

from policies.base import RequestInfo
from policies.estimators import OnlineQuantileEstimator, bucket_of
from policies.overruns import LiveOverruns, OverrunMargin


def req(max_tokens: int = 4_000) -> RequestInfo:
    return RequestInfo("r", "llama", 500, max_tokens)


def test_live_overruns_raise_the_class_estimate_before_they_complete() -> None:
    estimator = OnlineQuantileEstimator(min_samples=20)
    request = req()
    keys = estimator.class_keys(request)
    # Learned on short answers: 100 completions of ~300 tokens.
    completed = {k: {bucket_of(300): 100} for k in keys}
    live = LiveOverruns(estimator.bucket_of)
    assert estimator.estimate(request, live.with_live(completed)).reserve_tokens == bucket_of(300)
    # 30 live requests of the class outgrew their 300-token reservations, now at 1,000 tokens.
    for i in range(30):
        live.overran(f"r{i}", keys, 1_000)
    raised = estimator.estimate(request, live.with_live(completed)).reserve_tokens
    assert raised == bucket_of(1_000)
    # They grow on: the estimate follows without a single completion.
    for i in range(30):
        live.overran(f"r{i}", keys, 2_500)
    assert estimator.estimate(request, live.with_live(completed)).reserve_tokens == bucket_of(2_500)
    # Released: they are the completions' business now (recorded with the release).
    for i in range(30):
        live.ended(f"r{i}")
    assert len(live) == 0
    assert estimator.estimate(request, live.with_live(completed)).reserve_tokens == bucket_of(300)


def test_a_few_overruns_stay_in_the_tail_the_quantile_allows() -> None:
    estimator = OnlineQuantileEstimator(quantile=0.9, min_samples=20)
    request = req()
    keys = estimator.class_keys(request)
    completed = {k: {bucket_of(300): 1_000} for k in keys}
    live = LiveOverruns(estimator.bucket_of)
    for i in range(5):  # 0.5 % of the class: no reason to hold more for everyone
        live.overran(f"r{i}", keys, 3_000)
    assert estimator.estimate(request, live.with_live(completed)).reserve_tokens == bucket_of(300)


def test_live_overruns_only_touch_their_own_classes_and_count_versions() -> None:
    live = LiveOverruns(bucket_of)
    completed = {"a": {10: 5}, "b": {10: 5}}
    assert live.with_live(completed) == completed
    v0 = live.version
    live.overran("x", ("a",), 100)
    assert live.version == v0 + 1
    live.overran("x", ("a",), 100)  # same bucket: nothing new
    live.overran("x", ("a",), 50)  # never lower
    assert live.version == v0 + 1
    merged = live.with_live(completed)
    assert merged["a"] == {10: 5, bucket_of(100): 1}
    assert merged["b"] is completed["b"]
    assert completed["a"] == {10: 5}  # the input is not modified
    live.ended("x")
    live.ended("x")  # twice is harmless
    assert live.version == v0 + 2
    assert live.with_live(completed) == completed


def test_overrun_margin_holds_the_excess_then_decays() -> None:
    margin = OverrunMargin(half_life_s=60.0, max_share=0.25)
    assert margin.margin("d0", 3_000, 0.0) == 0
    margin.observe("d0", 400, now=10.0)
    assert margin.margin("d0", 3_000, 10.0) == 400
    assert margin.margin("d0", 3_000, 70.0) == 200  # one half-life later
    margin.observe("d0", 100, now=70.0)  # smaller than what is held: no change
    assert margin.margin("d0", 3_000, 70.0) == 200
    margin.observe("d0", 5_000, now=70.0)
    assert margin.margin("d0", 3_000, 70.0) == 750  # capped at a quarter of the capacity
    assert margin.margins({"d0": 3_000, "d1": 3_000}, 70.0) == {"d0": 750}
    assert margin.margin("d0", 3_000, 70.0 + 60.0 * 14) == 0  # decayed away
    assert margin.margins({"d0": 3_000}, 10_000.0) == {}


@pytest.mark.parametrize("kwargs", [{"half_life_s": 0.0}, {"max_share": 1.0}, {"max_share": -0.1}])
def test_overrun_margin_rejects_bad_settings(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        OverrunMargin(**kwargs)
