"""Smoke tests of the simulator benchmark instruments (disagg_tools/experiments/ and the modules
it runs): tiny traces, tiny clusters, seconds in all. They check that each instrument runs and
yields complete, sane numbers, not the numbers themselves (docs/benchmarks.md holds those)."""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest

from disagg_tools import goodput
from disagg_tools.experiments import simruns, specs, tables
from disagg_tools.replay import calibration
from disagg_tools.traces import TraceRequest


def _trace(n: int = 60, rate: float = 4.0, seed: int = 0) -> list[TraceRequest]:
    rng = random.Random(seed)
    t, out = 0.0, []
    for i in range(n):
        t += rng.expovariate(rate)
        out.append(TraceRequest(t, rng.randint(50, 2000), rng.randint(1, 300), (), i))
    return out


TINY = specs.ShapeSpec("tiny", 1, 2, "llama-3-8b", capacity_blocks=400)
SPEC = specs.TraceSpec("t", "unused", None, 2.0, 0.1)


def _sane(row: dict) -> None:
    assert row["requests"] == row["ok"] + row["rejected"] + row["failed"]
    assert 0.0 <= row["slo_attainment"] <= 1.0
    for k in ("ttft_p99_s", "itl_p99_s", "stranded_byte_s", "reserved_unused_block_s"):
        assert math.isfinite(row[k]) and row[k] >= 0, k
    assert row["events"] > 0 and row["events_per_s"] > 0


@pytest.mark.parametrize("case", [*specs.CASES, *specs.VARIANTS], ids=lambda c: c.label)
def test_every_case_runs_on_a_tiny_cluster(case: specs.CaseSpec) -> None:
    row = simruns.run_case(_trace(), TINY, case, 2.0, SPEC, warmup=_trace(30, seed=1))
    _sane(row)
    assert row["case"] == case.label
    if "noreserve" in case.case:
        assert row["reserved_unused_block_s"] == 0


def test_goodput_search_brackets_and_bisects() -> None:
    def attainment(scale: float) -> float:  # falls with load, crosses 0.9 at 3.0
        return 1.0 if scale <= 3.0 else 0.5

    scale, points = goodput.goodput(attainment, start=1.0, precision=1.05)
    assert 3.0 / 1.05 <= scale <= 3.0
    assert all(a in (1.0, 0.5) for _, a in points)
    assert goodput.goodput(lambda s: 0.0, lo_limit=0.25)[0] == 0.0
    assert goodput.goodput(lambda s: 1.0, hi_limit=8.0)[0] == 8.0


def test_goodput_on_the_simulator_is_monotone_sane() -> None:
    reqs = _trace(50)
    case = specs.CaseSpec("least_loaded", "least_loaded/noreserve", baseline=True)
    scale, points = goodput.goodput(
        lambda s: float(simruns.run_case(reqs, TINY, case, s, SPEC)["slo_attainment"]),
        precision=1.5,
    )
    assert scale > 0 and len(points) >= 2


def test_warm_estimator_starts_from_the_warmup_statistics() -> None:
    from policies.base import RequestInfo
    from policies.estimators import OnlineQuantileEstimator

    warmup = [TraceRequest(0.0, 500, 100, (), i) for i in range(50)]
    est = specs.WarmEstimator.from_requests(OnlineQuantileEstimator(), warmup, "llama-3-8b", 4096)
    got = est.estimate(RequestInfo("x", "llama-3-8b", 500, 4096), {})
    assert 100 <= got.reserve_tokens < 120  # learned, not max_tokens
    assert est.name == "online_quantile"


def test_policy_comparison_tables_and_plot(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(specs.TRACES, "tiny", specs.TraceSpec("tiny", "x", None, 2.0, 0.1))
    monkeypatch.setitem(specs.SHAPES, "tiny", TINY)
    monkeypatch.setattr(specs.TraceSpec, "load", lambda self, limit=None: _trace(40))
    cases = (specs.CASES[2], specs.CASES[5])
    data = simruns.policy_comparison(["tiny"], ["tiny"], cases, precision=1.5, jobs=1)
    assert len(data["goodput"]) == 2 and len(data["at_common_rate"]) == 2
    for r in data["goodput"]:
        assert r["goodput_rps"] >= 0 and r["points"]
    for r in data["at_common_rate"]:
        _sane(r)
    table = tables.goodput_table(data)
    assert "least_loaded" in table and "two_sided+online" in table
    assert tables.plot_attainment(data["goodput"], "tiny", "tiny", tmp_path / "a.png")
    assert (tmp_path / "a.png").stat().st_size > 1000


def test_admission_and_scaling_instruments(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(specs.TRACES, "tiny", specs.TraceSpec("tiny", "x", None, 2.0, 0.1))
    monkeypatch.setitem(specs.SHAPES, "tiny", TINY)
    monkeypatch.setattr(specs.TraceSpec, "load", lambda self, limit=None: _trace(40))
    rows = simruns.admission_comparison((("tiny", "tiny", 8.0),), jobs=1)
    assert [r["case"] for r in rows] == ["instant", "predictive"]
    for r in rows:
        _sane(r)
    assert "predictive" in tables.admission_table(rows)

    monkeypatch.setattr(simruns, "load_trace", lambda path, limit=None, **kw: _trace(40))
    rows = simruns.scaling([4, 8])
    assert [r["workers"] for r in rows] == [4, 8]
    for r in rows:
        _sane(r)
    assert "events/CPU-s" in tables.scaling_table(rows)
    assert all(r["cpu_s"] > 0 and r["events_per_cpu_s"] > 0 for r in rows)


def test_validation_table_formats() -> None:
    v = {"rows": [{"metric": "TTFT p50", "live_s": 0.1, "sim_s": 0.11, "rel_diff": 0.1}]}
    assert "+10.0 %" in tables.validation_table(v)


def test_validation_table_shows_the_mirrored_and_calibrated_simulator() -> None:
    v = {"rows": [{"metric": "TTFT p50", "live_s": 0.1, "sim_s": 0.08, "rel_diff": -0.2,
                   "mirror_s": 0.09, "rel_diff_mirror": -0.1, "cal_s": 0.105,
                   "rel_diff_cal": 0.05}]}  # fmt: skip
    table = tables.validation_table(v)
    assert "sim + mechanics + overheads" in table
    assert "-20.0 %" in table and "-10.0 %" in table and "+5.0 %" in table


def test_calibration_workload_and_live_mirror_in_the_simulator() -> None:
    reqs = calibration.calibration_requests(2.0)
    assert len(reqs) == calibration.N_ISOLATED + 24
    assert [r.index for r in reqs] == list(range(len(reqs)))
    # Isolated requests are 0.6 s of wall time apart (1.2 s of trace time at time scale 2).
    assert reqs[1].arrival_s - reqs[0].arrival_s == pytest.approx(1.2)
    mirror = calibration.live_mirror(2.0, 0.02, 0.001)
    assert mirror["timer_quantum_s"] == pytest.approx(0.002) and mirror["join_mid_step"]
    shape = specs.ShapeSpec("validate", 2, 2)
    case = specs.CaseSpec("two_sided+online_quantile", "two_sided")
    plain = simruns.simulate_case(reqs, shape, case, 1.0, specs.TRACES["conv"],
                         config_overrides=calibration.live_mirror(2.0))  # fmt: skip
    cal = simruns.simulate_case(
        reqs, shape, case, 1.0, specs.TRACES["conv"], config_overrides=mirror
    )
    assert all(r.outcome == "ok" for r in cal.records)
    for a, b in zip(
        plain.records[: calibration.N_ISOLATED], cal.records[: calibration.N_ISOLATED], strict=True
    ):
        # Isolated: nothing queues, so the overheads add exactly (48 tokens = 48 steps).
        assert b.ttft_s == pytest.approx(a.ttft_s + 0.02 + 0.001, abs=1e-9)
        assert b.mean_gap_s == pytest.approx(a.mean_gap_s + 0.001, abs=1e-9)


def test_validation_measures_the_live_side_as_the_simulator_does() -> None:
    """Like with like: the live TTFT/TPOT percentiles are the one `percentile`, the live ITL is
    binned in the simulator's own gap histogram, and unfinished requests count for neither."""
    from array import array

    from disagg_tools.replay.replayer import RequestRecord
    from disagg_tools.simcluster.metrics import GapHistogram, percentile

    recs = []
    for i in range(10):
        gaps = array("d", [0.01 * (i + 1)] * 4)
        ttft = 0.1 * (i + 1)
        rec = RequestRecord(i, 0.0, 10, 5, outcome="ok", ttft_s=ttft, itl_s=gaps, tokens=5)
        rec.e2e_s = ttft + sum(gaps)
        recs.append(rec)
    recs.append(RequestRecord(10, 0.0, 10, 5, outcome="error", ttft_s=9.0, tokens=1))
    got = calibration.live_metrics(recs)
    ok = recs[:10]
    assert got["ttft_p50_s"] == percentile([r.ttft_s for r in ok], 50) == pytest.approx(0.55)
    assert got["ttft_p90_s"] == pytest.approx(0.91)
    assert got["tpot_p50_s"] == pytest.approx(0.055)
    hist = GapHistogram()
    for r in ok:
        for g in r.itl_s:
            hist.add(g)
    assert got["itl_p50_s"] == hist.quantile(0.5)
    assert got["itl_p90_s"] == hist.quantile(0.9)
    assert calibration.live_metrics([])["itl_p50_s"] is None
