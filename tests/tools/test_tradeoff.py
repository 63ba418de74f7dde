"""disagg_tools/experiments/tradeoff.py on a tiny shift from short to long answers (seconds): the
in-flight
corrections (policies/overruns.py, run by disagg_tools/simcluster/feedback.py) must cut forced
growth there,
where the asked-bucket classes cannot tell the long answers from the short ones."""

from __future__ import annotations

from disagg_tools.experiments import tradeoff
from disagg_tools.experiments.specs import ShapeSpec, TraceSpec
from disagg_tools.traces import TraceRequest

# Two decode workers of 1,000 blocks (16 K tokens each): ~23 sequences of 700 tokens apiece.
TINY = ShapeSpec("tiny", 1, 2, "llama-3-8b", capacity_blocks=1000)
CELLS = {c.label: c for c in tradeoff.CELLS}


def _shift() -> tradeoff.Workload:
    # 20 req/s: the short half is light; the long half overloads the decode memory, so the
    # admission queue is never empty and every room freed is filled at the estimate.
    reqs = tradeoff.synth_shift(600, rate=20, short=(30, 8), long=(400, 60), prompt=(300, 80))
    warm = tradeoff.synth_shift(
        200, short=(30, 8), long=None, prompt=(300, 80), seed=101, first_index=10**6
    )
    spec = TraceSpec("tiny-shift", "", None, 2.0, 0.1)
    return tradeoff.Workload("tiny-shift", spec, tuple(reqs), tuple(warm), 300)


def test_corrections_cut_forced_growth_on_a_shift() -> None:
    w = _shift()
    before = tradeoff.run_cell(w, CELLS["none"], 1.0, shape=TINY)
    after = tradeoff.run_cell(w, CELLS["both"], 1.0, shape=TINY)
    # The workload does what it is for: without corrections the shift forces growth.
    assert before["overrun_unreserved"] >= 10, before
    assert after["overrun_unreserved"] < before["overrun_unreserved"] / 2, (before, after)
    assert after["preemptions"] < before["preemptions"], (before, after)
    for row in (before, after):
        assert row["requests"] == 600 == row["ok"] + row["rejected"] + row["failed"]
        assert 0.0 <= row["after_shift_attainment"] <= 1.0
        assert row["forced_per_1k"] == 1000 * row["overrun_unreserved"] / 600


def test_shifted_multiplies_only_the_second_half_and_caps() -> None:
    reqs = [TraceRequest(float(i), 100, 1000 if i % 2 else 10, (), i) for i in range(10)]
    out = tradeoff.shifted(reqs, at=5, max_tokens=4096)
    assert out[:5] == reqs[:5]
    for before, after in zip(reqs[5:], out[5:], strict=True):
        if before.output_tokens == 10:
            assert 40 <= after.output_tokens <= 80
        else:
            assert after.output_tokens == 4096  # x4-x8 of 1,000, cut at max_tokens
    assert tradeoff.shifted(reqs, at=5) == out  # seeded by the row: the same every time


def test_tables_show_every_cell_at_both_loads() -> None:
    w = _shift()
    rows = [
        {**tradeoff.run_cell(w, CELLS[c], 1.0, shape=TINY), "load": load, "workload": "conv"}
        for load in ("knee", "over")
        for c in ("none", "both")
    ]
    searches = [
        {"workload": "conv", "cell": c, "goodput_scale": 1.0, "goodput_rps": 20.0,
         "requests": 600, "base_rps": 20.0, "points": []}
        for c in ("none", "both")
    ]  # fmt: skip
    text = tradeoff.tables({"shape": "tiny", "over": 1.15, "goodput": searches, "at_load": rows})
    lines = [ln for ln in text.splitlines() if ln.startswith("| none") or ln.startswith("| both")]
    assert len(lines) == 4
    assert all(ln.count("|") == lines[0].count("|") for ln in lines)
    assert "after shift SLO %" in text


def test_a_preempted_sequence_is_reported_at_what_it_has_written() -> None:
    """disagg_tools/simcluster/feedback.py: a sequence preempted (its tokens kept in `gen`) and
    waiting to be
    recomputed was reported at gen + the steps since its old residency began, counting those
    steps twice: a censored sample longer than the answer (seen on conv-shift at q0.5)."""
    from disagg_tools.simcluster.feedback import Feedback
    from disagg_tools.simcluster.workers import DecodeWorker, Job
    from policies.base import RequestInfo
    from policies.estimators import OnlineQuantileEstimator, bucket_of

    cfg = TINY.config()
    d = DecodeWorker(0, cfg.decode[0], cfg.layout_of(cfg.decode[0]))
    est = OnlineQuantileEstimator()
    fb = Feedback(est, lambda t, fn: None, lambda: 0.0)
    info = RequestInfo("7", cfg.model, 300, cfg.max_tokens)
    keys = est.class_keys(info)

    def reported() -> dict[int, int]:
        return dict(fb.histograms({k: {} for k in keys})[keys[-1]])

    job = Job(7, 0.0, 300, 500, ())
    job.info, job.d = info, d
    job.gen, job.s0, d.step = 60, 0, 200  # evicted at step 60 of its residency, waiting since
    fb._report(job, d, 0.0)
    assert reported() == {bucket_of(60): 1}
    d.seqs[job.idx] = job  # recomputed: resident again from step 200
    job.s0, d.step = 200, 300
    fb._report(job, d, 0.0)
    assert reported() == {bucket_of(160): 1}
