"""Issue 31's poisoned estimate in the cluster simulator: what one tenant's short answers cost
another tenant, with per-tenant estimator classes and without them.

Tenant qc sends 25 requests of max_tokens 2,000 whose answers stop after 4 tokens (one every
0.2 s); from t = 10 s tenant b sends 80 requests of the same cap whose answers are 1,200-1,900
tokens (Poisson, `--rate` a second), on 1 prefill and 1 decode worker of 3,000 blocks.
`--shared` sends every request as no tenant's (the shared classes only: the rule before issue
31); `--no-poisoner` leaves qc out (the control). Prints b's estimates and what they cost:
answered, sequences preempted, the worst token gap, deterministic under `--seed`.

    python -m disagg_tools.simcluster.poisoned_estimate --rate 6 [--shared] [--no-poisoner]
"""

from __future__ import annotations

import argparse
import random
from collections.abc import Sequence

from disagg_tools.simcluster.config import ClusterConfig
from disagg_tools.simcluster.engine import simulate
from disagg_tools.simcluster.tenants import TenantRequest
from policies.base import OutputEstimate, OutputHistograms, RequestInfo
from policies.estimators import OnlineQuantileEstimator
from policies.two_sided import TwoSidedPolicy

__all__ = ["main", "scenario"]

CAP = 2000


class _Noting:
    """The online estimator, noting its estimates of the victim's requests (index >= `first`:
    the simulator names a request by its index in the trace)."""

    def __init__(self, first: int) -> None:
        self.inner = OnlineQuantileEstimator(quantile=0.9, min_samples=20)
        self.name = self.inner.name
        self.min_samples = self.inner.min_samples
        self.max_prior_share = self.inner.max_prior_share
        self.first = first
        self.seen: list[int] = []

    def class_keys(self, request: RequestInfo) -> tuple[str, ...]:
        return self.inner.class_keys(request)

    def estimate(self, request: RequestInfo, histograms: OutputHistograms) -> OutputEstimate:
        got = self.inner.estimate(request, histograms)
        if int(request.request_id) >= self.first:
            self.seen.append(got.reserve_tokens)
        return got

    def bucket_of(self, output_tokens: int) -> int:
        return self.inner.bucket_of(output_tokens)


def scenario(rate: float, poisoner: bool, shared: bool, seed: int) -> list[TenantRequest]:
    """qc's requests (if `poisoner`), then b's; every one no tenant's when `shared`."""
    rng = random.Random(seed)
    qc, b = ("", "") if shared else ("qc", "b")
    requests = [TenantRequest(i * 0.2, 200, 4, tenant=qc) for i in range(25)] if poisoner else []
    t = 10.0
    for _ in range(80):
        t += rng.expovariate(rate)
        requests.append(TenantRequest(t, 200, rng.randint(1200, 1900), tenant=b))
    return requests


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--rate", type=float, default=6.0, help="b's requests a second")
    parser.add_argument("--shared", action="store_true", help="no tenants: the old rule")
    parser.add_argument("--no-poisoner", action="store_true", help="leave qc out")
    parser.add_argument("--seed", type=int, default=7)
    ns = parser.parse_args(argv)
    requests = scenario(ns.rate, not ns.no_poisoner, ns.shared, ns.seed)
    first = 0 if ns.no_poisoner else 25
    est = _Noting(first)
    cfg = ClusterConfig.homogeneous(1, 1, capacity_blocks=3000).with_(max_tokens=CAP)
    result = simulate(requests, cfg, TwoSidedPolicy(), est)
    victim = [r for r in result.records if r.index >= first]
    reserved = sorted(est.seen)
    ok = sum(r.outcome == "ok" for r in victim)
    print(
        f"b: {ok}/{len(victim)} answered, {sum(r.preemptions for r in victim)} preemptions, "
        f"worst token gap {max(r.max_gap_s for r in victim):.2f} s; its estimates (tokens a "
        f"choice): min {reserved[0]}, median {reserved[len(reserved) // 2]}"
    )


if __name__ == "__main__":
    main()
