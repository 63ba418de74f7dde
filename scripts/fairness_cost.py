"""What the admission-order policy (policies/fairness.py) costs the router per request.

    python scripts/fairness_cost.py [--requests 20000] [--depth 4] [--rounds 5]

A saturated queue in steady state: every tenant keeps `--depth` requests waiting (one tenant,
the aggressor, ten times as many) in two priority classes, and each request goes through what
the router will do with it: `enqueue`, `pick`, `admit` (its estimate charged) and, a few
admissions later, `settle` (the actual cost). One more column adds a backfill: a second `pick`
skipping the first. Timed with the thread's CPU clock over `--requests` requests, the best and
the median of `--rounds` rounds, for 2, 10 and 1,000 tenants. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections import deque
from collections.abc import Callable

from policies.base import AdmissionCost, Charge, FairnessPolicy, Tenant, WaitingRequest
from policies.fairness import FifoFairness, VTCFairness

SETTLE_LAG = 64  # admissions between a request's admission and its end


def make_requests(tenants: int, count: int, seed: int) -> list[WaitingRequest]:
    """`count` requests over `tenants` tenants (weights 1-4; class 0 or 1), drawn up front."""
    rng = random.Random(seed)
    people = [Tenant(f"t{i}", weight=float(1 + i % 4), priority=i % 2) for i in range(tenants)]
    people.extend([people[0]] * 9 * max(1, tenants // 10))  # tenant 0 floods
    requests = []
    for ticket in range(count):
        tenant = rng.choice(people)
        cost = AdmissionCost(rng.uniform(50.0, 5000.0), rng.randint(100, 4000))
        requests.append(WaitingRequest(ticket, tenant, tenant.priority, cost, float(ticket)))
    return requests


def run(
    policy: FairnessPolicy, requests: list[WaitingRequest], backlog: int, backfill: bool
) -> int:
    """Drive `policy` through the requests; the thread CPU nanoseconds it took."""
    for request in requests[:backlog]:
        policy.enqueue(request)
    pending: deque[tuple[Charge, AdmissionCost]] = deque()
    rest = requests[backlog:]
    start = time.thread_time_ns()
    for request in rest:
        policy.enqueue(request)
        chosen = policy.pick(request.since_s)
        assert chosen is not None
        if backfill:
            policy.pick(request.since_s, skip=(chosen.ticket,))
        pending.append((policy.admit(chosen), chosen.cost))
        if len(pending) > SETTLE_LAG:
            charge, cost = pending.popleft()
            policy.settle(charge, AdmissionCost(cost.decode_block_s * 0.7, cost.prefill_tokens))
    return time.thread_time_ns() - start


def measure(
    factory: Callable[[], FairnessPolicy], tenants: int, args: argparse.Namespace, backfill: bool
) -> tuple[float, float]:
    """(best, median) µs per request over the rounds."""
    backlog = args.depth * (tenants + 9 * max(1, tenants // 10))
    requests = make_requests(tenants, backlog + args.requests, seed=tenants)
    times = [
        run(factory(), requests, backlog, backfill) / args.requests / 1000
        for _ in range(args.rounds)
    ]
    return min(times), statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=20_000)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    policies: dict[str, Callable[[], FairnessPolicy]] = {"fifo": FifoFairness, "vtc": VTCFairness}
    print("| tenants | policy | µs / request (best, median) | with a backfill pick |")
    print("|---:|---|---:|---:|")
    for tenants in (2, 10, 1000):
        for name, factory in policies.items():
            plain = measure(factory, tenants, args, backfill=False)
            backfilled = measure(factory, tenants, args, backfill=True)
            print(
                f"| {tenants:,} | {name} | {plain[0]:.1f}, {plain[1]:.1f} "
                f"| {backfilled[0]:.1f}, {backfilled[1]:.1f} |"
            )


if __name__ == "__main__":
    main()
