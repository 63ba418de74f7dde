"""Output-length estimators: how much decode room to hold for an answer not yet written.

Learned predictors get only ~75 % of answers into the right 200-token bucket (TetriInfer), so the
router reserves against an upper quantile and corrects online (docs/design.md §6). Every router
replica learns from every completion through histograms in the state store:

    class_keys(request) ──> store.output_histograms(keys) ──> estimate(request, histograms)
    estimate time ──> record_keys_of(estimator, request, histograms)   (kept with the request)
    request done  ──> store.record_output(record keys, bucket_of(true length))

A named tenant is estimated on its own classes, the shared ones only a prior no single tenant
can pull down (`OnlineQuantileEstimator`), and feeds the shared classes only up to its share of
them (policies/tenant_classes.py, issue 31): one tenant's answers move only its own estimates.

Histograms count completions per bucket; a bucket is named by its upper bound, so the store keeps
ints and a quantile read from it never under-states the samples (a reservation errs on the safe
side by at most one bucket width). Bounds are exact up to 16 tokens, then 8 per octave (each about
9 % wider than the last), up to 2**24 tokens.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace

from policies.base import OutputEstimate, OutputHistograms, OutputLengthEstimator, RequestInfo
from policies.tenant_classes import (
    DEFAULT_MAX_PRIOR_SHARE,
    DEFAULT_MIN_SAMPLES,
    DEFAULT_PRIOR_TENANTS,
    SHARED_TENANTS,
    histogram_total,
    is_own_class,
    own_classes,
    own_prefix,
    record_keys_of,
)

__all__ = [
    "BUCKET_BOUNDS",
    "bucket_of",
    "histogram_quantiles",
    "asked_bucket",
    "class_keys_for",
    "own_classes",
    "record_keys_of",
    "MaxTokensEstimator",
    "HintEstimator",
    "OnlineQuantileEstimator",
    "OracleEstimator",
    "EstimateScore",
    "score_estimate",
]

_PER_OCTAVE = 8
_TOP_EXPONENT = 24
_REPORTED_QUANTILES = (0.5, 0.9, 0.99)
DEFAULT_PROMPT_BUCKETS = (256, 1024, 4096, 16384)


def _bucket_bounds() -> tuple[int, ...]:
    bounds = set(range(1, 17))
    for step in range(4 * _PER_OCTAVE, _TOP_EXPONENT * _PER_OCTAVE + 1):
        bounds.add(round(2 ** (step / _PER_OCTAVE)))
    return tuple(sorted(bounds))


BUCKET_BOUNDS: tuple[int, ...] = _bucket_bounds()


def bucket_of(output_tokens: int) -> int:
    """The bucket (its upper bound, an int) that counts an answer of `output_tokens` tokens."""
    i = bisect.bisect_left(BUCKET_BOUNDS, max(1, output_tokens))
    return BUCKET_BOUNDS[min(i, len(BUCKET_BOUNDS) - 1)]


def histogram_quantiles(
    histogram: Mapping[int, int], quantiles: Iterable[float]
) -> tuple[int, dict[float, int]]:
    """(sample count, {q: smallest bucket bound holding at least a q share of the samples}).

    Keys and counts are coerced with int(): a store may hand them back as strings. An empty
    histogram gives (0, {}).
    """
    items = sorted((int(k), int(v)) for k, v in histogram.items() if int(v) > 0)
    total = sum(v for _, v in items)
    if total == 0:
        return 0, {}
    out: dict[float, int] = {}
    for q in sorted(set(quantiles)):
        # The rank of the q-quantile sample; the epsilon keeps 0.9 * 10 from rounding up to 10.
        rank = max(1, math.ceil(q * total - 1e-9))
        cumulative = 0
        for bound, count in items:
            cumulative += count
            if cumulative >= rank:
                out[q] = bound
                break
    return total, out


def _prompt_label(prompt_tokens: int, prompt_buckets: Sequence[int]) -> str:
    i = bisect.bisect_left(prompt_buckets, prompt_tokens)
    return str(prompt_buckets[i]) if i < len(prompt_buckets) else "inf"


def asked_bucket(max_tokens: int) -> int:
    """The power of two at or above what the client asked for (`max_tokens`, at least 16).

    Coarse on purpose: a class per distinct cap would never warm up, and within a factor of two
    of the cap an answer's length is the client's, not the cap's."""
    return 1 << max(4, (max(1, max_tokens) - 1).bit_length())


def class_keys_for(
    request: RequestInfo,
    prompt_buckets: Sequence[int] = DEFAULT_PROMPT_BUCKETS,
    use_hint: bool = True,
) -> tuple[str, ...]:
    """Statistics classes of a request, narrowest first, ending with "*|a=<asked bucket>".

    What the client asked for (`max_tokens`, bucketed) is in every class: answers learned
    under a 300-token cap say nothing of one asked for 4,000, and a wider class that mixes caps
    would hand the short answers' quantile to the long ones (an over-commit the day the
    answers shift). Within one asked bucket the model matters, and the prompt length does for
    most workloads (summaries are short, chat answers are not); a client's hint, bucketed,
    separates requests the client knows to be long from the rest.

    A named tenant's request (`request.tenant` not in SHARED_TENANTS) has its own copy of each
    class first (`t=<tenant>|<class>`, narrowest first), then the shared classes: its own
    answers are what it is estimated on, the shared ones only a prior while its own are cold
    (`OnlineQuantileEstimator`). One tenant's answers that stop early then lower no other
    tenant's reservations (issue 31: 25 answers of 4 tokens under max_tokens 2,000 sized
    another tenant's n = 16 x 2,000 on ~4 tokens a choice).
    """
    asked = f"a={asked_bucket(request.max_tokens)}"
    model = f"m={request.model}|{asked}"
    prompt = _prompt_label(request.prompt_tokens, prompt_buckets)
    by_prompt = f"m={request.model}|p={prompt}|{asked}"
    widest = f"*|{asked}"
    if use_hint and request.hint_output_tokens is not None:
        hinted = f"{by_prompt}|h={bucket_of(request.hint_output_tokens)}"
        shared: tuple[str, ...] = (hinted, by_prompt, model, widest)
    else:
        shared = (by_prompt, model, widest)
    if request.tenant in SHARED_TENANTS:
        return shared
    prefix = own_prefix(request.tenant)
    return tuple(prefix + k for k in shared) + shared


def _cold(request: RequestInfo, source: str = "max_tokens") -> OutputEstimate:
    return OutputEstimate(reserve_tokens=max(1, request.max_tokens), source=source)


class MaxTokensEstimator:
    """Reserve for max_tokens: never overruns, wastes the most room. The safe baseline."""

    name = "max_tokens"

    def class_keys(self, request: RequestInfo) -> tuple[str, ...]:
        # Statistics are still recorded, so switching to a learning estimator starts warm.
        return class_keys_for(request)

    def estimate(self, request: RequestInfo, histograms: OutputHistograms) -> OutputEstimate:
        return _cold(request)

    def bucket_of(self, output_tokens: int) -> int:
        return bucket_of(output_tokens)

    def __repr__(self) -> str:
        return "MaxTokensEstimator()"


class HintEstimator:
    """Use the client's `X-Expected-Output-Tokens` hint (`request.hint_output_tokens`).

    The hint is an expectation, not a bound: `headroom` multiplies it (1.2 holds 20 % more), and
    the result is capped by max_tokens. A hint is advisory: it may raise the reservation above
    what `fallback` (max_tokens by default, the safe choice) would hold without it, never lower
    it, unless the caller is trusted (`request.hint_trusted`) — otherwise one client sending
    `1` on answers of thousands of tokens over-commits a decode worker. Requests without a hint
    go to `fallback`.
    """

    name = "hint"

    def __init__(
        self, fallback: OutputLengthEstimator | None = None, headroom: float = 1.0
    ) -> None:
        if headroom <= 0:
            raise ValueError(f"headroom must be > 0, got {headroom}")
        fb: OutputLengthEstimator = MaxTokensEstimator() if fallback is None else fallback
        for attr in ("class_keys", "estimate", "bucket_of"):
            if not callable(getattr(fb, attr, None)):
                raise TypeError(f"fallback {fb!r} is not an output-length estimator (no {attr}())")
        self.fallback = fb
        self.headroom = headroom

    def class_keys(self, request: RequestInfo) -> tuple[str, ...]:
        # The un-hinted request's classes too: the advisory check estimates it without the hint.
        keys = tuple(self.fallback.class_keys(request))
        if request.hint_output_tokens is None:
            return keys
        plain = self.fallback.class_keys(replace(request, hint_output_tokens=None))
        return keys + tuple(k for k in plain if k not in keys)

    def estimate(self, request: RequestInfo, histograms: OutputHistograms) -> OutputEstimate:
        hint = request.hint_output_tokens
        if hint is None or hint <= 0:
            return self.fallback.estimate(request, histograms)
        reserve = max(1, min(request.max_tokens, math.ceil(hint * self.headroom)))
        if request.hint_trusted:
            return OutputEstimate(reserve_tokens=reserve, source="hint (trusted)")
        plain = self.fallback.estimate(replace(request, hint_output_tokens=None), histograms)
        if plain.reserve_tokens >= reserve:
            return replace(plain, source=f"{plain.source}; hint {hint} not below it")
        return OutputEstimate(reserve_tokens=reserve, source="hint (above the estimate)")

    def bucket_of(self, output_tokens: int) -> int:
        return bucket_of(output_tokens)

    def __repr__(self) -> str:
        return f"HintEstimator(fallback={self.fallback!r}, headroom={self.headroom})"


class OnlineQuantileEstimator:
    """Reserve the `quantile` of the narrowest statistics class with `min_samples` answers.

    Classes (see `class_keys_for`) go from narrow (model, prompt bucket, hint bucket) to any
    model, always within what the client asked for (the `max_tokens` bucket). A
    narrow class is more specific but slower to warm up; falling back to wider classes keeps the
    estimate learned rather than max_tokens as soon as the model has any history. Cold
    everywhere, it reserves max_tokens: a new deployment over-reserves rather than over-commits.

    A named tenant is estimated on its own classes first. Cold in all of them, it may use a
    shared class as a prior, once that holds `prior_tenants` x `min_samples` answers (more than
    one tenant can have fed it: `record_keys_for`), and at a raised quantile that no single
    tenant can pull down: with one tenant holding a share f <= s of the class (s = the bound
    in force, `prior_quantile`), the class's (q + s(1 - q))-quantile is at least the
    q-quantile of the other tenants' answers — every sample below that point is either the
    tenant's (f) or one of the others' below their q-quantile (< q of 1 - f), and
    f + (1 - f) q <= s + (1 - s) q. So the prior costs a cold tenant a little more room
    (the 0.95 rather than the 0.9 quantile, by default) and no tenant's short answers size
    another's reservation.
    """

    name = "online_quantile"

    def __init__(
        self,
        quantile: float = 0.9,
        min_samples: int = DEFAULT_MIN_SAMPLES,
        prompt_buckets: Sequence[int] = DEFAULT_PROMPT_BUCKETS,
        use_hint: bool = True,
        prior_tenants: float = DEFAULT_PRIOR_TENANTS,
        max_prior_share: float = DEFAULT_MAX_PRIOR_SHARE,
    ) -> None:
        if not 0.0 < quantile < 1.0:
            raise ValueError(f"quantile must be within (0, 1), got {quantile}")
        if min_samples < 1:
            raise ValueError(f"min_samples must be >= 1, got {min_samples}")
        buckets = tuple(int(b) for b in prompt_buckets)
        if any(b <= 0 for b in buckets) or list(buckets) != sorted(set(buckets)):
            raise ValueError(f"prompt_buckets must be positive and increasing, got {buckets}")
        if not prior_tenants >= 1:
            raise ValueError(f"prior_tenants must be >= 1, got {prior_tenants}")
        if not 0.0 < max_prior_share <= 1.0:
            raise ValueError(f"max_prior_share must be within (0, 1], got {max_prior_share}")
        self.quantile = quantile
        self.min_samples = min_samples
        self.prompt_buckets = buckets
        self.use_hint = use_hint
        self.prior_tenants = float(prior_tenants)
        self.max_prior_share = float(max_prior_share)
        self._asked = tuple(sorted({*_REPORTED_QUANTILES, quantile}))

    def class_keys(self, request: RequestInfo) -> tuple[str, ...]:
        return class_keys_for(request, self.prompt_buckets, self.use_hint)

    def prior_quantile(self, prior_total: int) -> float:
        """The quantile a cold tenant reserves of a shared class of `prior_total` answers.

        One tenant holds at most s = max(max_prior_share, min_samples / total) of it
        (`record_keys_for`); the (q + s(1 - q))-quantile is then at least the others'
        q-quantile (class docstring)."""
        share = min(1.0, max(self.max_prior_share, self.min_samples / max(1, prior_total)))
        return self.quantile + share * (1.0 - self.quantile)

    def estimate(self, request: RequestInfo, histograms: OutputHistograms) -> OutputEstimate:
        keys = self.class_keys(request)
        found = self._from_classes(request, keys, histograms)
        if not self.use_hint or request.hint_output_tokens is None or request.hint_trusted:
            return found
        # A hint is advisory: its class may hold more room than the plain classes, not less.
        plain_keys = self.class_keys(replace(request, hint_output_tokens=None))
        plain = self._from_classes(request, plain_keys, histograms)
        return plain if plain.reserve_tokens > found.reserve_tokens else found

    def _from_classes(
        self, request: RequestInfo, keys: Sequence[str], histograms: OutputHistograms
    ) -> OutputEstimate:
        named = request.tenant not in SHARED_TENANTS
        # A named tenant's own classes first; the shared ones are its prior (below).
        priors = [k for k in keys if not is_own_class(k)] if named else []
        for key in keys:
            if named and not is_own_class(key):
                continue
            histogram = histograms.get(key)
            if not histogram:
                continue
            total, qs = histogram_quantiles(histogram, self._asked)
            if total >= self.min_samples:
                return self._capped(request, self.quantile, qs, f"class {key}")
        for key in priors:
            histogram = histograms.get(key)
            if not histogram or histogram_total(histogram) < self.prior_tenants * self.min_samples:
                continue
            q = self.prior_quantile(histogram_total(histogram))
            _, qs = histogram_quantiles(histogram, (*self._asked, q))
            return self._capped(
                request, q, qs, f"prior class {key} at q={q:.3f} (tenant {request.tenant} cold)"
            )
        return _cold(request, source="max_tokens (no class has enough samples)")

    @staticmethod
    def _capped(
        request: RequestInfo, q: float, qs: Mapping[float, int], source: str
    ) -> OutputEstimate:
        # No answer is longer than max_tokens, whatever the class's history says.
        cap = max(1, request.max_tokens)
        capped = {p: max(1, min(cap, v)) for p, v in qs.items()}
        return OutputEstimate(reserve_tokens=capped[q], quantiles=capped, source=source)

    def bucket_of(self, output_tokens: int) -> int:
        return bucket_of(output_tokens)

    def __repr__(self) -> str:
        return (
            f"OnlineQuantileEstimator(quantile={self.quantile}, min_samples={self.min_samples}, "
            f"prompt_buckets={self.prompt_buckets}, use_hint={self.use_hint}, "
            f"prior_tenants={self.prior_tenants}, max_prior_share={self.max_prior_share})"
        )


class OracleEstimator:
    """BENCHMARKS ONLY: treats `request.hint_output_tokens` as the TRUE output length.

    The benchmark replayer knows each trace request's real answer length and sends it as the
    hint, so this estimator shows the best any estimator could do (no overrun, no waste). In
    production a hint is a guess, and reserving exactly a guess over-commits decode memory: use
    `HintEstimator` (with headroom) or `OnlineQuantileEstimator` there. Without a hint it
    reserves max_tokens.
    """

    name = "oracle"

    def class_keys(self, request: RequestInfo) -> tuple[str, ...]:
        return class_keys_for(request, use_hint=False)

    def estimate(self, request: RequestInfo, histograms: OutputHistograms) -> OutputEstimate:
        truth = request.hint_output_tokens
        if truth is None or truth <= 0:
            return _cold(request)
        reserve = max(1, min(request.max_tokens, truth))
        return OutputEstimate(reserve_tokens=reserve, source="oracle")

    def bucket_of(self, output_tokens: int) -> int:
        return bucket_of(output_tokens)

    def __repr__(self) -> str:
        return "OracleEstimator()"


@dataclass(frozen=True, slots=True)
class EstimateScore:
    """How one estimate fared against the answer's true length (for the router's metrics).

    `overrun`: the answer outgrew its reservation (the router had to grow it, or over-committed).
    `unused_tokens`: reserved but never written, the "reserved-but-unused decode capacity" of
    docs/design.md §7. `error_tokens` = predicted - actual (positive: over-reserved).
    """

    predicted_tokens: int
    actual_tokens: int
    error_tokens: int
    relative_error: float
    overrun: bool
    unused_tokens: int


def score_estimate(predicted: OutputEstimate | int, actual_tokens: int) -> EstimateScore:
    """Score a reservation (an `OutputEstimate` or its token count) against the true length."""
    tokens = predicted.reserve_tokens if isinstance(predicted, OutputEstimate) else int(predicted)
    actual = max(0, int(actual_tokens))
    error = tokens - actual
    return EstimateScore(
        predicted_tokens=tokens,
        actual_tokens=actual,
        error_tokens=error,
        relative_error=error / max(1, actual),
        overrun=actual > tokens,
        unused_tokens=max(0, error),
    )
