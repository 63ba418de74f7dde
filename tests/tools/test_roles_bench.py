"""Smoke tests of disagg_tools/experiments/elastic_roles.py on a synthetic workload and a tiny
cluster: the instruments run and their tables are complete (docs/elastic-roles.md holds the
numbers)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from disagg_tools.experiments import elastic_roles as br
from disagg_tools.experiments import elastic_roles_report as report
from disagg_tools.experiments.specs import ShapeSpec
from disagg_tools.traces import TraceRequest


def _workload(n: int = 200, warm: int = 50) -> br.Workload:
    rng = random.Random(1)
    t, reqs = 0.0, []
    for i in range(n):
        t += rng.expovariate(8.0)
        reqs.append(TraceRequest(t, rng.randint(100, 3000), rng.randint(1, 200), (), i))
    slos = [(2.0, 0.1)] * (n // 2) + [(10.0, 0.1)] * (n - n // 2)
    phases = [0] * (n // 2) + [1] * (n - n // 2)
    return br.Workload("synthetic", reqs, warm, slos, phases, reqs[:20], {}, ("a", "b"))


TINY = ShapeSpec("tiny", 1, 2, "llama-3-8b", capacity_blocks=4000)


def test_run_counts_only_measured_requests_against_their_own_slos() -> None:
    wl = _workload()
    fixed = br.run(wl, TINY, br.TWO_SIDED, 1.0)
    assert 0.0 <= fixed["attainment"] <= 1.0
    assert set(fixed["phase_attainment"]) == {0, 1}
    el = br.run(wl, TINY, br.TWO_SIDED, 3.0, role="elastic", detail=True)
    assert sum(n for _, n, _ in el["windows"]) == 150
    assert el["roles"]["timeline"]
    assert el["switches"] == len(el["roles"]["switches"])


def test_restretch_ramps_the_warm_up_and_keeps_the_rest() -> None:
    rows = [TraceRequest(float(i), 10, 1, (), i) for i in range(6)]
    out = br._restretch(rows, [2.0, 2.0, 2.0])
    assert [r.arrival_s for r in out] == [0.0, 2.0, 4.0, 5.0, 6.0, 7.0]


def _result(label: str, split: str, rps: float, **kw: object) -> dict:
    at = {"scale": 1.0, "switches": 2, "migrated": 1, "windows": [(0.0, 10, 1.0), (10.0, 9, 0.8)],
          "roles": {"timeline": [(0.0, 2, 6, 0.5, 0.1), (5.0, 3, 5, 0.4, 0.2)],
                    "switches": [{"t": 1.0, "drained_t": 2.0, "active_t": 4.0}]}}  # fmt: skip
    return {"workload": "conv", "shape": "8b-2p6d", "label": label, "split": split,
            "goodput_rps": rps, "goodput_scale": rps / 5, "at_goodput": at, **kw}  # fmt: skip


def test_tables_and_plot(tmp_path: Path) -> None:
    res = [
        _result("peer least_loaded", "2P:6D", 40.0),
        _result("fixed 2P:6D", "2P:6D", 41.0),
        _result("fixed 5P:3D", "5P:3D", 100.0),
        _result(report.ELASTIC, "2P:6D", 98.0),
        _result("local @25G", "0P:8D", 60.0, arrangement="local", link_gbps=25.0),
        _result("pool 5P:3D @25G", "5P:3D", 50.0, arrangement="pool", link_gbps=25.0),
        _result("hybrid 5P:3D @25G", "5P:3D", 70.0, arrangement="hybrid", link_gbps=25.0),
    ]
    cells = report.cell_table(res)
    assert (
        "| conv × 8b-2p6d (2P:6D) | 40.00 (least_loaded) | 41.00 | 100.00 (5P:3D) | 98.00 " in cells
    )
    assert "| 2.39 | 0.98 |" in cells
    assert "**100.00**" in report.splits_table(res)
    arr = report.arrangement_table(res)
    assert "| 60.00 | 50.00 (5P:3D) | 70.00 | 1.20 | hybrid |" in arr
    pytest.importorskip("matplotlib")
    assert report.plot_run(res[3], tmp_path / "p.png", "t", res[2])
    assert (tmp_path / "p.png").stat().st_size > 0
