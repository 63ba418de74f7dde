"""CI versions of `python -m bench.load`: a 500-stream burst and a 500-request non-streaming
burst through one router subprocess (the shared Redis under this test's own key prefix), every
answer checked token for token against the simulated workers' text.

Select them with `pytest tests/test_load_ci.py` (marked `slow`). No timing is asserted: the
invariants are "every request ok or a clean 429" and "nothing left in the store once quiet".
"""

from __future__ import annotations

import pytest

from bench.load import LoadSpec, format_report, run
from bench.procs import ClusterSpec
from tests.conftest import REDIS_URL

pytestmark = [
    pytest.mark.slow,
    pytest.mark.xfail(strict=False, reason="awaiting store hardening on main"),
]


def _spec(redis_prefix: str, *, stream: bool) -> LoadSpec:
    cluster = ClusterSpec(redis="shared", shared_redis_url=REDIS_URL, key_prefix=redis_prefix)
    # Generous per-request deadline: a hang is a failure, a slow CI machine is not.
    return LoadSpec(
        mode="burst",
        n=500,
        stream=stream,
        output_tokens=16,
        deadline_s=150.0,
        quiet_timeout_s=40.0,
        cluster=cluster,
    )


@pytest.mark.timeout(300)
async def test_burst_of_500_streams_all_exact_and_nothing_left(redis_prefix: str) -> None:
    report = await run(_spec(redis_prefix, stream=True))
    print(format_report(report))
    assert report["violations"] == [], format_report(report)
    assert report["outcomes"].get("ok", 0) + report["outcomes"].get("shed", 0) == 500


@pytest.mark.timeout(300)
async def test_burst_of_500_whole_answers_all_exact_and_nothing_left(redis_prefix: str) -> None:
    report = await run(_spec(redis_prefix, stream=False))
    print(format_report(report))
    assert report["violations"] == [], format_report(report)
    assert report["outcomes"].get("ok", 0) + report["outcomes"].get("shed", 0) == 500
