"""The attempts cap (router/request/retry_policy.py) counts retries, not a preempted stream's
continuations: the router stopped those for room, no worker failed them."""

from __future__ import annotations

import pytest

from router.config import RetrySettings
from router.errors import Unavailable
from router.metrics import RouterMetrics
from router.request.attempt import LegFailure
from router.request.retry_policy import RetryPolicy
from router.retry_budget import RetryBudget
from state import MemoryStore


def _failure() -> LegFailure:
    return LegFailure("decode", "d0", Unavailable("d0 is overloaded", retry_after_s=1.0), True)


async def test_continuations_spend_no_attempt_and_retries_still_stop_at_the_cap() -> None:
    settings = RetrySettings(backoff_base_s=0.0, backoff_max_s=0.0)
    policy = RetryPolicy(settings, RetryBudget(MemoryStore(), settings), RouterMetrics(), "r1")
    policy.begin()
    policy.attempt()  # the first try
    for _ in range(5):  # preempted five times: each continuation is free
        policy.attempt(counted=False)
        await policy.wait_for_room()
    assert (policy.attempts, policy.counted) == (6, 1)
    await policy.before_retry(_failure())  # a retry: the second counted try may start
    policy.attempt()
    await policy.before_retry(_failure())
    policy.attempt()
    with pytest.raises(Unavailable, match="gave up after 3 attempts"):
        await policy.before_retry(_failure())
