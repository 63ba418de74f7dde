"""Output-length estimators: buckets, convergence on a known distribution, cold fallbacks."""

from __future__ import annotations

import bisect
import math
import random
from collections import Counter
from dataclasses import replace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policies.base import OutputEstimate, OutputLengthEstimator, RequestInfo
from policies.estimators import (
    BUCKET_BOUNDS,
    HintEstimator,
    MaxTokensEstimator,
    OnlineQuantileEstimator,
    OracleEstimator,
    asked_bucket,
    bucket_of,
    class_keys_for,
    histogram_quantiles,
    score_estimate,
)


def req(prompt: int = 500, max_tokens: int = 4096, hint: int | None = None) -> RequestInfo:
    return RequestInfo("r", "llama", prompt, max_tokens, hint_output_tokens=hint)


def record(histograms: dict[str, Counter[int]], keys: tuple[str, ...], tokens: int) -> None:
    """What the state store does on completion: count the bucket under every class key."""
    for key in keys:
        histograms.setdefault(key, Counter())[bucket_of(tokens)] += 1


# -- buckets ---------------------------------------------------------------------------------


@settings(max_examples=200, deadline=None, database=None)
@given(n=st.integers(-5, 10_000_000))
def test_bucket_is_a_tight_upper_bound(n: int) -> None:
    b = bucket_of(n)
    assert isinstance(b, int) and b in BUCKET_BOUNDS
    assert b >= max(1, n)
    assert bucket_of(b) == b
    if n > 16:
        assert b <= math.ceil(n * 1.1)  # 8 buckets per octave: ~9 % wide


def test_bucket_bounds_are_exact_then_log_spaced() -> None:
    assert BUCKET_BOUNDS[:16] == tuple(range(1, 17))
    assert list(BUCKET_BOUNDS) == sorted(set(BUCKET_BOUNDS))
    assert {256, 1024, 4096, 65536} <= set(BUCKET_BOUNDS)
    assert bucket_of(2**30) == BUCKET_BOUNDS[-1]


def test_histogram_quantiles_accepts_string_keys_and_skips_zero_counts() -> None:
    from_store: dict[Any, Any] = {"10": "9", "100": 1, "1000": 0}  # as a store may return it
    total, qs = histogram_quantiles(from_store, (0.5, 0.9, 0.95))
    assert total == 10
    assert qs == {0.5: 10, 0.9: 10, 0.95: 100}
    assert histogram_quantiles({}, (0.5,)) == (0, {})


# -- convergence -----------------------------------------------------------------------------


@pytest.mark.parametrize(("median", "sigma"), [(230, 0.9), (60, 1.3), (900, 0.5)])
def test_online_quantile_p90_converges_within_a_bucket(median: float, sigma: float) -> None:
    """Lognormal answer lengths (Azure-conversation-like: a median of a few hundred tokens and a
    long tail) from a seeded RNG: the p90 estimate lands within one bucket of the true p90."""
    rng = random.Random(20240601)
    estimator = OnlineQuantileEstimator(quantile=0.9, min_samples=20)
    request = req(max_tokens=1_000_000)
    keys = estimator.class_keys(request)
    histograms: dict[str, Counter[int]] = {}
    samples = [max(1, round(rng.lognormvariate(math.log(median), sigma))) for _ in range(4_000)]
    for n in samples:
        record(histograms, keys, n)

    estimate = estimator.estimate(request, histograms)
    empirical_p90 = sorted(samples)[math.ceil(0.9 * len(samples)) - 1]
    true_p90 = median * math.exp(sigma * 1.2815515655446004)  # the lognormal's own p90
    assert estimate.reserve_tokens == bucket_of(empirical_p90)
    index = bisect.bisect_left(BUCKET_BOUNDS, estimate.reserve_tokens)
    assert abs(index - bisect.bisect_left(BUCKET_BOUNDS, bucket_of(round(true_p90)))) <= 1
    assert estimate.quantiles[0.5] <= estimate.quantiles[0.9] <= estimate.quantiles[0.99]
    assert estimate.source == f"class {keys[0]}"
    # Reserving p90 overruns about 10 % of answers, never much more (bucket rounding is upward).
    overruns = sum(score_estimate(estimate, n).overrun for n in samples) / len(samples)
    assert overruns <= 0.10


def test_narrow_class_learns_what_the_wide_class_averages_away() -> None:
    rng = random.Random(1)
    estimator = OnlineQuantileEstimator(min_samples=50)
    histograms: dict[str, Counter[int]] = {}
    short, long_ = req(prompt=200), req(prompt=8_000)
    for _ in range(500):
        record(histograms, estimator.class_keys(short), rng.randint(10, 40))
        record(histograms, estimator.class_keys(long_), rng.randint(900, 1_100))
    assert estimator.estimate(short, histograms).reserve_tokens <= 41
    assert estimator.estimate(long_, histograms).reserve_tokens >= 900


# -- cold classes and caps -------------------------------------------------------------------


def test_cold_everywhere_reserves_max_tokens() -> None:
    estimate = OnlineQuantileEstimator().estimate(req(max_tokens=777), {})
    assert estimate.reserve_tokens == 777
    assert estimate.source.startswith("max_tokens")


def test_cold_narrow_class_falls_back_to_the_narrowest_warm_one() -> None:
    estimator = OnlineQuantileEstimator(min_samples=20)
    request = req(prompt=3_000, hint=300)
    keys = estimator.class_keys(request)
    assert keys == (
        f"m=llama|p=4096|a=4096|h={bucket_of(300)}",
        "m=llama|p=4096|a=4096",
        "m=llama|a=4096",
        "*|a=4096",
    )
    histograms = {
        keys[0]: {304: 19},  # one short of min_samples
        keys[1]: {},
        keys[2]: {64: 20},
        "*|a=4096": {4096: 1_000},
    }
    estimate = estimator.estimate(request, histograms)
    assert (estimate.reserve_tokens, estimate.source) == (64, "class m=llama|a=4096")
    # A warm hint class says 304, above the plain classes' 64: the hint's class wins.
    histograms[keys[0]] = {304: 20}
    assert estimator.estimate(request, histograms).source == f"class {keys[0]}"


def test_estimate_is_capped_by_max_tokens() -> None:
    estimator = OnlineQuantileEstimator(min_samples=1)
    request = req(max_tokens=100)
    histograms = {key: {2_000: 30} for key in estimator.class_keys(request)}
    estimate = estimator.estimate(request, histograms)
    assert estimate.reserve_tokens == 100
    assert max(estimate.quantiles.values()) == 100


def test_class_keys_without_hint_and_prompt_over_the_last_bucket() -> None:
    assert class_keys_for(req(prompt=50_000)) == (
        "m=llama|p=inf|a=4096",
        "m=llama|a=4096",
        "*|a=4096",
    )
    assert OnlineQuantileEstimator(use_hint=False).class_keys(req(prompt=256, hint=9)) == (
        "m=llama|p=256|a=4096",
        "m=llama|a=4096",
        "*|a=4096",
    )


@pytest.mark.parametrize(
    ("max_tokens", "bucket"), [(1, 16), (16, 16), (17, 32), (300, 512), (4000, 4096), (4097, 8192)]
)
def test_asked_bucket_is_the_power_of_two_at_or_above_max_tokens(
    max_tokens: int, bucket: int
) -> None:
    assert asked_bucket(max_tokens) == bucket


def test_answers_learned_under_a_short_cap_do_not_size_a_long_ask() -> None:
    """The over-commit of issue 20: a class warm on 300-token answers (asked for 300) must not
    size requests asking for 4,000 — those start cold (max_tokens) until their own class warms."""
    estimator = OnlineQuantileEstimator(min_samples=20)
    histograms: dict[str, Counter[int]] = {}
    for _ in range(200):
        record(histograms, estimator.class_keys(req(max_tokens=300)), 300)
    assert estimator.estimate(req(max_tokens=300), histograms).reserve_tokens == 300
    assert estimator.estimate(req(max_tokens=4_000), histograms).reserve_tokens == 4_000


@pytest.mark.parametrize(
    "kwargs",
    [{"quantile": 1.0}, {"quantile": 0.0}, {"min_samples": 0}, {"prompt_buckets": (1024, 256)}],
)
def test_online_quantile_rejects_bad_arguments(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        OnlineQuantileEstimator(**kwargs)  # type: ignore[arg-type]


# -- the simple estimators -------------------------------------------------------------------


def test_max_tokens_estimator() -> None:
    assert MaxTokensEstimator().estimate(req(max_tokens=321, hint=5), {}).reserve_tokens == 321


def test_hint_estimator_uses_the_hint_with_headroom_and_falls_back() -> None:
    estimator = HintEstimator(headroom=1.5)
    trusted = replace(req(hint=200), hint_trusted=True)
    assert estimator.estimate(trusted, {}) == OutputEstimate(300, source="hint (trusted)")
    assert estimator.estimate(req(hint=5_000, max_tokens=1_000), {}).reserve_tokens == 1_000
    assert estimator.estimate(req(max_tokens=640), {}).reserve_tokens == 640
    learned = HintEstimator(fallback=OnlineQuantileEstimator(min_samples=1))
    request = req()
    histograms = {key: {50: 3} for key in learned.class_keys(request)}
    assert learned.estimate(request, histograms).reserve_tokens == 50
    with pytest.raises(TypeError):
        HintEstimator(fallback=object())  # type: ignore[arg-type]


def test_an_untrusted_hint_never_lowers_a_reservation() -> None:
    """`X-Expected-Output-Tokens: 1` on answers of thousands of tokens over-committed a decode
    worker (issue 20): a hint may raise the estimate, lower it only when trusted."""
    learned = HintEstimator(fallback=OnlineQuantileEstimator(min_samples=1))
    plain = req(max_tokens=4_000)
    histograms: dict[str, Counter[int]] = {}
    for _ in range(30):
        record(histograms, learned.class_keys(plain), 3_000)
    low = req(max_tokens=4_000, hint=1)
    histograms.update({k: Counter() for k in learned.class_keys(low) if k not in histograms})
    assert learned.estimate(plain, histograms).reserve_tokens == bucket_of(3_000)
    assert learned.estimate(low, histograms).reserve_tokens == bucket_of(3_000)
    assert learned.estimate(replace(low, hint_trusted=True), histograms).reserve_tokens == 1
    high = req(max_tokens=4_000, hint=3_900)
    assert learned.estimate(high, histograms).reserve_tokens == 3_900
    # Cold: the un-hinted estimate is max_tokens, which no untrusted hint goes below.
    assert HintEstimator().estimate(req(max_tokens=800, hint=5), {}).reserve_tokens == 800


def test_a_hint_class_that_learned_short_answers_cannot_undercut_the_plain_classes() -> None:
    estimator = OnlineQuantileEstimator(min_samples=5)
    hinted = req(hint=1)
    keys = estimator.class_keys(hinted)
    histograms = {keys[0]: {1: 50}, keys[1]: {2_000: 50}}
    assert estimator.estimate(hinted, histograms).reserve_tokens == 2_000
    trusted = replace(hinted, hint_trusted=True)
    assert estimator.estimate(trusted, histograms).reserve_tokens == 1


def test_oracle_estimator_takes_the_hint_as_truth() -> None:
    oracle = OracleEstimator()
    assert oracle.estimate(req(hint=123), {}) == OutputEstimate(123, source="oracle")
    assert oracle.estimate(req(max_tokens=99), {}).reserve_tokens == 99


@pytest.mark.parametrize(
    "estimator",
    [MaxTokensEstimator(), HintEstimator(), OnlineQuantileEstimator(), OracleEstimator()],
)
def test_every_estimator_meets_the_protocol(estimator: OutputLengthEstimator) -> None:
    assert isinstance(estimator, OutputLengthEstimator)
    assert estimator.class_keys(req())[-1] == "*|a=4096"
    assert estimator.bucket_of(1000) == bucket_of(1000)
    assert 1 <= estimator.estimate(req(max_tokens=10), {}).reserve_tokens <= 10


# -- scoring ---------------------------------------------------------------------------------


def test_score_estimate() -> None:
    over = score_estimate(OutputEstimate(300), 200)
    assert (over.error_tokens, over.unused_tokens, over.overrun) == (100, 100, False)
    assert over.relative_error == pytest.approx(0.5)
    under = score_estimate(150, 200)
    assert (under.error_tokens, under.unused_tokens, under.overrun) == (-50, 0, True)
    assert score_estimate(10, 0).relative_error == 10.0
