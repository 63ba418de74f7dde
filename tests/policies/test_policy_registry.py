"""Loading policies and estimators by name or dotted path; every failure is a PolicyLoadError."""

from __future__ import annotations

from typing import Any

import pytest

from policies.base import (
    ClusterView,
    DecodeView,
    KVLayout,
    OutputEstimate,
    Placement,
    PlacementPolicy,
    PrefillView,
    Rejection,
    RequestInfo,
)
from policies.baselines import RandomPolicy
from policies.estimators import HintEstimator, OnlineQuantileEstimator
from policies.registry import (
    BUILTIN_ESTIMATORS,
    BUILTIN_POLICIES,
    PolicyLoadError,
    load_estimator,
    load_policy,
)
from policies.two_sided import TwoSidedPolicy
from tests.paths import REPO

REPO = REPO
HERE = __name__  # plugins below are named by this module's import path


# -- plugins a user might write, broken in the ways users break them --------------------------


class RaisingPolicy:
    name = "raising"

    def place(self, request: RequestInfo, view: ClusterView) -> Placement:
        raise ValueError("boom")


class WrongResultPolicy:
    name = "wrong"

    def place(self, request: RequestInfo, view: ClusterView) -> object:
        return ("p0", "d0")


class GhostWorkerPolicy:
    name = "ghost"

    def place(self, request: RequestInfo, view: ClusterView) -> object:
        from policies.base import Candidate

        return Placement((Candidate("p-nowhere", "d-nowhere", 1),))


class NamelessPolicy:
    def place(self, request: RequestInfo, view: ClusterView) -> Rejection:
        return Rejection("never")


class PickyPolicy:
    """Refuses everything; a well-formed Rejection on the smoke request is allowed."""

    name = "picky"

    def __init__(self, threshold: int = 1) -> None:
        self.threshold = threshold

    def place(self, request: RequestInfo, view: ClusterView) -> Rejection:
        return Rejection("not today")


def make_picky(**kwargs: Any) -> PickyPolicy:
    return PickyPolicy(**kwargs)


class RaisingEstimator:
    name = "raising"

    def class_keys(self, request: RequestInfo) -> tuple[str, ...]:
        return ("*",)

    def estimate(self, request: RequestInfo, histograms: object) -> OutputEstimate:
        raise KeyError("no stats")

    def bucket_of(self, output_tokens: int) -> int:
        return output_tokens


NOT_CALLABLE = 42


# -- built-ins --------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(BUILTIN_POLICIES))
def test_builtin_policies_load(name: str) -> None:
    policy = load_policy(name)
    assert isinstance(policy, PlacementPolicy)
    assert policy.name == name


@pytest.mark.parametrize("spec", [None, "", "  two_sided "])
def test_default_policy_is_two_sided(spec: str | None) -> None:
    assert isinstance(load_policy(spec), TwoSidedPolicy)


def test_builtin_policy_gets_its_arguments() -> None:
    policy = load_policy("two_sided", {"itl_slo_s": 0.05, "max_candidates": 2})
    assert isinstance(policy, TwoSidedPolicy)
    assert (policy.itl_slo_s, policy.max_candidates) == (0.05, 2)


def test_smoke_call_leaves_a_seeded_policy_untouched() -> None:
    loaded, fresh = load_policy("random", {"seed": 3}), RandomPolicy(seed=3)
    layout = KVLayout()
    view = ClusterView(
        tuple(PrefillView(f"p{i}", layout) for i in range(5)),
        tuple(DecodeView(f"d{i}", layout, 1_000) for i in range(5)),
        kv_bytes_per_token=1024,
    )
    for i in range(5):
        request = RequestInfo(f"r{i}", "m", 100, 10)
        assert loaded.place(request, view) == fresh.place(request, view)


@pytest.mark.parametrize("name", sorted(BUILTIN_ESTIMATORS))
def test_builtin_estimators_load(name: str) -> None:
    assert load_estimator(name).name == name


def test_default_estimator_and_hint_fallback_by_name() -> None:
    assert isinstance(load_estimator(None), OnlineQuantileEstimator)
    hint = load_estimator("hint", {"fallback": "online_quantile", "headroom": 1.2})
    assert isinstance(hint, HintEstimator)
    assert isinstance(hint.fallback, OnlineQuantileEstimator)


# -- dotted paths -----------------------------------------------------------------------------


def test_dotted_path_to_the_example_policy(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(REPO))  # `examples/` is not installed, only in the checkout
    policy = load_policy("examples.custom_policy:TightestFitPolicy", {"max_candidates": 2})
    assert policy.name == "tightest_fit"
    layout = KVLayout()
    view = ClusterView(
        (PrefillView("p0", layout, queued_prompt_tokens=9), PrefillView("p1", layout)),
        (DecodeView("d-roomy", layout, 1_000), DecodeView("d-snug", layout, 1_000, 900)),
        kv_bytes_per_token=1024,
    )
    decision = policy.place(RequestInfo("r", "m", 100, 100), view)
    assert isinstance(decision, Placement)
    assert [(c.prefill_id, c.decode_id) for c in decision.candidates] == [
        ("p1", "d-snug"),
        ("p1", "d-roomy"),
    ]


def test_dotted_path_to_a_factory_and_a_policy_that_rejects() -> None:
    policy = load_policy(f"{HERE}:make_picky", {"threshold": 5})
    assert isinstance(policy, PickyPolicy) and policy.threshold == 5


@pytest.mark.parametrize(
    ("spec", "kwargs", "message"),
    [
        ("no_such_policy", None, "unknown policy 'no_such_policy': expected one of"),
        ("no_such_pkg.mod:Policy", None, "cannot import 'no_such_pkg.mod'"),
        (f"{HERE}:Missing", None, "has no attribute 'Missing'"),
        (f"{HERE}:NOT_CALLABLE", None, "is not a class or factory"),
        ("two_sided", {"itl_slo": 0.05}, "does not accept arguments"),
        ("two_sided", {"max_candidates": 0}, "raised ValueError('max_candidates must be >= 1"),
        ("two_sided", ["itl_slo_s"], "arguments must be a mapping"),
        (f"{HERE}:make_picky", {"nope": 1}, "raised TypeError"),
        (f"{HERE}:RaisingPolicy", None, "raised ValueError('boom') on a smoke request"),
        (f"{HERE}:WrongResultPolicy", None, "expected a Placement or a Rejection"),
        (f"{HERE}:GhostWorkerPolicy", None, "naming a worker not in the cluster view"),
        (f"{HERE}:NamelessPolicy", None, "has no `name` string"),
        (f"{HERE}:RaisingEstimator", None, "is not a placement policy: no place()"),
    ],
)
def test_broken_policy_specs_fail_at_load(spec: str, kwargs: Any, message: str) -> None:
    with pytest.raises(PolicyLoadError) as info:
        load_policy(spec, kwargs)
    assert message in str(info.value), str(info.value)
    assert spec.strip() in str(info.value)


@pytest.mark.parametrize(
    ("spec", "kwargs", "message"),
    [
        ("no_such_estimator", None, "unknown estimator"),
        ("online_quantile", {"quantile": 2.0}, "raised ValueError('quantile must be within"),
        ("online_quantile", {"q": 0.9}, "does not accept arguments"),
        ("hint", {"fallback": "nope"}, "unknown estimator 'nope'"),
        (f"{HERE}:RaisingEstimator", None, "raised KeyError('no stats') on a smoke request"),
        (
            f"{HERE}:PickyPolicy",
            None,
            "is not an output-length estimator: no class_keys, estimate, bucket_of()",
        ),
    ],
)
def test_broken_estimator_specs_fail_at_load(spec: str, kwargs: Any, message: str) -> None:
    with pytest.raises(PolicyLoadError) as info:
        load_estimator(spec, kwargs)
    assert message in str(info.value), str(info.value)


def test_policy_load_error_is_a_value_error() -> None:
    assert issubclass(PolicyLoadError, ValueError)
