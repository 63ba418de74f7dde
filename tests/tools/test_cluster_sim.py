"""The discrete-event cluster simulator: timings, accounting invariants, router modes."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest

from disagg_tools.simcluster.config import ClusterConfig
from disagg_tools.simcluster.engine import simulate
from disagg_tools.simcluster.metrics import GapHistogram
from disagg_tools.simcluster.workers import _step_time_fn
from policies.base import (
    Candidate,
    ClusterView,
    Decision,
    OutputEstimate,
    OutputHistograms,
    Placement,
    Rejection,
    RequestInfo,
    blocks_for,
)
from policies.costmodel import perf_model


@dataclass(frozen=True)
class Req:
    """A trace row: the simulator accepts anything with these four attributes."""

    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    prefix_hash_ids: tuple[int, ...] = ()


class FirstFit:
    """Least-queued P, most-free D with room for prompt + reserve quantile; else reject."""

    name = "first_fit"

    def place(self, request: RequestInfo, view: ClusterView) -> Decision:
        p = min(view.prefill, key=lambda v: (v.queued_prompt_tokens, v.worker_id))
        if not p.under_stranded_cap:
            return Rejection("stranded cap")
        fits = []
        for d in view.decode:
            need = blocks_for(request.prompt_tokens + request.reserve_output_tokens, 16)
            if d.layout.key == p.layout.key and d.free_blocks >= need:
                fits.append((-d.free_blocks, d.worker_id, need))
        if not fits:
            return Rejection("no room")
        _, did, need = min(fits)
        return Placement((Candidate(p.worker_id, did, need),))


class Oracle:
    name = "oracle"

    def class_keys(self, request: RequestInfo) -> tuple[str, ...]:
        return ("all",)

    def estimate(self, request: RequestInfo, histograms: OutputHistograms) -> OutputEstimate:
        assert request.hint_output_tokens is not None
        return OutputEstimate(reserve_tokens=request.hint_output_tokens, source="oracle")

    def bucket_of(self, output_tokens: int) -> int:
        return output_tokens


def trace(n: int, seed: int, rate: float = 5.0, prompt: int = 1000, out: int = 200) -> list[Req]:
    rng = random.Random(seed)
    t = 0.0
    reqs = []
    for _ in range(n):
        t += rng.expovariate(rate)
        reqs.append(Req(t, rng.randint(1, 2 * prompt), rng.randint(1, 2 * out)))
    return reqs


def assert_clean(res, n: int) -> None:
    s = res.summary()
    assert s["requests"] == n == len(res.records)
    assert sorted(r.index for r in res.records) == list(range(n))
    assert s["ok"] + s["rejected"] + s["failed"] == n
    assert all(r.outcome in ("ok", "rejected", "failed") for r in res.records)
    # After the cluster goes quiet: no reservation, no KV in use, nothing stranded (design §2).
    assert s["end_reserved_blocks"] == 0
    assert s["end_used_blocks"] == 0
    assert s["end_stranded_bytes"] == 0


def test_single_request_timings_match_the_cost_model() -> None:
    cfg = ClusterConfig.homogeneous(1, 1, "llama-3-8b", "h100")
    perf = perf_model("llama-3-8b", "h100")
    prompt, out = 1000, 5
    res = simulate([Req(3.0, prompt, out)], cfg, FirstFit(), Oracle())
    (rec,) = res.records
    bw = cfg.link_bytes_per_s("prefill", "decode")
    transfer = cfg.link_latency_s + prompt * perf.kv_bytes_per_token / bw
    ttft = perf.prefill_s(prompt) + transfer + perf.decode_step_s(prompt, 1)
    steps = [perf.decode_step_s(prompt + k, 1) for k in range(1, out)]
    assert rec.outcome == "ok"
    assert rec.arrival_s == 0.0  # arrivals are relative to the first request
    assert rec.ttft_s == pytest.approx(ttft, rel=1e-9)
    assert rec.e2e_s == pytest.approx(ttft + sum(steps), rel=1e-9)
    assert rec.mean_gap_s == pytest.approx(sum(steps) / (out - 1), rel=1e-9)
    assert rec.max_gap_s == pytest.approx(max(steps), rel=1e-9)
    assert res.gaps.count == out - 1
    assert_clean(res, 1)


@pytest.mark.parametrize(("model", "gpu"), [("llama-3-8b", "h100"), ("llama-3-70b", "a100")])
def test_folded_step_time_is_the_cost_model(model: str, gpu: str) -> None:
    perf = perf_model(model, gpu)
    fast = _step_time_fn(perf)
    assert fast != perf.decode_step_s  # the fast path is in use for built-in profiles
    for kv, batch in [(0, 1), (5000, 3), (123_457, 64), (10**6, 4096)]:
        assert fast(kv, batch) == pytest.approx(perf.decode_step_s(kv, batch), rel=1e-12)


def test_rate_scale_compresses_arrivals() -> None:
    cfg = ClusterConfig.homogeneous(1, 1)
    res = simulate([Req(0.0, 10, 2), Req(10.0, 10, 2)], cfg, FirstFit(), rate_scale=4.0)
    assert [r.arrival_s for r in res.records] == [0.0, 2.5]


def test_prefix_cache_hit_skips_compute() -> None:
    cfg = ClusterConfig.homogeneous(1, 1, prefix_cache_blocks=100, prefix_block_tokens=512)
    perf = perf_model("llama-3-8b", "h100")
    reqs = [Req(0.0, 2048, 1, (1, 2, 3, 4)), Req(100.0, 2048, 1, (1, 2, 3, 9))]
    res = simulate(reqs, cfg, FirstFit(), Oracle())
    cold, warm = res.records
    saved = perf.prefill_s(2048) - perf.prefill_s(2048, 3 * 512)
    assert cold.ttft_s - warm.ttft_s == pytest.approx(saved, rel=1e-9)


@pytest.mark.parametrize(
    ("reserve", "on_full", "admission"),
    [
        (True, "preempt", "instant"),
        (True, "refuse", "predictive"),
        (False, "preempt", "instant"),
        (False, "refuse", "instant"),
    ],
)
def test_deterministic_and_every_request_accounted(
    reserve: bool, on_full: str, admission: str
) -> None:
    cfg = ClusterConfig.homogeneous(
        2,
        3,
        capacity_blocks=400,
        reserve=reserve,
        on_full=on_full,
        admission=admission,
        prefill_jitter=0.2,
        queue_limit=50,
    )
    reqs = trace(300, seed=7, rate=40.0)
    runs = [simulate(reqs, cfg, FirstFit(), Oracle(), seed=3, slo_ttft_s=5.0) for _ in range(2)]
    assert runs[0].summary() == runs[1].summary()
    assert runs[0].records == runs[1].records
    assert_clean(runs[0], len(reqs))
    other = simulate(reqs, cfg, FirstFit(), Oracle(), seed=4, slo_ttft_s=5.0)
    assert other.summary() != runs[0].summary()  # the seed drives the prefill jitter


def _crowded() -> tuple[ClusterConfig, list[Req]]:
    # 8 requests at once on one decode worker of 64 blocks (1,024 tokens): prompts fit together,
    # their 400-token answers do not.
    cfg = ClusterConfig.homogeneous(1, 1, capacity_blocks=64)
    return cfg, [Req(i * 0.001, 100, 400) for i in range(8)]


def test_reserving_avoids_the_preemptions_of_place_and_hope() -> None:
    cfg, reqs = _crowded()
    hope = simulate(reqs, cfg.with_(reserve=False), FirstFit(), slo_ttft_s=100.0)
    ours = simulate(reqs, cfg, FirstFit(), Oracle(), slo_ttft_s=100.0)
    assert_clean(hope, len(reqs))
    assert_clean(ours, len(reqs))
    assert hope.summary()["preemptions"] > 0
    assert ours.summary()["preemptions"] == 0
    assert ours.summary()["ok"] == len(reqs)
    assert ours.summary()["queued"] > 0  # the room was waited for, not overcommitted


def test_refuse_leaves_kv_stranded_where_preempt_evicts_at_handoff() -> None:
    # Two 400-token prompts fit in 64 blocks (25 each, 27 with the answer); eight arrive at once.
    cfg = ClusterConfig.homogeneous(1, 1, capacity_blocks=64, reserve=False)
    reqs = [Req(i * 0.001, 400, 20) for i in range(8)]
    preempt = simulate(reqs, cfg, FirstFit())
    refuse = simulate(reqs, cfg.with_(on_full="refuse"), FirstFit())
    for res in (preempt, refuse):
        assert_clean(res, len(reqs))
        assert res.summary()["ok"] == len(reqs)
    p, r = preempt.summary(), refuse.summary()
    assert p["preemptions"] > 0 and p["handoff_refusals"] == 0
    assert r["preemptions"] == 0 and r["handoff_refusals"] > 0
    assert r["stranded_byte_s"] > p["stranded_byte_s"]


def test_underestimates_overrun_their_reservation() -> None:
    class Half(Oracle):
        def estimate(self, request: RequestInfo, histograms: OutputHistograms) -> OutputEstimate:
            assert request.hint_output_tokens is not None
            return OutputEstimate(reserve_tokens=max(1, request.hint_output_tokens // 2))

    cfg = ClusterConfig.homogeneous(1, 2)
    res = simulate(trace(50, seed=1), cfg, FirstFit(), Half())
    s = res.summary()
    assert s["overrun_grown"] > 0
    assert_clean(res, 50)


def test_stranded_cap_is_respected() -> None:
    kv_per_token = perf_model("llama-3-8b", "h100").kv_bytes_per_token
    cap = 3 * 500 * kv_per_token
    # Slow link and a small decode worker that refuses handoffs: KV piles up on P.
    cfg = ClusterConfig.homogeneous(
        1,
        1,
        capacity_blocks=100,
        reserve=False,
        on_full="refuse",
        stranded_cap_bytes=cap,
        link_bytes_per_s=1e9,
    )
    reqs = [Req(i * 0.01, 500, 300) for i in range(20)]
    res = simulate(reqs, cfg, FirstFit(), slo_ttft_s=1000.0)
    s = res.summary()
    assert_clean(res, len(reqs))
    assert s["ok"] == len(reqs)
    assert 0 < s["peak_stranded_bytes"] <= cap
    uncapped = simulate(reqs, cfg.with_(stranded_cap_bytes=0), FirstFit(), slo_ttft_s=1000.0)
    assert uncapped.summary()["peak_stranded_bytes"] > cap


def test_admission_queue_deadline_rejects_with_429_semantics() -> None:
    # One decode worker that holds one request's reservation at a time; long answers.
    cfg = ClusterConfig.homogeneous(1, 1, capacity_blocks=40)
    reqs = [Req(i * 0.01, 100, 500) for i in range(6)]
    res = simulate(reqs, cfg, FirstFit(), Oracle(), slo_ttft_s=1.0)
    assert_clean(res, len(reqs))
    rejected = [r for r in res.records if r.outcome == "rejected"]
    assert rejected and all("deadline" in r.reason for r in rejected)
    assert res.records[0].outcome == "ok"
    no_queue = simulate(reqs, cfg.with_(queue_limit=0), FirstFit(), Oracle(), slo_ttft_s=1.0)
    assert all(r.outcome == "rejected" and "queue full" in r.reason for r in no_queue.records[1:])


def test_predictive_and_instant_admission_on_an_overloaded_cluster() -> None:
    cfg = ClusterConfig.homogeneous(1, 2, capacity_blocks=120)
    reqs = trace(200, seed=5, rate=30.0, prompt=300, out=150)
    results = {}
    for admission in ("instant", "predictive"):
        res = simulate(reqs, cfg.with_(admission=admission), FirstFit(), Oracle(), slo_ttft_s=2.0)
        assert_clean(res, len(reqs))
        results[admission] = res.summary()
    assert results["instant"]["rejected"] > 0  # it is overloaded
    assert results["instant"]["admitted_on_forecast"] == 0
    assert results["predictive"]["admitted_on_forecast"] > 0


def test_per_worker_capacities_and_groups() -> None:
    cfg = ClusterConfig.homogeneous(2, 2, decode_gpu="l40s")
    slow = perf_model("llama-3-8b", "l40s")
    assert all(w.perf == slow for w in cfg.decode)
    assert all(w.kv_capacity_blocks == slow.kv_capacity_blocks for w in cfg.decode)
    res = simulate(trace(30, seed=2), cfg, FirstFit(), Oracle())
    assert_clean(res, 30)


def test_gap_histogram_quantiles_and_worst_tenth() -> None:
    h = GapHistogram()
    h.add(0.01, 90)
    h.add(0.5, 10)
    assert h.count == 100
    assert h.quantile(0.5) == pytest.approx(0.01)
    assert h.quantile(0.95) == pytest.approx(0.5)
    assert h.worst_mean(0.1) == pytest.approx(0.5)
    assert h.worst_mean(0.2) == pytest.approx((0.5 * 10 + 0.01 * 10) / 20)
    assert h.mean == pytest.approx((0.9 + 5.0) / 100)


def test_config_rejects_bad_modes() -> None:
    with pytest.raises(ValueError, match="on_full"):
        ClusterConfig.homogeneous(1, 1, on_full="drop")
    with pytest.raises(ValueError, match="admission"):
        ClusterConfig.homogeneous(1, 1, admission="psychic")


def test_the_truth_reaches_only_the_oracle_unless_hints_are_asked_for() -> None:
    seen: list[int | None] = []

    class Spy(Oracle):
        name = "spy"

        def estimate(self, request: RequestInfo, histograms: OutputHistograms) -> OutputEstimate:
            seen.append(request.hint_output_tokens)
            return OutputEstimate(reserve_tokens=request.max_tokens)

    cfg = ClusterConfig.homogeneous(1, 1)
    simulate([Req(0.0, 10, 7)], cfg, FirstFit(), Spy())
    simulate([Req(0.0, 10, 7)], cfg, FirstFit(), Spy(), send_hints=True)
    assert seen == [None, 7]


def test_built_in_policies_and_learning_estimator_run_clean() -> None:
    from policies.baselines import LeastLoadedPolicy, PowerOfTwoPolicy
    from policies.estimators import OnlineQuantileEstimator
    from policies.two_sided import TwoSidedPolicy

    cfg = ClusterConfig.homogeneous(2, 3, capacity_blocks=300)
    reqs = trace(300, seed=11, rate=30.0, prompt=400, out=150)
    ours = simulate(reqs, cfg, TwoSidedPolicy(), OnlineQuantileEstimator(min_samples=5))
    assert_clean(ours, len(reqs))
    for policy in (LeastLoadedPolicy(), PowerOfTwoPolicy(seed=1)):
        res = simulate(reqs, cfg.with_(reserve=False), policy, OnlineQuantileEstimator())
        assert_clean(res, len(reqs))


# -- mirroring the live simulated cluster (ClusterConfig.router_overhead_s & co.) ---------------


def _one(cfg: ClusterConfig, prompt: int = 1000, out: int = 5):
    res = simulate([Req(3.0, prompt, out)], cfg, FirstFit(), Oracle())
    (rec,) = res.records
    assert rec.outcome == "ok"
    assert_clean(res, 1)
    return rec, res


def test_live_overheads_default_to_off_and_reject_negatives() -> None:
    cfg = ClusterConfig.homogeneous(1, 1)
    assert (cfg.router_overhead_s, cfg.step_overhead_s, cfg.timer_quantum_s) == (0, 0, 0)
    assert cfg.join_mid_step is False
    for knob in ("router_overhead_s", "step_overhead_s", "timer_quantum_s"):
        with pytest.raises(ValueError, match=knob):
            ClusterConfig.homogeneous(1, 1, **{knob: -0.001})


def test_router_overhead_adds_exactly_to_ttft_and_e2e_not_to_gaps() -> None:
    base, _ = _one(ClusterConfig.homogeneous(1, 1))
    rec, _ = _one(ClusterConfig.homogeneous(1, 1, router_overhead_s=0.0123))
    assert rec.ttft_s == pytest.approx(base.ttft_s + 0.0123, abs=1e-12)
    assert rec.e2e_s == pytest.approx(base.e2e_s + 0.0123, abs=1e-12)
    assert rec.mean_gap_s == pytest.approx(base.mean_gap_s, abs=1e-12)
    assert rec.queued_s == base.queued_s == 0.0  # admitted at once; the cost comes after


def test_step_overhead_adds_to_every_decode_step() -> None:
    out = 6
    base, base_res = _one(ClusterConfig.homogeneous(1, 1), out=out)
    rec, res = _one(ClusterConfig.homogeneous(1, 1, step_overhead_s=0.0004), out=out)
    # The first token needs one step, each later token one more: out steps in all.
    assert rec.ttft_s == pytest.approx(base.ttft_s + 0.0004, abs=1e-12)
    assert rec.mean_gap_s == pytest.approx(base.mean_gap_s + 0.0004, abs=1e-12)
    assert rec.e2e_s == pytest.approx(base.e2e_s + out * 0.0004, abs=1e-12)
    assert res.gaps.mean == pytest.approx(base_res.gaps.mean + 0.0004, abs=1e-12)


def test_timer_quantum_rounds_each_sleep_half_to_even() -> None:
    cfg = ClusterConfig.homogeneous(1, 1, timer_quantum_s=0.002, link_latency_s=0.0)
    perf = perf_model("llama-3-8b", "h100")
    prompt, out = 1000, 5
    rec, res = _one(cfg, prompt, out)

    def q(d: float) -> float:
        return round(d / 0.002) * 0.002

    bw = cfg.link_bytes_per_s("prefill", "decode")
    transfer = q(prompt * perf.kv_bytes_per_token / bw)
    steps = [q(perf.decode_step_s(prompt + k, 1)) for k in range(out)]
    assert rec.ttft_s == pytest.approx(q(perf.prefill_s(prompt)) + transfer + steps[0], rel=1e-9)
    assert rec.e2e_s == pytest.approx(rec.ttft_s + sum(steps[1:]), rel=1e-9)
    assert all(abs(g / 0.002 - round(g / 0.002)) < 1e-6 for g in (rec.max_gap_s, rec.mean_gap_s))
    # uvloop's rounding of a 4.5 ms sleep at 1 ms resolution: 4 ms (half to even), 5.5 -> 6.
    from disagg_tools.simcluster.workers import quantize

    assert quantize(0.0045, 0.001) == pytest.approx(0.004)
    assert quantize(0.0055, 0.001) == pytest.approx(0.006)


def test_join_mid_step_gives_the_first_token_at_the_running_steps_end() -> None:
    # A long-running sequence keeps D stepping; a second one lands mid-step. vLLM (default)
    # starts it at the next boundary; the live sim worker adds it to the running step.
    perf = perf_model("llama-3-8b", "h100")
    reqs = [Req(0.0, 100, 400), Req(0.5, 100, 3)]
    base = simulate(reqs, ClusterConfig.homogeneous(1, 1), FirstFit(), Oracle())
    mid = simulate(reqs, ClusterConfig.homogeneous(1, 1, join_mid_step=True), FirstFit(),
                   Oracle())  # fmt: skip
    assert_clean(base, 2)
    assert_clean(mid, 2)
    b, m = base.records[1], mid.records[1]
    step = perf.decode_step_s(100 + 100, 2)  # about one step of the two-sequence batch
    assert 0 < b.ttft_s - m.ttft_s <= 1.01 * step
    assert m.mean_gap_s == pytest.approx(b.mean_gap_s, rel=0.01)
    # The long request's tokens are unaffected in count; every request still finishes cleanly.
    assert mid.records[0].output_tokens == base.records[0].output_tokens == 400


def test_live_mirror_runs_clean_and_deterministic() -> None:
    cfg = ClusterConfig.homogeneous(
        2, 2, timer_quantum_s=0.002, join_mid_step=True, link_latency_s=0.0,
        router_overhead_s=0.02, step_overhead_s=0.0008,
    )  # fmt: skip
    reqs = trace(120, seed=7, rate=20.0)
    a = simulate(reqs, cfg, FirstFit(), Oracle(), seed=3)
    b = simulate(reqs, cfg, FirstFit(), Oracle(), seed=3)
    assert_clean(a, 120)
    assert [(r.ttft_s, r.e2e_s) for r in a.records] == [(r.ttft_s, r.e2e_s) for r in b.records]
    plain = simulate(reqs, ClusterConfig.homogeneous(2, 2), FirstFit(), Oracle(), seed=3)
    assert a.summary()["ttft_p50_s"] > plain.summary()["ttft_p50_s"]
