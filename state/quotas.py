"""Tenants' quotas, kept in the store so that they hold across router replicas (issue 25).

A tenant may have three limits (router/tenants.py `TenantLimits`), all enforced here:

- **requests per minute** and **tokens per minute**: token buckets that hold one minute's worth
  (a tenant idle for a minute may send a minute's worth at once, then at the steady rate) and
  refill continuously (`rate = limit / 60` a second). A request takes one request and its
  expected tokens (prompt + expected output) when it is admitted; at its end the router
  corrects the tokens to what it really cost (`settle_quota`): an answer shorter than expected
  gives tokens back, a longer one takes more (the bucket may go below zero: the next requests
  wait for it to refill).
- **concurrent reserved decode blocks**: the blocks the tenant's requests hold, each a *hold*
  under the request's id with a lease (renewed by the replica that made it, like the decode
  reservation it stands for: a replica that dies stops renewing and its holds expire).

`take_quota` is atomic (one Lua script on one hash tag, `{t:<tenant>}`, so it runs on Redis
Cluster; one method with no await in the memory store): either every limit allows the request
and all are taken, or none is taken and the verdict names the limit that refused, with the time
after which the same request would be let through (`retry_after_s`: the bucket's refill time,
or for the blocks the soonest expected end of the tenant's holds). Where several refuse, the
longest wait is named: retrying sooner would be refused again.

Two rules keep a request that is larger than a limit from being refused forever: a request
whose tokens exceed the whole minute's worth is let through when the bucket is full (it takes
the bucket below zero), and one whose blocks exceed `max_reserved_blocks` when the tenant holds
nothing else.

The buckets' arithmetic is `take_quota_now` here; the Redis script (state/quota_scripts.py)
does the same steps, and the conformance suite (tests/state/test_quota_store.py) holds both to the
same results.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

__all__ = [
    "Buckets",
    "LIMIT_NAMES",
    "Quota",
    "QuotaTaken",
    "refill",
    "renew_holds_now",
    "resize_hold_now",
    "settle_quota_now",
    "take_quota_now",
]

LIMIT_NAMES = ("requests_per_minute", "tokens_per_minute", "max_reserved_blocks")
MINUTE_S = 60.0
# The shortest Retry-After a refusal names: a client told 0.01 s would only hammer the door.
MIN_RETRY_AFTER_S = 0.05


@dataclass(frozen=True, slots=True)
class Quota:
    """A tenant's limits; None: no such limit."""

    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    max_reserved_blocks: int | None = None

    def __post_init__(self) -> None:
        for name in LIMIT_NAMES:
            value = getattr(self, name)
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int) or value < 1
            ):
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")

    def __bool__(self) -> bool:
        return any(getattr(self, name) is not None for name in LIMIT_NAMES)

    def limit(self, name: str) -> int | None:
        value: int | None = getattr(self, name)
        return value


@dataclass(frozen=True, slots=True)
class QuotaTaken:
    """What `take_quota` did: `granted` (true: everything taken), else which limit refused and
    when the same request would be let through. `remaining_*`: what is left of each bucket
    after the call (None: no such limit), for the caller's rate-limit headers."""

    granted: bool
    limit: str = ""
    retry_after_s: float = 0.0
    remaining_requests: int | None = None
    remaining_tokens: int | None = None
    held_blocks: int = 0  # the tenant's held blocks after the call

    def __bool__(self) -> bool:
        return self.granted


@dataclass(slots=True)
class Buckets:
    """One tenant's quota state: its two buckets' levels at `at_s`, and its holds (id ->
    (blocks, lease expiry, expected end))."""

    requests: float | None = None  # None: full (never taken from, or the store lost it)
    tokens: float | None = None
    at_s: float = 0.0
    holds: dict[str, tuple[int, float, float]] = field(default_factory=dict)

    def purge(self, now: float) -> None:
        dead = [hid for hid, (_, expiry, _) in self.holds.items() if expiry <= now]
        for hid in dead:
            del self.holds[hid]

    @property
    def held_blocks(self) -> int:
        return sum(blocks for blocks, _, _ in self.holds.values())


def refill(level: float | None, limit: int, elapsed_s: float) -> float:
    """A bucket of `limit` a minute, `elapsed_s` after it was at `level` (None: full)."""
    if level is None:
        return float(limit)
    return min(float(limit), level + max(0.0, elapsed_s) * limit / MINUTE_S)


def _wait(short: float, limit: int) -> float:
    """Seconds for a bucket of `limit` a minute to gain `short`."""
    return short * MINUTE_S / limit


def take_quota_now(
    state: Buckets,
    quota: Quota,
    now: float,
    hold_id: str,
    tokens: int,
    blocks: int,
    lease_s: float,
    ends_in_s: float,
) -> QuotaTaken:
    """`take_quota` on `state` at `now` (the module docstring); changes `state` only when
    granted (and refills it either way). A repeated `hold_id` that is still held is granted
    again without taking anything twice (a retried call)."""
    state.purge(now)
    rpm, tpm, max_blocks = (
        quota.requests_per_minute,
        quota.tokens_per_minute,
        quota.max_reserved_blocks,
    )
    elapsed = now - state.at_s
    requests = refill(state.requests, rpm, elapsed) if rpm is not None else None
    level = refill(state.tokens, tpm, elapsed) if tpm is not None else None
    state.requests, state.tokens, state.at_s = requests, level, now
    if hold_id in state.holds:
        return _granted(state)
    refusals: list[tuple[float, str]] = []
    if rpm is not None and requests is not None and requests < 1.0:
        refusals.append((_wait(1.0 - requests, rpm), "requests_per_minute"))
    if tpm is not None and level is not None:
        need = min(float(tokens), float(tpm))  # larger than a minute's worth: a full bucket
        if level < need:
            refusals.append((_wait(need - level, tpm), "tokens_per_minute"))
    if max_blocks is not None and state.holds:
        held = state.held_blocks
        if held + blocks > max_blocks:
            soonest = min(end for _, _, end in state.holds.values())
            refusals.append((max(soonest - now, 1.0), "max_reserved_blocks"))
    if refusals:
        wait, name = max(refusals)
        return QuotaTaken(
            False,
            name,
            max(MIN_RETRY_AFTER_S, wait),
            _floor(requests),
            _floor(level),
            state.held_blocks,
        )
    if requests is not None:
        state.requests = requests - 1.0
    if level is not None:
        state.tokens = level - tokens
    if max_blocks is not None:
        state.holds[hold_id] = (blocks, now + lease_s, now + max(0.0, ends_in_s))
    return _granted(state)


def resize_hold_now(
    state: Buckets,
    quota: Quota,
    now: float,
    hold_id: str,
    blocks: int,
    lease_s: float,
    force: bool = False,
) -> QuotaTaken:
    """`resize_quota_hold` on `state`: the hold `hold_id` becomes `blocks` (what its request
    really holds now: a reservation grown, or a new try's), unless that takes the tenant past
    `max_reserved_blocks` — then nothing changes and the verdict names the limit. Shrinking is
    always granted, and `force` (the blocks are held on the worker whatever the count says: an
    honest count beats a refusal). Unlike `take_quota`, a request alone is not let past the
    limit: the router sizes a request's reservation within its tenant's limit, and an answer
    that outgrows the whole limit by itself is ended (router/request/holdings.py). A hold the
    store lost is put back at `blocks` under the same rule."""
    state.purge(now)
    max_blocks = quota.max_reserved_blocks
    if max_blocks is None:
        return _granted(state)
    held = state.holds.get(hold_id)
    old = held[0] if held is not None else 0
    others = state.held_blocks - old
    if not force and blocks > old and others + blocks > max_blocks:
        ends = [end for hid, (_, _, end) in state.holds.items() if hid != hold_id]
        soonest = min(ends, default=now)
        return QuotaTaken(
            False,
            "max_reserved_blocks",
            max(MIN_RETRY_AFTER_S, soonest - now, 1.0),
            held_blocks=state.held_blocks,
        )
    end = held[2] if held is not None else now + lease_s
    state.holds[hold_id] = (blocks, now + lease_s, end)
    return _granted(state)


def settle_quota_now(
    state: Buckets,
    quota: Quota,
    now: float,
    hold_id: str,
    correction: int,
    refund_request: bool = False,
) -> int:
    """`settle_quota` on `state`: drop the hold `hold_id` (returns its blocks, 0 when gone),
    add `correction` (actual − charged tokens) to the token bucket and, with `refund_request`,
    give the request back to the request bucket (the cluster refused it: not the tenant's
    doing). Both buckets are refilled to `now` first (they share `at_s`) and never go above
    their limits."""
    freed = state.holds.pop(hold_id, (0, 0.0, 0.0))[0] if hold_id else 0
    rpm, tpm = quota.requests_per_minute, quota.tokens_per_minute
    refund = refund_request and rpm is not None
    if (tpm is not None and correction) or refund:
        elapsed = now - state.at_s
        if rpm is not None:
            state.requests = refill(state.requests, rpm, elapsed)
            if refund:
                state.requests = min(float(rpm), state.requests + 1.0)
        if tpm is not None:
            state.tokens = min(float(tpm), refill(state.tokens, tpm, elapsed) - correction)
        state.at_s = now
    return freed


def renew_holds_now(
    state: Buckets, now: float, holds: Mapping[str, int], lease_s: float
) -> list[str]:
    """`renew_quota_holds` on `state`: every hold in `holds` ({id: blocks}) lives `lease_s`
    from `now`; one the store no longer had is put back (expected to end with its lease).
    Returns the ids put back."""
    state.purge(now)
    back: list[str] = []
    for hold_id, blocks in holds.items():
        held = state.holds.get(hold_id)
        if held is None:
            state.holds[hold_id] = (blocks, now + lease_s, now + lease_s)
            back.append(hold_id)
        else:
            state.holds[hold_id] = (held[0], now + lease_s, held[2])
    return back


def _granted(state: Buckets) -> QuotaTaken:
    return QuotaTaken(
        True,
        remaining_requests=_floor(state.requests),
        remaining_tokens=_floor(state.tokens),
        held_blocks=state.held_blocks,
    )


def _floor(level: float | None) -> int | None:
    return None if level is None else max(0, math.floor(level))
