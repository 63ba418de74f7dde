"""Per-tenant output-length classes (issue 31): one tenant's answers move only its estimates.

The output-length estimator (policies/estimators.py) learns from histograms shared by every
router replica. Shared by every tenant too, one tenant whose answers stop after 4 tokens under
max_tokens 2,000 sized every other tenant's reservations of that class on ~4 tokens. Here:

- `class_keys_for` (estimators.py) gives a named tenant's request its own classes
  (`t=<tenant>|<class>`, narrowest first) before the shared ones; a request of no tenant ("" or
  `default`: no tenants configured) has the shared classes only, exactly as before.
- `record_keys_for`: a tenant's answer goes into its own classes, and into a shared class only
  up to its share of it, so no tenant can own the shared classes a cold tenant uses as a prior.
- `own_classes`: where a live request's overruns count (policies/overruns.py): a tenant's own
  classes only.

    estimate time ──> record_keys_of(estimator, request, histograms read)  (kept with it)
    request done  ──> store.record_output(those keys, bucket)

The router (router/request/reserve.py, release.py) and the cluster simulator
(disagg_tools/simcluster/engine.py) both call these, so both run one rule.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from policies.base import OutputHistograms, OutputLengthEstimator, RequestInfo

__all__ = [
    "DEFAULT_MAX_PRIOR_SHARE",
    "DEFAULT_MIN_SAMPLES",
    "DEFAULT_PRIOR_TENANTS",
    "SHARED_TENANTS",
    "histogram_total",
    "is_own_class",
    "own_classes",
    "own_prefix",
    "record_keys_for",
    "record_keys_of",
    "record_rule",
]

DEFAULT_MIN_SAMPLES = 20
# A shared class serves a cold tenant as a prior once it holds this many tenants' worth of
# samples (x min_samples): no single tenant can warm it alone (it feeds at most min_samples
# while the class is small: `record_keys_for`).
DEFAULT_PRIOR_TENANTS = 2.0
# The share of a shared class one tenant may feed beyond its first min_samples answers.
# A quarter: at the smallest usable prior (2 x min_samples) the min_samples floor already lets
# one tenant hold half of it, whatever this share; from 4 x min_samples on a quarter holds it
# tighter, and the prior's margin shrinks with it (OnlineQuantileEstimator.prior_quantile: the
# 0.95 -> 0.925 quantile at q = 0.9). A half would loosen that for a slow, patient tenant; a
# smaller share would tighten it further for a prior made of fewer answers.
DEFAULT_MAX_PRIOR_SHARE = 0.25
# The tenants whose requests use the shared classes directly: none named (""), or the
# `default` tenant every request has when no tenants are configured (router/tenants.py
# DEFAULT_TENANT, the simulator's TenantRequest). Their answers are the deployment's own.
SHARED_TENANTS = frozenset({"", "default"})
_OWN_PREFIX = "t="


def own_prefix(tenant: str) -> str:
    """What a tenant's own classes start with (a tenant name has no `|`: router/tenants.py)."""
    return f"{_OWN_PREFIX}{tenant}|"


def is_own_class(key: str) -> bool:
    """Whether `key` is one tenant's own class (not a shared one)."""
    return key.startswith(_OWN_PREFIX)


def own_classes(keys: Sequence[str]) -> tuple[str, ...]:
    """The tenant's own classes among `keys`; all of `keys` when there are none (a request of
    no named tenant, or an estimator whose classes know no tenant)."""
    own = tuple(k for k in keys if is_own_class(k))
    return own if own else tuple(keys)


def histogram_total(histogram: Mapping[int, int] | None) -> int:
    """Answers counted in a histogram (a store may hand counts back as strings)."""
    if not histogram:
        return 0
    return sum(map(int, histogram.values()))


def record_keys_for(
    tenant: str,
    keys: Sequence[str],
    histograms: OutputHistograms,
    min_samples: int = DEFAULT_MIN_SAMPLES,
    max_prior_share: float = DEFAULT_MAX_PRIOR_SHARE,
) -> tuple[str, ...]:
    """The classes among `keys` (a request's, `class_keys_for`) its answer is counted in, from
    the `histograms` as they were when it was estimated (its completed answers; not the live
    overruns).

    Without a named tenant: every class, as before tenants. A named tenant's answer always goes
    into its own classes; into a shared class only while the tenant's own count in the matching
    own class is below max(min_samples, max_prior_share x the shared class's count). Its own
    count is at least what it fed the shared class, so one tenant holds at most its first
    min_samples answers of a shared class, or `max_prior_share` of it once the class is large:
    its share of the prior — and so how far it can move the prior's quantiles — is bounded
    whatever it sends. (Heavy tenants stop feeding early, so a large prior is mostly the first
    answers of many tenants: one tenant, a bounded vote. A tenant's later answers, and any shift
    in them, are its own classes' to learn.)

    The counts are those read at estimate time: requests of the tenant estimated before its
    crossing of the bound was visible (its requests in flight, and those within the histogram
    cache's refresh, on each router replica) may still feed the class past it. That slack is
    bounded by the tenant's concurrency, and a cold tenant's requests reserve max_tokens (or
    the prior), which bounds how many of them the decode workers hold at once.
    """
    if tenant in SHARED_TENANTS:
        return tuple(keys)
    prefix = own_prefix(tenant)
    own = [k for k in keys if k.startswith(prefix)]
    out = list(own)
    for key in keys:
        if is_own_class(key) or prefix + key not in own:
            continue  # another tenant's class, or a shared class with no own match: never fed
        have = histogram_total(histograms.get(prefix + key))
        # below max(min_samples, share x the class), the shared class's count read only if needed
        if have < min_samples or have < max_prior_share * histogram_total(histograms.get(key)):
            out.append(key)
    return tuple(out)


def record_keys_of(
    estimator: OutputLengthEstimator,
    request: RequestInfo,
    histograms: OutputHistograms,
    keys: Sequence[str] | None = None,
) -> tuple[str, ...]:
    """The classes `request`'s answer is to be counted in: `record_keys_for` on its classes
    (`keys` where the caller has them, else the estimator's), with the estimator's bounds
    (`record_rule`). `histograms`: the completed answers of its classes, as read to estimate
    it. The router and the simulator both call this at estimate time and record there at the
    end of the request."""
    if keys is None:
        keys = tuple(estimator.class_keys(request))
    if request.tenant in SHARED_TENANTS:
        return tuple(keys)
    min_samples, share = record_rule(estimator)
    return record_keys_for(request.tenant, keys, histograms, min_samples, share)


def record_rule(estimator: object) -> tuple[int, float]:
    """An estimator's (min_samples, max_prior_share): its own, else those of the estimator it
    falls back on (`HintEstimator`: the one whose classes a tenant's estimate reads), else the
    defaults."""
    source = estimator
    while not hasattr(source, "min_samples") and hasattr(source, "fallback"):
        source = source.fallback
    return (
        int(getattr(source, "min_samples", DEFAULT_MIN_SAMPLES)),
        float(getattr(source, "max_prior_share", DEFAULT_MAX_PRIOR_SHARE)),
    )
