"""Name → placement policy, output-length estimator, role policy or admission-order (fairness)
policy, validated when loaded.

A spec is a built-in name or a dotted path `"pkg.mod:Name"` to a class or factory, called with
the configured keyword arguments. Everything that can go wrong with a plugin is found here, at
startup, and reported as one `PolicyLoadError` naming the spec and the cause: the module does not
import, the attribute is missing, the arguments do not fit, the object is not a policy, or
`place()` raises on a tiny synthetic cluster (a fairness policy: misorders a smoke queue of two
tenants). A broken plugin fails the deploy, not the first
request.
"""

from __future__ import annotations

import copy
import importlib
import inspect
from collections.abc import Callable, Mapping
from typing import Any

from policies.base import (
    AdmissionCost,
    Candidate,
    Charge,
    ClusterView,
    DecodeView,
    KVLayout,
    OutputEstimate,
    OutputLengthEstimator,
    Placement,
    PlacementPolicy,
    PrefillView,
    Rejection,
    RequestInfo,
    RolePlan,
    RoleSnapshot,
    RoleWorkerView,
    Tenant,
    WaitingRequest,
)
from policies.baselines import LeastLoadedPolicy, PowerOfTwoPolicy, RandomPolicy, RoundRobinPolicy
from policies.estimators import (
    HintEstimator,
    MaxTokensEstimator,
    OnlineQuantileEstimator,
    OracleEstimator,
)
from policies.fairness import FifoFairness, VTCFairness
from policies.role_policies import ElasticRoles, StaticRoles
from policies.two_sided import TwoSidedPolicy

__all__ = [
    "PolicyLoadError",
    "BUILTIN_POLICIES",
    "BUILTIN_ESTIMATORS",
    "BUILTIN_ROLE_POLICIES",
    "BUILTIN_FAIRNESS",
    "DEFAULT_POLICY",
    "DEFAULT_ESTIMATOR",
    "DEFAULT_ROLE_POLICY",
    "DEFAULT_FAIRNESS",
    "load_policy",
    "load_estimator",
    "load_role_policy",
    "load_fairness",
]

DEFAULT_POLICY = "two_sided"
DEFAULT_ESTIMATOR = "online_quantile"
DEFAULT_ROLE_POLICY = "static"
DEFAULT_FAIRNESS = "fifo"

BUILTIN_POLICIES: Mapping[str, Callable[..., Any]] = {
    "two_sided": TwoSidedPolicy,
    "random": RandomPolicy,
    "round_robin": RoundRobinPolicy,
    "least_loaded": LeastLoadedPolicy,
    "power_of_two": PowerOfTwoPolicy,
}

BUILTIN_ESTIMATORS: Mapping[str, Callable[..., Any]] = {
    "max_tokens": MaxTokensEstimator,
    "online_quantile": OnlineQuantileEstimator,
    "hint": HintEstimator,
    "oracle": OracleEstimator,
}

BUILTIN_ROLE_POLICIES: Mapping[str, Callable[..., Any]] = {
    "static": StaticRoles,
    "elastic": ElasticRoles,
}

BUILTIN_FAIRNESS: Mapping[str, Callable[..., Any]] = {
    "fifo": FifoFairness,
    "vtc": VTCFairness,
}


class PolicyLoadError(ValueError):
    """A policy or estimator spec cannot be turned into a working object (a configuration error)."""


def load_policy(spec: str | None, kwargs: Mapping[str, Any] | None = None) -> PlacementPolicy:
    """Build and validate the placement policy named by `spec` (default: two_sided)."""
    spec = (spec or DEFAULT_POLICY).strip()
    policy = _build(spec, kwargs, BUILTIN_POLICIES, "policy")
    _require(spec, policy, "policy", "a placement policy", ("place",))
    _smoke_policy(spec, policy)
    return policy  # type: ignore[no-any-return]


def load_estimator(
    spec: str | None, kwargs: Mapping[str, Any] | None = None
) -> OutputLengthEstimator:
    """Build and validate the output-length estimator named by `spec` (default: online_quantile).

    For the built-in `hint` estimator, a string `fallback` argument is itself loaded as a spec,
    so a configuration file can say `{"fallback": "online_quantile"}`.
    """
    spec = (spec or DEFAULT_ESTIMATOR).strip()
    args = dict(kwargs or {})
    if spec == "hint" and isinstance(args.get("fallback"), str):
        args["fallback"] = load_estimator(args["fallback"])
    estimator = _build(spec, args, BUILTIN_ESTIMATORS, "estimator")
    _require(
        spec,
        estimator,
        "estimator",
        "an output-length estimator",
        ("class_keys", "estimate", "bucket_of"),
    )
    _smoke_estimator(spec, estimator)
    return estimator  # type: ignore[no-any-return]


def load_role_policy(spec: str | None, kwargs: Mapping[str, Any] | None = None) -> Any:
    """Build and validate the role policy named by `spec` (default: static, never switches).

    Returns a `policies.base.RolePolicy`; smoke-tested on a 2-worker snapshot under load.
    """
    spec = (spec or DEFAULT_ROLE_POLICY).strip()
    policy = _build(spec, kwargs, BUILTIN_ROLE_POLICIES, "role policy")
    _require(spec, policy, "role policy", "a role policy", ("decide",))
    _smoke_role_policy(spec, policy)
    return policy


def load_fairness(spec: str | None, kwargs: Mapping[str, Any] | None = None) -> Any:
    """Build and validate the admission-order policy named by `spec` (default: fifo, today's
    order). Returns a `policies.base.FairnessPolicy`; smoke-tested on two tenants' requests."""
    spec = (spec or DEFAULT_FAIRNESS).strip()
    policy = _build(spec, kwargs, BUILTIN_FAIRNESS, "fairness policy")
    _require(
        spec,
        policy,
        "fairness policy",
        "an admission-order policy",
        ("enqueue", "withdraw", "pick", "admit", "settle"),
    )
    _smoke_fairness(spec, policy)
    return policy


# -- building ---------------------------------------------------------------------------------


def _build(
    spec: str,
    kwargs: Mapping[str, Any] | None,
    builtins: Mapping[str, Callable[..., Any]],
    kind: str,
) -> Any:
    if kwargs is not None and not isinstance(kwargs, Mapping):
        raise PolicyLoadError(f"{kind} {spec!r}: arguments must be a mapping, got {kwargs!r}")
    args = dict(kwargs or {})
    if bad := [k for k in args if not isinstance(k, str)]:
        raise PolicyLoadError(f"{kind} {spec!r}: argument names must be strings, got {bad!r}")
    factory = builtins.get(spec) or _resolve(spec, builtins, kind)
    try:
        inspect.signature(factory).bind(**args)
    except TypeError as exc:
        raise PolicyLoadError(f"{kind} {spec!r} does not accept arguments {args}: {exc}") from exc
    except ValueError:
        pass  # no introspectable signature (a builtin or C type): let the call decide
    try:
        return factory(**args)
    except Exception as exc:
        raise PolicyLoadError(
            f"{kind} {spec!r} raised {exc!r} when constructed with {args}"
        ) from exc


def _resolve(spec: str, builtins: Mapping[str, Callable[..., Any]], kind: str) -> Any:
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise PolicyLoadError(
            f"unknown {kind} {spec!r}: expected one of {sorted(builtins)} "
            "or a dotted path 'package.module:Name'"
        )
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # a plugin's import may fail in any way, not only ImportError
        raise PolicyLoadError(f"{kind} {spec!r}: cannot import {module_name!r}: {exc!r}") from exc
    obj: Any = module
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise PolicyLoadError(
                f"{kind} {spec!r}: module {module_name!r} has no attribute {attr!r}"
            ) from None
    if not callable(obj):
        raise PolicyLoadError(f"{kind} {spec!r}: {attr!r} is not a class or factory ({obj!r})")
    return obj


def _require(spec: str, obj: Any, kind: str, what: str, methods: tuple[str, ...]) -> None:
    missing = [m for m in methods if not callable(getattr(obj, m, None))]
    if missing:
        raise PolicyLoadError(
            f"{kind} {spec!r} built {obj!r}, which is not {what}: no {', '.join(missing)}()"
        )
    name = getattr(obj, "name", None)
    if not isinstance(name, str) or not name:
        raise PolicyLoadError(f"{kind} {spec!r} built {obj!r}, which has no `name` string")


# -- smoke calls ----------------------------------------------------------------------------


def _smoke_request() -> RequestInfo:
    return RequestInfo(
        request_id="policy-load-smoke", model="smoke", prompt_tokens=32, max_tokens=16
    )


def _smoke_view() -> ClusterView:
    layout = KVLayout(model="smoke", kv_heads=1, head_dim=8)
    return ClusterView(
        prefill=(PrefillView("smoke-p0", layout),),
        decode=(DecodeView("smoke-d0", layout, capacity_blocks=1024),),
        kv_bytes_per_token=64,
    )


def _smoke_policy(spec: str, policy: Any) -> None:
    """One request on a 1-prefill, 1-decode cluster with plenty of room.

    The call runs on a copy when the policy can be copied, so its RNG and counters start from
    their initial state for the real traffic (same seed, same decisions).
    """
    try:
        probe = copy.deepcopy(policy)
    except Exception:
        probe = policy
    view = _smoke_view()
    try:
        decision = probe.place(_smoke_request(), view)
    except Exception as exc:
        raise PolicyLoadError(
            f"policy {spec!r} raised {exc!r} on a smoke request (1 prefill, 1 decode worker)"
        ) from exc
    if isinstance(decision, Rejection):
        return  # a policy may refuse for its own reasons; what it returned is well-formed
    if not isinstance(decision, Placement):
        raise PolicyLoadError(
            f"policy {spec!r} returned {decision!r} on a smoke request; "
            "expected a Placement or a Rejection"
        )
    known_p = {p.worker_id for p in view.prefill}
    known_d = {d.worker_id for d in view.decode}
    for c in decision.candidates:
        if not isinstance(c, Candidate):
            raise PolicyLoadError(f"policy {spec!r} returned a non-Candidate {c!r}")
        if c.decode_id not in known_d or (c.prefill_id is not None and c.prefill_id not in known_p):
            raise PolicyLoadError(
                f"policy {spec!r} returned {c!r}, naming a worker not in the cluster view"
            )


def _smoke_estimator(spec: str, estimator: Any) -> None:
    request = _smoke_request()
    try:
        keys = estimator.class_keys(request)
        estimate = estimator.estimate(request, {})
        bucket = estimator.bucket_of(100)
    except Exception as exc:
        raise PolicyLoadError(f"estimator {spec!r} raised {exc!r} on a smoke request") from exc
    if isinstance(keys, str) or not all(isinstance(k, str) for k in keys):
        raise PolicyLoadError(f"estimator {spec!r}: class_keys() must give strings, got {keys!r}")
    if not isinstance(estimate, OutputEstimate):
        raise PolicyLoadError(
            f"estimator {spec!r}: estimate() returned {estimate!r}, not an OutputEstimate"
        )
    if not isinstance(bucket, int) or bucket < 100:
        raise PolicyLoadError(
            f"estimator {spec!r}: bucket_of(100) returned {bucket!r}; "
            "buckets are ints, named by their upper bound"
        )


def _smoke_role_policy(spec: str, policy: Any) -> None:
    """One decision on a 1-prefill, 1-decode snapshot with a loaded prefill side."""
    try:
        probe = copy.deepcopy(policy)
    except Exception:
        probe = policy
    workers = (
        RoleWorkerView("smoke-a", "prefill", queued_prompt_tokens=50_000, capacity_blocks=1024),
        RoleWorkerView("smoke-b", "decode", capacity_blocks=1024, held_blocks=10),
    )
    snapshot = RoleSnapshot(now_s=100.0, workers=workers, prefill_demand_tokens_per_s=20_000.0)
    try:
        plan = probe.decide(snapshot)
    except Exception as exc:
        raise PolicyLoadError(
            f"role policy {spec!r} raised {exc!r} on a smoke snapshot (2 workers)"
        ) from exc
    if not isinstance(plan, RolePlan):
        raise PolicyLoadError(f"role policy {spec!r} returned {plan!r}; expected a RolePlan")
    known = {w.worker_id for w in workers}
    for sw in plan.switches:
        if getattr(sw, "worker_id", None) not in known or sw.to_role not in ("prefill", "decode"):
            raise PolicyLoadError(
                f"role policy {spec!r} returned {sw!r}, naming an unknown worker or role"
            )


def _smoke_fairness(spec: str, policy: Any) -> None:
    """Two tenants' requests through the whole cycle: each pick must name a waiting request
    (and none once the rest are skipped or gone), each admission give a `Charge`."""
    try:
        probe = copy.deepcopy(policy)
    except Exception:
        probe = policy
    cost = AdmissionCost(decode_block_s=100.0, prefill_tokens=32)
    waiting = {
        r.ticket: r
        for r in (
            WaitingRequest(1, Tenant("smoke-a"), 0, cost),
            WaitingRequest(2, Tenant("smoke-b", weight=2.0), 0, cost),
        )
    }
    what = "on a smoke queue (2 tenants, 1 request each)"
    try:
        for request in waiting.values():
            probe.enqueue(request)
        first = _check_pick(spec, probe.pick(0.0), waiting, what)
        second = _check_pick(spec, probe.pick(0.0, skip={first.ticket}), waiting, what)
        if second.ticket == first.ticket or probe.pick(0.0, skip=set(waiting)) is not None:
            raise PolicyLoadError(f"fairness policy {spec!r} picked a skipped request {what}")
        charge = probe.admit(first)
        if not isinstance(charge, Charge):
            raise PolicyLoadError(
                f"fairness policy {spec!r}: admit() returned {charge!r}, not a Charge"
            )
        probe.settle(charge, cost)
        probe.withdraw(second.ticket)
        if (left := probe.pick(0.0)) is not None:
            raise PolicyLoadError(
                f"fairness policy {spec!r} picked {left!r} with nothing waiting {what}"
            )
    except PolicyLoadError:
        raise
    except Exception as exc:
        raise PolicyLoadError(f"fairness policy {spec!r} raised {exc!r} {what}") from exc


def _check_pick(
    spec: str, picked: Any, waiting: Mapping[int, WaitingRequest], what: str
) -> WaitingRequest:
    if not isinstance(picked, WaitingRequest) or waiting.get(picked.ticket) != picked:
        raise PolicyLoadError(
            f"fairness policy {spec!r}: pick() returned {picked!r} {what}; "
            "expected one of the waiting requests"
        )
    return picked
