"""Placement policies as pure functions: table-driven cases, then properties over random views."""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Callable
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from policies.base import (
    Candidate,
    ClusterView,
    DecodeView,
    KVLayout,
    OutputEstimate,
    Placement,
    PlacementPolicy,
    PrefillView,
    Rejection,
    RequestInfo,
    blocks_for,
)
from policies.baselines import (
    RETRY_CEILING_S,
    RETRY_FLOOR_S,
    LeastLoadedPolicy,
    PowerOfTwoPolicy,
    RandomPolicy,
    RoundRobinPolicy,
)
from policies.two_sided import TwoSidedPolicy, prefix_hit_fraction, uncached_tokens
from tests.paths import REPO

LAYOUT = KVLayout(model="m", kv_heads=8, head_dim=128, block_size=16)
OTHER = KVLayout(model="m", kv_heads=8, head_dim=128, block_size=32, engine_version="1")


def _example_policy() -> Callable[[], PlacementPolicy]:
    # Loaded by file path: `examples/` is not an installed package, and the repository root is on
    # sys.path only under `python -m pytest`.
    path = REPO / "examples" / "custom_policy.py"
    spec = importlib.util.spec_from_file_location("_custom_policy_example", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.TightestFitPolicy  # type: ignore[no-any-return]


# Every built-in policy, fresh per call (they carry RNGs and counters).
BUILTINS: dict[str, Callable[[], PlacementPolicy]] = {
    "two_sided": TwoSidedPolicy,
    "random": lambda: RandomPolicy(seed=7),
    "round_robin": RoundRobinPolicy,
    "least_loaded": LeastLoadedPolicy,
    "power_of_two": lambda: PowerOfTwoPolicy(seed=7),
}
ALL = {**BUILTINS, "example_tightest_fit": _example_policy()}


def P(wid: str, **kw: object) -> PrefillView:
    return PrefillView(wid, kw.pop("layout", LAYOUT), **kw)  # type: ignore[arg-type]


def D(wid: str, capacity: int = 10_000, **kw: object) -> DecodeView:
    return DecodeView(wid, kw.pop("layout", LAYOUT), capacity, **kw)  # type: ignore[arg-type]


def view(prefill: list[PrefillView], decode: list[DecodeView], **kw: object) -> ClusterView:
    return ClusterView(tuple(prefill), tuple(decode), kv_bytes_per_token=128 * 1024, **kw)  # type: ignore[arg-type]


def req(prompt: int = 1000, max_tokens: int = 256, **kw: object) -> RequestInfo:
    return RequestInfo(kw.pop("request_id", "r1"), "m", prompt, max_tokens, **kw)  # type: ignore[arg-type]


def placed(decision: object) -> tuple[Candidate, ...]:
    assert isinstance(decision, Placement), decision
    return decision.candidates


# -- two-sided: table-driven ------------------------------------------------------------------


def test_long_prompt_avoids_the_deepest_prefill_queue() -> None:
    v = view([P("p-deep", queued_prompt_tokens=200_000), P("p-idle")], [D("d0"), D("d1")])
    cands = placed(TwoSidedPolicy().place(req(prompt=16_000), v))
    assert cands[0].prefill_id == "p-idle"
    # Each decode worker's best pair uses the idle prefill worker.
    assert {c.prefill_id for c in cands[:2]} == {"p-idle"}


def test_long_expected_answer_avoids_the_nearly_full_decode_worker() -> None:
    nearly_full = D("d-full", reserved_blocks=9_800)  # 200 free blocks
    roomy = D("d-roomy", reserved_blocks=5_000, step_s_per_block=1e-6)  # slower steps, room
    v = view([P("p0")], [nearly_full, roomy])
    long_answer = req(prompt=1000, max_tokens=8000, estimate=OutputEstimate(6000))
    need = blocks_for(1000 + 6000, 16)
    assert need > nearly_full.free_blocks
    cands = placed(TwoSidedPolicy().place(long_answer, v))
    assert [c.decode_id for c in cands] == ["d-roomy"]
    assert cands[0].reserve_blocks == need
    # A short answer fits both, and the faster (less loaded) worker wins.
    short = placed(TwoSidedPolicy().place(req(max_tokens=100), v))
    assert short[0].decode_id == "d-full"


@pytest.mark.parametrize(
    ("prompt", "local"),
    [(16, True), (40, True), (2_000, False), (30_000, False)],
)
def test_conditional_disaggregation_follows_the_model(prompt: int, local: bool) -> None:
    # Equal prefill speed on both sides: local saves the transfer, but a prompt longer than one
    # step's compute slack (5 ms x 10k tok/s = 50 tokens) stalls the 8 resident sequences.
    d = D("d0", can_prefill=True, resident_seqs=8)
    v = view([P("p0")], [d], link_latency_s=0.002)
    first = placed(TwoSidedPolicy().place(req(prompt=prompt, max_tokens=16), v))[0]
    assert (first.prefill_id is None) is local


def test_local_prefill_wins_when_the_prefill_pool_is_swamped() -> None:
    d = D("d0", can_prefill=True, resident_seqs=2)
    v = view([P("p0", queued_prompt_tokens=500_000)], [d])
    assert placed(TwoSidedPolicy().place(req(prompt=4_000), v))[0].prefill_id is None


def test_local_prefill_serves_without_any_prefill_worker() -> None:
    v = view([], [D("d0", can_prefill=True)])
    cands = placed(TwoSidedPolicy().place(req(prompt=20), v))
    assert [(c.prefill_id, c.decode_id) for c in cands] == [(None, "d0")]


@pytest.mark.parametrize(
    ("prompt", "expect_local_first", "expect_any_local"),
    [(100, True, True), (512, True, True), (513, False, False), (20_000, False, False)],
)
def test_forced_disaggregation_threshold(
    prompt: int, expect_local_first: bool, expect_any_local: bool
) -> None:
    # Busy decode worker: the model alone would send everything but tiny prompts remote.
    d = D("d0", can_prefill=True, resident_seqs=64)
    v = view([P("p0"), P("p1")], [d, D("d1")])
    policy = TwoSidedPolicy(disagg_threshold_tokens=512)
    cands = placed(policy.place(req(prompt=prompt), v))
    assert (cands[0].prefill_id is None) is expect_local_first
    assert any(c.prefill_id is None for c in cands) is expect_any_local
    assert len(cands) == 4  # remote alternatives follow the local one


def test_local_prefill_that_would_break_the_itl_slo_is_not_offered() -> None:
    d = D("d0", can_prefill=True, resident_seqs=4)
    v = view([P("p0")], [d])
    # 5,000 tokens at 10k tok/s stalls the batch ~0.5 s, far over a 50 ms ITL SLO.
    cands = placed(TwoSidedPolicy(itl_slo_s=0.05).place(req(prompt=5_000), v))
    assert all(c.prefill_id == "p0" for c in cands)


def test_prefix_affinity_prefers_the_worker_holding_the_prefix() -> None:
    hashes = (11, 12, 13, 14)
    v = view([P("p-cold"), P("p-warm", recent_prefixes=frozenset(hashes))], [D("d0")])
    cands = placed(TwoSidedPolicy().place(req(prompt=8_000, prefix_hashes=hashes), v))
    assert cands[0].prefill_id == "p-warm"
    assert cands[0].predicted_ttft_s < cands[1].predicted_ttft_s
    # Weight 0 ignores affinity: the tie is broken by the seeded hash, either way is fine,
    # but both predictions are equal.
    cands0 = placed(TwoSidedPolicy(prefix_weight=0.0).place(req(prefix_hashes=hashes), v))
    assert cands0[0].predicted_ttft_s == pytest.approx(cands0[1].predicted_ttft_s)


def test_prefix_hit_is_a_leading_run() -> None:
    assert prefix_hit_fraction((1, 2, 3, 4), frozenset({1, 2, 4})) == 0.5
    assert prefix_hit_fraction((1, 2), frozenset({2})) == 0.0
    assert prefix_hit_fraction((), frozenset({1})) == 0.0


# -- placement on facts: cached_prefix_tokens, when known, is used exactly (issue 22) -----------


def test_uncached_tokens_counts_whole_blocks_and_always_one_token() -> None:
    assert uncached_tokens(1000, 0, 16) == 1000
    assert uncached_tokens(1000, 40, 16) == 1000 - 32  # a partial block is not a hit
    assert uncached_tokens(1024, 1024, 16) == 1  # the last token yields the logits
    assert uncached_tokens(100, 5_000, 16) == 100 - 96  # never more than the prompt


def test_known_prefill_cache_is_used_exactly_over_the_estimate() -> None:
    hashes = (1, 2, 3, 4)
    # The hint says p-hinted holds the whole prefix; the fact says p-holds does (6,000 tokens).
    hinted = P("p-hinted", recent_prefixes=frozenset(hashes), cached_prefix_tokens=0)
    holds = P("p-holds", cached_prefix_tokens=6_000)
    v = view([hinted, holds], [D("d0")])
    cand = placed(TwoSidedPolicy().place(req(prompt=8_000, prefix_hashes=hashes), v))[0]
    assert cand.prefill_id == "p-holds"
    compute = uncached_tokens(8_000, 6_000, 16)
    want = compute / holds.prefill_tokens_per_s + v.transfer_s(8_000, "default", "default")
    assert cand.predicted_ttft_s == pytest.approx(want + D("d0").step_time_s(cand.reserve_blocks))


def test_decode_cache_shrinks_the_transfer_and_wins_the_pair() -> None:
    # A slow link: moving 8,000 tokens of KV costs 8000*128KiB/1GB/s ~ 1 s; d-warm holds 7,680.
    warm, cold = D("d-warm", cached_prefix_tokens=7_680), D("d-cold", cached_prefix_tokens=0)
    v = view([P("p0")], [cold, warm], default_link_bytes_per_s=1e9)
    cands = placed(TwoSidedPolicy().place(req(prompt=8_000), v))
    assert cands[0].decode_id == "d-warm"
    moved = v.transfer_s(uncached_tokens(8_000, 7_680, 16), "default", "default")
    assert cands[0].predicted_ttft_s == pytest.approx(
        8_000 / 10_000 + moved + warm.step_time_s(cands[0].reserve_blocks)
    )
    # Unknown (None) on both: no preference from the cache, the tie-break decides, and the
    # whole prompt crosses the link.
    blind = view([P("p0")], [D("d-warm"), D("d-cold")], default_link_bytes_per_s=1e9)
    first = placed(TwoSidedPolicy().place(req(prompt=8_000), blind))[0]
    assert first.predicted_ttft_s > 8_000 * 128 * 1024 / 1e9


def test_decode_worker_holding_the_prompt_serves_it_whole() -> None:
    # 8 resident sequences make a 4,000-token local prefill expensive: remote wins when D's
    # cache is cold, local wins when D already holds all but the last block (conditional
    # disaggregation on facts).
    cold = D("d0", can_prefill=True, resident_seqs=8, cached_prefix_tokens=0)
    v = view([P("p0")], [cold])
    assert placed(TwoSidedPolicy().place(req(prompt=4_000), v))[0].prefill_id == "p0"
    warm = replace(cold, cached_prefix_tokens=3_984)
    v = view([P("p0")], [warm])
    assert placed(TwoSidedPolicy().place(req(prompt=4_000), v))[0].prefill_id is None


def test_transfer_time_favours_the_nearby_decode_worker() -> None:
    v = view(
        [P("p0", group="rack-a")],
        [D("d-far", group="rack-b"), D("d-near", group="rack-a")],
        links={("rack-a", "rack-a"): 400e9, ("rack-a", "rack-b"): 5e9},
    )
    cands = placed(TwoSidedPolicy().place(req(prompt=30_000), v))
    assert [c.decode_id for c in cands[:2]] == ["d-near", "d-far"]


def test_itl_slo_excludes_slow_decode_workers_and_request_slo_overrides() -> None:
    slow = D("d-slow", reserved_blocks=5_000, step_s_per_block=1e-5)  # ~55 ms steps
    fast = D("d-fast", reserved_blocks=5_000)
    v = view([P("p0", queued_prompt_tokens=0)], [slow, fast])
    cands = placed(TwoSidedPolicy(itl_slo_s=0.02).place(req(), v))
    assert [c.decode_id for c in cands] == ["d-fast"]
    assert cands[0].predicted_itl_s <= 0.02
    # The request's own SLO, when given, wins over the policy's.
    loose = placed(TwoSidedPolicy(itl_slo_s=0.02).place(req(slo_itl_s=1.0), v))
    assert {c.decode_id for c in loose} == {"d-slow", "d-fast"}
    rejected = TwoSidedPolicy(itl_slo_s=0.02).place(req(), view([P("p0")], [slow]))
    assert isinstance(rejected, Rejection)
    assert "ITL SLO of 20.0 ms" in rejected.reason
    assert RETRY_FLOOR_S <= rejected.retry_after_s <= RETRY_CEILING_S
    # An idle worker whose step is all KV reads (no base cost) cannot divide by a zero step.
    kv_bound = D("d-kv", step_base_s=0.0, step_s_per_block=1e-3)
    rejected = TwoSidedPolicy(itl_slo_s=0.02).place(req(), view([P("p0")], [kv_bound]))
    assert isinstance(rejected, Rejection)
    assert RETRY_FLOOR_S <= rejected.retry_after_s <= RETRY_CEILING_S


def test_candidates_prefer_distinct_decode_workers_then_fill_with_alternatives() -> None:
    v = view(
        [P(f"p{i}", queued_prompt_tokens=i * 1000) for i in range(3)],
        [D(f"d{i}") for i in range(6)],
    )
    cands = placed(TwoSidedPolicy(max_candidates=4).place(req(), v))
    assert len({c.decode_id for c in cands}) == 4
    few = view([P("p0"), P("p1"), P("p2")], [D("d0"), D("d1")])
    cands = placed(TwoSidedPolicy(max_candidates=4).place(req(), few))
    assert len(cands) == 4
    assert {c.decode_id for c in cands[:2]} == {"d0", "d1"}
    assert len({(c.prefill_id, c.decode_id) for c in cands}) == 4


def test_exact_ties_are_spread_by_request_yet_deterministic() -> None:
    v = view([P(f"p{i}") for i in range(8)], [D(f"d{i}") for i in range(8)])
    firsts = [placed(TwoSidedPolicy().place(req(request_id=f"r{i}"), v))[0] for i in range(40)]
    assert len({c.decode_id for c in firsts}) > 3
    assert len({c.prefill_id for c in firsts}) > 3
    again = [placed(TwoSidedPolicy().place(req(request_id=f"r{i}"), v))[0] for i in range(40)]
    assert firsts == again


def test_predicted_ttft_adds_up() -> None:
    p = P("p0", queued_prompt_tokens=5_000, prefill_tokens_per_s=10_000.0)
    d = D("d0", step_base_s=0.01)
    v = view([p], [d], default_link_bytes_per_s=1e9, link_latency_s=0.001)
    c = placed(TwoSidedPolicy().place(req(prompt=1_000), v))[0]
    transfer = 0.001 + 1_000 * 128 * 1024 / 1e9
    assert c.predicted_ttft_s == pytest.approx(0.5 + 0.1 + transfer + 0.01)
    assert c.predicted_itl_s == pytest.approx(0.01)


def test_thousand_workers_still_place() -> None:
    v = view(
        [
            P(f"p{i}", queued_prompt_tokens=(i * 7919) % 50_000, group=f"g{i % 8}")
            for i in range(1000)
        ],
        [D(f"d{i}", reserved_blocks=(i * 104729) % 9_000, group=f"g{i % 8}") for i in range(1000)],
    )
    cands = placed(TwoSidedPolicy().place(req(prompt=4_000), v))
    assert len({c.decode_id for c in cands}) == 4


@pytest.mark.parametrize(
    "kwargs",
    [
        {"itl_slo_s": 0.0},
        {"prefix_weight": 1.5},
        {"max_candidates": 0},
        {"disagg_threshold_tokens": -1},
    ],
)
def test_two_sided_rejects_bad_arguments(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        TwoSidedPolicy(**kwargs)  # type: ignore[arg-type]


# -- safety rules and rejections, for every policy ----------------------------------------------


@pytest.mark.parametrize("name", sorted(ALL))
def test_worker_over_its_stranded_cap_is_skipped(name: str) -> None:
    capped = P("p-capped", stranded_bytes=10, stranded_cap_bytes=10)
    v = view([capped, P("p-ok", queued_prompt_tokens=90_000)], [D("d0"), D("d1")])
    for i in range(5):
        cands = placed(ALL[name]().place(req(request_id=f"r{i}"), v))
        assert {c.prefill_id for c in cands} == {"p-ok"}


@pytest.mark.parametrize("name", sorted(ALL))
def test_mixed_layouts_are_never_paired(name: str) -> None:
    v = view(
        [P("p-a", layout=LAYOUT), P("p-b", layout=OTHER)],
        [D("d-a", layout=LAYOUT), D("d-b", layout=OTHER), D("d-b2", layout=OTHER)],
    )
    layout_of = {"p-a": LAYOUT.key, "p-b": OTHER.key, "d-a": LAYOUT.key}
    layout_of.update({"d-b": OTHER.key, "d-b2": OTHER.key})
    for i in range(6):
        for c in placed(ALL[name]().place(req(request_id=f"r{i}"), v)):
            assert c.prefill_id is not None
            assert layout_of[c.prefill_id] == layout_of[c.decode_id]


@pytest.mark.parametrize("name", sorted(BUILTINS))
@pytest.mark.parametrize(
    ("prefill", "decode", "reason"),
    [
        ([P("p0", healthy=False)], [D("d0")], "no healthy prefill worker"),
        ([P("p0")], [D("d0", healthy=False)], "no healthy decode worker"),
        ([P("p0", layout=OTHER)], [D("d0")], "no decode worker with a compatible KV layout"),
        (
            [P("p0", stranded_bytes=5, stranded_cap_bytes=1)],
            [D("d0")],
            "no prefill worker under its stranded-KV cap",
        ),
        (
            [P("p0")],
            [D("d0", reserved_blocks=9_950), D("d1", used_blocks=9_960)],
            "no decode worker has 79 free blocks for this request (largest free: 50)",
        ),
        (
            [P("p0")],
            [D("d0", capacity=50)],
            "request needs 79 KV blocks, more than any decode worker holds (largest capacity: 50)",
        ),
    ],
)
def test_rejection_reasons(
    name: str, prefill: list[PrefillView], decode: list[DecodeView], reason: str
) -> None:
    decision = BUILTINS[name]().place(req(prompt=1000, max_tokens=256), view(prefill, decode))
    assert isinstance(decision, Rejection)
    assert decision.reason.startswith(reason), decision.reason
    assert RETRY_FLOOR_S <= decision.retry_after_s <= RETRY_CEILING_S


def test_retry_after_tracks_how_fast_room_frees() -> None:
    # Deficit 79 - 50 = 29 blocks = 464 tokens; a batch of 32 at 10 ms/step makes 3,200 tok/s.
    busy = D("d0", capacity=10_000, reserved_blocks=9_950, resident_seqs=32, step_base_s=0.01)
    fast = TwoSidedPolicy().place(req(), view([P("p0")], [busy]))
    assert isinstance(fast, Rejection)
    assert fast.retry_after_s == pytest.approx(RETRY_FLOOR_S)  # 0.145 s, floored
    slow = replace(busy, resident_seqs=1, step_base_s=0.05)
    later = TwoSidedPolicy().place(req(), view([P("p0")], [slow]))
    assert isinstance(later, Rejection)
    assert later.retry_after_s == pytest.approx(29 * 16 * 0.05)


# -- properties over random views, for every built-in policy -------------------------------------

layouts = st.sampled_from([LAYOUT, OTHER])
groups = st.sampled_from(["g0", "g1"])


@st.composite
def prefill_views(draw: st.DrawFn, i: int) -> PrefillView:
    cap = draw(st.sampled_from([0, 1_000, 1_000_000]))
    return PrefillView(
        f"p{i}",
        draw(layouts),
        healthy=draw(st.sampled_from([True, True, True, False])),
        group=draw(groups),
        queued_prompt_tokens=draw(st.integers(0, 100_000)),
        prefill_tokens_per_s=draw(st.floats(1_000, 50_000)),
        stranded_bytes=draw(st.integers(0, 2_000)),
        stranded_cap_bytes=cap,
        recent_prefixes=draw(st.frozensets(st.integers(0, 5), max_size=3)),
    )


@st.composite
def decode_views(draw: st.DrawFn, i: int) -> DecodeView:
    capacity = draw(st.integers(1, 5_000))
    return DecodeView(
        f"d{i}",
        draw(layouts),
        capacity,
        reserved_blocks=draw(st.integers(0, capacity)),
        used_blocks=draw(st.integers(0, capacity)),
        resident_seqs=draw(st.integers(0, 64)),
        healthy=draw(st.sampled_from([True, True, True, False])),
        group=draw(groups),
        step_base_s=draw(st.floats(0.001, 0.02)),
        step_s_per_block=draw(st.sampled_from([0.0, 1e-6, 1e-5])),
        can_prefill=draw(st.booleans()),
        prefill_tokens_per_s=draw(st.floats(1_000, 50_000)),
        queued_prompt_tokens=draw(st.integers(0, 20_000)),
    )


@st.composite
def cluster_views(draw: st.DrawFn) -> ClusterView:
    n_p = draw(st.integers(0, 5))
    n_d = draw(st.integers(1, 6))
    return ClusterView(
        tuple(draw(prefill_views(i)) for i in range(n_p)),
        tuple(draw(decode_views(i)) for i in range(n_d)),
        kv_bytes_per_token=draw(st.sampled_from([64 * 1024, 128 * 1024])),
        links={("g0", "g1"): draw(st.floats(1e9, 100e9))},
    )


@st.composite
def requests(draw: st.DrawFn) -> RequestInfo:
    max_tokens = draw(st.integers(1, 4_000))
    reserve = draw(st.none() | st.integers(1, 4_000))
    return RequestInfo(
        request_id=f"r{draw(st.integers(0, 3))}",
        model="m",
        prompt_tokens=draw(st.integers(1, 40_000)),
        max_tokens=max_tokens,
        estimate=None if reserve is None else OutputEstimate(reserve),
        prefix_hashes=tuple(draw(st.lists(st.integers(0, 5), max_size=4))),
        slo_itl_s=draw(st.none() | st.floats(0.002, 0.1)),
    )


def _remote_feasible(r: RequestInfo, v: ClusterView) -> bool:
    return any(
        p.healthy
        and d.healthy
        and p.under_stranded_cap
        and p.layout.key == d.layout.key
        and d.free_blocks
        >= blocks_for(r.prompt_tokens + r.reserve_output_tokens, d.layout.block_size)
        for p in v.prefill
        for d in v.decode
    )


def _check_safe(decision: object, r: RequestInfo, v: ClusterView, local_allowed: bool) -> None:
    if isinstance(decision, Rejection):
        assert decision.reason
        assert RETRY_FLOOR_S <= decision.retry_after_s <= RETRY_CEILING_S
        return
    assert isinstance(decision, Placement)
    assert 1 <= len(decision.candidates) <= 4
    prefill = {p.worker_id: p for p in v.prefill}
    decode = {d.worker_id: d for d in v.decode}
    for c in decision.candidates:
        d = decode[c.decode_id]
        assert d.healthy
        assert c.reserve_blocks == blocks_for(
            r.prompt_tokens + r.reserve_output_tokens, d.layout.block_size
        )
        assert d.free_blocks >= c.reserve_blocks
        if c.prefill_id is None:
            assert local_allowed and d.can_prefill
            continue
        p = prefill[c.prefill_id]
        assert p.healthy and p.under_stranded_cap
        assert p.layout.key == d.layout.key
        assert math.isfinite(c.predicted_ttft_s) and c.predicted_ttft_s > 0


PROPERTY_SETTINGS = settings(
    max_examples=60, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow]
)


@pytest.mark.parametrize("name", sorted(ALL))
@PROPERTY_SETTINGS
@given(v=cluster_views(), rs=st.lists(requests(), min_size=1, max_size=3))
def test_every_policy_is_safe_and_deterministic(
    name: str, v: ClusterView, rs: list[RequestInfo]
) -> None:
    first, second = ALL[name](), ALL[name]()
    for r in rs:
        decision = first.place(r, v)
        assert second.place(r, v) == decision  # same seed, same inputs, same answer
        _check_safe(decision, r, v, local_allowed=name == "two_sided")
        # Without an ITL SLO nothing but the safety rules can reject a request.
        if r.slo_itl_s is None and _remote_feasible(r, v):
            assert isinstance(decision, Placement), decision


@PROPERTY_SETTINGS
@given(v=cluster_views(), r=requests())
def test_two_sided_first_candidate_is_the_best_pair(v: ClusterView, r: RequestInfo) -> None:
    """The pruned search finds the same optimum as trying every pair (remote only, no SLO)."""
    v = replace(v, decode=tuple(replace(d, can_prefill=False) for d in v.decode))
    r = replace(r, slo_itl_s=None)
    policy = TwoSidedPolicy(prefix_weight=0.5)
    best = math.inf
    for p in v.prefill:
        for d in v.decode:
            need = blocks_for(r.prompt_tokens + r.reserve_output_tokens, d.layout.block_size)
            if not (p.healthy and d.healthy and p.under_stranded_cap) or d.free_blocks < need:
                continue
            if p.layout.key != d.layout.key:
                continue
            hit = prefix_hit_fraction(r.prefix_hashes, p.recent_prefixes)
            ttft = (
                (p.queued_prompt_tokens + r.prompt_tokens * (1 - 0.5 * hit))
                / p.prefill_tokens_per_s
                + v.transfer_s(r.prompt_tokens, p.group, d.group)
                + d.step_time_s(need)
            )
            best = min(best, ttft)
    decision = policy.place(r, v)
    if best == math.inf:
        assert isinstance(decision, Rejection)
    else:
        cands = placed(decision)
        assert cands[0].predicted_ttft_s == pytest.approx(best, rel=1e-12)
        distinct = [
            c for c in cands if c.decode_id not in {x.decode_id for x in cands[: cands.index(c)]}
        ]
        ttfts = [c.predicted_ttft_s for c in distinct]
        assert ttfts == sorted(ttfts)


@PROPERTY_SETTINGS
@given(v=cluster_views(), r=requests(), data=st.data())
def test_two_sided_best_pair_on_facts(v: ClusterView, r: RequestInfo, data: st.DataObject) -> None:
    """With cached_prefix_tokens known on some workers, the pruned search still finds the pair
    an exhaustive search finds, each term computed from the facts (remote only, no SLO)."""
    cached = st.none() | st.integers(0, 45_000)
    v = replace(
        v,
        prefill=tuple(replace(p, cached_prefix_tokens=data.draw(cached)) for p in v.prefill),
        decode=tuple(
            replace(d, can_prefill=False, cached_prefix_tokens=data.draw(cached)) for d in v.decode
        ),
    )
    r = replace(r, slo_itl_s=None)
    best = math.inf
    for p in v.prefill:
        for d in v.decode:
            need = blocks_for(r.prompt_tokens + r.reserve_output_tokens, d.layout.block_size)
            if not (p.healthy and d.healthy and p.under_stranded_cap) or d.free_blocks < need:
                continue
            if p.layout.key != d.layout.key:
                continue
            if p.cached_prefix_tokens is None:
                hit = prefix_hit_fraction(r.prefix_hashes, p.recent_prefixes)
                compute = r.prompt_tokens * (1 - 0.5 * hit)
            else:
                bs = p.layout.block_size
                compute = uncached_tokens(r.prompt_tokens, p.cached_prefix_tokens, bs)
            moved = r.prompt_tokens
            if d.cached_prefix_tokens is not None:
                bs = d.layout.block_size
                moved = uncached_tokens(r.prompt_tokens, d.cached_prefix_tokens, bs)
            ttft = (
                (p.queued_prompt_tokens + compute) / p.prefill_tokens_per_s
                + v.transfer_s(moved, p.group, d.group)
                + d.step_time_s(need)
            )
            best = min(best, ttft)
    decision = TwoSidedPolicy(prefix_weight=0.5).place(r, v)
    assert decision == TwoSidedPolicy(prefix_weight=0.5).place(r, v)
    if best == math.inf:
        assert isinstance(decision, Rejection)
    else:
        assert placed(decision)[0].predicted_ttft_s == pytest.approx(best, rel=1e-12)
