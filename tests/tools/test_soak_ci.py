"""CI version of `python -m disagg_tools.loadgen.soak`: 60 seconds of trace traffic while workers
are SIGKILLed and restarted, a PRIVATE Redis (never the shared one) is SIGKILLed and restarted
empty, a few percent of worker answers fail and some clients vanish mid-stream.

Marked `slow`. No timing is asserted: the recovery check only asks that an exact answer follows
every fault before the traffic ends, and the quiet check waits three lease periods.
"""

from __future__ import annotations

import math

import pytest

from disagg_tools.loadgen.soak import DEFAULT_TRACE, SoakSpec, format_report, run

pytestmark = pytest.mark.slow


@pytest.mark.skipif(not DEFAULT_TRACE.is_file(), reason=f"no trace at {DEFAULT_TRACE}")
@pytest.mark.timeout(240)
async def test_soak_60s_with_faults_keeps_every_invariant() -> None:
    spec = SoakSpec(minutes=1.0, recovery_s=math.inf, quiet_s=3 * 6.0 + 10.0)
    report = await run(spec)
    print(format_report(report))
    assert report["violations"] == [], format_report(report)
    assert report["outcomes"].get("ok", 0) > 0
