"""What a stream taken back for others reserves when it resumes (issue 33;
router/request/reserve.py `rest_estimate`, router/request/lifecycle.py `_after_preemption`).

A growth's preemption means the estimate proved short: the continuation reserves its whole
remaining cap. A take-back (the fair share, a more urgent class) says nothing of the estimate:
reserving the whole cap then made the preempted tenant look over its share again (taken again,
and in the simulator two backlogged tenants' shares went 40 % off) and held room nobody used.
It now reserves the rest of what its try expected to decode."""

from __future__ import annotations

from dataclasses import replace

from policies.base import OutputEstimate, RequestInfo
from router.request.preemption import FAIR_SHARE, PRIORITY, TAKEN_BACK
from router.request.reserve import rest_estimate


def _info(prompt: int, max_tokens: int, reserve: int | None) -> RequestInfo:
    estimate = OutputEstimate(reserve) if reserve is not None else None
    return RequestInfo(
        request_id="r",
        model="m",
        prompt_tokens=prompt,
        max_tokens=max_tokens,
        arrival_s=0.0,
        estimate=estimate,
        block_size=16,
    )


def test_a_taken_back_stream_holds_the_rest_of_its_estimate_not_its_cap() -> None:
    before = _info(100, 4096, 300)  # expected 300 of a 4,096 cap
    continued = _info(100 + 120, 4096 - 120, None)  # 120 relayed: prompt and cap moved
    rest = rest_estimate(continued, before, 120)
    assert rest is not None
    assert rest.reserve_output_tokens == 180
    # The same room as before: prompt + answer, moved from the answer to the prompt.
    assert rest.prompt_tokens + rest.reserve_output_tokens == 100 + 300
    assert rest.reserve_output_tokens < continued.max_tokens


def test_within_the_remaining_cap_and_none_once_it_outgrew_its_estimate() -> None:
    before = _info(100, 200, 200)
    capped = rest_estimate(_info(200, 50, None), before, 100)  # 100 left, 50 of cap
    assert capped is not None and capped.reserve_output_tokens == 50
    grown = replace(before, estimate=OutputEstimate(150))
    assert rest_estimate(_info(250, 50, None), grown, 150) is None  # relayed all it expected
    assert rest_estimate(_info(300, 0, None), grown, 200) is None


def test_the_take_back_reasons() -> None:
    assert TAKEN_BACK == {FAIR_SHARE, PRIORITY} == {"fair_share", "priority"}
