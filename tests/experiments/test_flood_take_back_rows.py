"""The flood over two replicas (disagg_tools/experiments/flood.py `placements`) with one fair
share for the cluster: room taken back by default under vtc, its preemptions per 1,000 requests
counted by reason in each row, and none of them without it (`take_back=False`). A short seeded
run; what is asserted is the rows' bookkeeping, not the targets."""

from __future__ import annotations

import math
from typing import Any

from disagg_tools.experiments.flood import FloodSetup, placements, preemption_reasons_table
from disagg_tools.simcluster.fair_takeback import FAIR_SHARE, PRIORITY

SETUP = FloodSetup(duration_s=30.0, warmup_s=5.0, pool=200)
CAPACITY_RPS = 34.2  # docs/benchmarks.md, "The simulator's rows"


def _row(take_back: bool) -> dict[str, Any]:
    pool = SETUP.lengths()
    # `one`, 30 s: the take-back fires in the window (by demand since 1819d3a). In 20 s it fired
    # there no more once a new waiter line got its timed sync (router/fair_share.py `waits`):
    # the victim's first waits were served before its demand fitted its share.
    (row,) = placements(
        SETUP, pool, CAPACITY_RPS, ["one"], policies=["vtc"], shared=True, take_back=take_back
    )
    return row


def test_rows_count_the_take_backs_by_reason() -> None:
    on, off = _row(True), _row(False)
    for row in (on, off):
        by = row["preemptions_per_1k_by_reason"]
        assert math.isclose(sum(by.values()), row["preemptions_per_1k"])
    on_by, off_by = on["preemptions_per_1k_by_reason"], off["preemptions_per_1k_by_reason"]
    assert on["take_back"] is True and off["take_back"] is False
    assert on_by[FAIR_SHARE] > 0 and on_by[PRIORITY] == 0  # one class: the share's rule only
    assert off_by[FAIR_SHARE] == 0 and off_by[PRIORITY] == 0
    assert on["replicas"] == "one share for the cluster, room taken back"
    assert off["replicas"] == "one share for the cluster"
    assert "room taken back" in preemption_reasons_table([on, off])
