"""disagg-router: placement policies and output-length estimators (pure; see policies.base)."""

from policies.base import (
    Candidate,
    ClusterView,
    Decision,
    DecodeView,
    KVLayout,
    OutputEstimate,
    OutputHistograms,
    OutputLengthEstimator,
    Placement,
    PlacementPolicy,
    PrefillView,
    Rejection,
    RequestInfo,
    blocks_for,
)
from policies.baselines import LeastLoadedPolicy, PowerOfTwoPolicy, RandomPolicy, RoundRobinPolicy
from policies.estimators import (
    EstimateScore,
    HintEstimator,
    MaxTokensEstimator,
    OnlineQuantileEstimator,
    OracleEstimator,
    bucket_of,
    score_estimate,
)
from policies.registry import PolicyLoadError, load_estimator, load_policy
from policies.two_sided import TwoSidedPolicy

__all__ = [
    "Candidate",
    "ClusterView",
    "Decision",
    "DecodeView",
    "KVLayout",
    "OutputEstimate",
    "OutputHistograms",
    "OutputLengthEstimator",
    "Placement",
    "PlacementPolicy",
    "PrefillView",
    "Rejection",
    "RequestInfo",
    "blocks_for",
    "LeastLoadedPolicy",
    "PowerOfTwoPolicy",
    "RandomPolicy",
    "RoundRobinPolicy",
    "TwoSidedPolicy",
    "EstimateScore",
    "HintEstimator",
    "MaxTokensEstimator",
    "OnlineQuantileEstimator",
    "OracleEstimator",
    "bucket_of",
    "score_estimate",
    "PolicyLoadError",
    "load_estimator",
    "load_policy",
]
