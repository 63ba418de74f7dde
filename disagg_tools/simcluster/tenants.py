"""Synthetic tenants for the cluster simulator (issue 25): who each request of a run is for.

A trace has no tenants, so a run gives its requests some, in one of two documented ways:

- `assign_tenants(requests, mix, seed)`: the trace's own arrivals, each request drawn for a
  tenant with probability proportional to the tenant's `rate` (a share of the trace's traffic);
- `tenant_streams(pool, mix, duration_s, seed)`: each tenant its own Poisson stream at `rate`
  requests/s for `duration_s`, every request's lengths (and prefix hashes) drawn from `pool`
  (a trace's requests), merged in arrival order. This is how a flood is written: a victim at
  its share, an aggressor at ten times its own.

A mix is a tuple of `TenantLoad`s; `parse_mix("victim:1:4,aggressor:1:40")` reads the CLI form
`name:weight:rate[:priority]`. The result is a list of `TenantRequest`, which `simulate` reads
as any trace request plus its `tenant` name; `tenant_table(mix)` gives the `Tenant`s (weight,
priority) the fairness policy orders by. Everything is deterministic under the seed.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from disagg_tools.simcluster.engine import TraceLike
from policies.base import Tenant

__all__ = [
    "TenantLoad",
    "TenantRequest",
    "assign_tenants",
    "parse_mix",
    "tenant_streams",
    "tenant_table",
]


@dataclass(frozen=True, slots=True)
class TenantLoad:
    """One tenant of a mix: its fair-share `weight`, its priority class and what it sends
    (`rate`: requests/s for `tenant_streams`, a relative share for `assign_tenants`)."""

    name: str
    weight: float = 1.0
    rate: float = 1.0
    priority: int = 0

    def __post_init__(self) -> None:
        if not self.name or not self.weight > 0 or not self.rate >= 0:
            raise ValueError(f"tenant load {self!r}: a name, weight > 0 and rate >= 0")


@dataclass(frozen=True, slots=True)
class TenantRequest:
    """A trace request with the tenant it is for (`simulate` reads `tenant`)."""

    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    prefix_hash_ids: tuple[int, ...] = ()
    tenant: str = "default"


def parse_mix(spec: str) -> tuple[TenantLoad, ...]:
    """`name:weight:rate[:priority],...` -> the mix."""
    out = []
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            continue
        fields = part.split(":")
        if not 3 <= len(fields) <= 4:
            raise ValueError(f"tenant {part!r}: expected name:weight:rate[:priority]")
        prio = int(fields[3]) if len(fields) == 4 else 0
        out.append(TenantLoad(fields[0], float(fields[1]), float(fields[2]), prio))
    if len({t.name for t in out}) != len(out):
        raise ValueError(f"tenant names repeat in {spec!r}")
    return tuple(out)


def tenant_table(mix: Sequence[TenantLoad]) -> dict[str, Tenant]:
    """The policy's view of each tenant of the mix."""
    return {t.name: Tenant(t.name, t.weight, t.priority) for t in mix}


def assign_tenants(
    requests: Sequence[TraceLike], mix: Sequence[TenantLoad], seed: int = 0
) -> list[TenantRequest]:
    """The trace as it is, each request drawn for a tenant in proportion to its `rate`."""
    rng = random.Random(seed)
    names = [t.name for t in mix]
    rates = [t.rate for t in mix]
    return [
        TenantRequest(
            r.arrival_s,
            r.prompt_tokens,
            r.output_tokens,
            tuple(r.prefix_hash_ids),
            rng.choices(names, rates)[0],
        )
        for r in requests
    ]


def tenant_streams(
    pool: Sequence[TraceLike],
    mix: Sequence[TenantLoad],
    duration_s: float,
    seed: int = 0,
) -> list[TenantRequest]:
    """One Poisson stream per tenant at its `rate` for `duration_s`, lengths drawn from
    `pool`; each tenant has its own generator (seeded from `seed` and its name), so a
    victim's requests are the same whether the aggressor is in the mix or not."""
    if not pool:
        raise ValueError("tenant_streams needs a pool of requests to draw lengths from")
    out: list[TenantRequest] = []
    for t in mix:
        rng = random.Random(f"{seed}:{t.name}")
        clock = 0.0
        while t.rate > 0:
            clock += rng.expovariate(t.rate)
            if clock >= duration_s:
                break
            r = pool[rng.randrange(len(pool))]
            out.append(
                TenantRequest(
                    clock, r.prompt_tokens, r.output_tokens, tuple(r.prefix_hash_ids), t.name
                )
            )
    out.sort(key=lambda r: (r.arrival_s, r.tenant))
    return out
