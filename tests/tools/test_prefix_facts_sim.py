"""Placement on facts in the simulator (issue 22): exact prefix caches on both pools, the router's
event-fed index of them, the affinity modes, and the multi-turn workload. CI-sized: seconds."""

from __future__ import annotations

import pytest

from disagg_tools.simcluster.config import ClusterConfig
from disagg_tools.simcluster.engine import simulate
from disagg_tools.simcluster.metrics import SimResult
from disagg_tools.simcluster.prefix_cache import KVIndex, PrefixCache
from disagg_tools.traces import TRACE_DIR, TraceRequest, multi_turn
from policies.estimators import OnlineQuantileEstimator
from policies.two_sided import TwoSidedPolicy

AZURE_CONV = TRACE_DIR / "AzureLLMInferenceTrace_conv.csv"
BLOCK = 64


@pytest.fixture(scope="module")
def conversations() -> list[TraceRequest]:
    if not AZURE_CONV.is_file():
        pytest.skip(f"shared trace not found: {AZURE_CONV}")
    return multi_turn(AZURE_CONV, conversations=60, seed=3, block_tokens=BLOCK, system_tokens=512)


def _run(reqs: list[TraceRequest], affinity: str | None, **knobs: object) -> SimResult:
    cfg = ClusterConfig.homogeneous(
        2,
        3,
        affinity=affinity,  # type: ignore[arg-type]
        prefix_cache_blocks=knobs.pop("cache", 400),  # type: ignore[arg-type]
        prefix_block_tokens=BLOCK,
        local_prefill=True,
        **knobs,  # type: ignore[arg-type]
    )
    return simulate(reqs, cfg, TwoSidedPolicy(), OnlineQuantileEstimator(), rate_scale=2.0)


# -- the cache and its events -------------------------------------------------------------------


def test_cache_hits_a_leading_run_and_evicts_a_chain_tail_first() -> None:
    events: list[tuple[str, tuple[int, ...]]] = []
    cache = PrefixCache(4, events.append)
    cache.store((1, 2, 3))
    assert cache.hit_blocks((1, 2, 3, 9)) == 3
    cache.store((7, 8))  # room for one more: the LRU block goes, the tail of (1, 2, 3)
    assert cache.blocks() == {1, 2, 7, 8}
    assert cache.hit_blocks((1, 2, 3)) == 2
    assert events == [("stored", (1, 2, 3)), ("removed", (3,)), ("stored", (7, 8))]
    assert KVIndex.replay(events).blocks() == cache.blocks()


def test_a_zero_sized_cache_holds_nothing() -> None:
    cache = PrefixCache(0)
    cache.store((1, 2))
    assert len(cache) == 0 and cache.hit_blocks((1,)) == 0


# -- the workload --------------------------------------------------------------------------------


def test_turns_extend_the_previous_turn(conversations: list[TraceRequest]) -> None:
    assert conversations == multi_turn(
        AZURE_CONV, conversations=60, seed=3, block_tokens=BLOCK, system_tokens=512
    )
    assert [r.index for r in conversations] == list(range(len(conversations)))
    by_head: dict[int, list[TraceRequest]] = {}
    for r in conversations:
        assert len(r.prefix_hash_ids) == r.prompt_tokens // BLOCK
        assert r.prefix_hash_ids[:8] == tuple(range(8))  # the shared system prompt
        if len(r.prefix_hash_ids) > 8:  # its conversation's first own block names it
            by_head.setdefault(r.prefix_hash_ids[8], []).append(r)
    multi = [turns for turns in by_head.values() if len(turns) > 1]
    assert len(multi) > 5 and len(by_head) <= 60
    for turns in multi:
        for before, after in zip(turns, turns[1:], strict=False):
            assert after.arrival_s >= before.arrival_s
            assert after.prompt_tokens > before.prompt_tokens + before.output_tokens - 1
            assert after.prefix_hash_ids[: len(before.prefix_hash_ids)] == before.prefix_hash_ids


# -- the simulator -------------------------------------------------------------------------------


def test_the_router_index_equals_the_cache_at_every_placement(
    conversations: list[TraceRequest],
) -> None:
    res = _run(conversations, "exact", check_views=True)
    s = res.summary()
    assert s["ok"] == len(conversations)
    # One check per placement, each comparing every worker's index with its cache.
    assert s["view_checks"] >= len(conversations)
    assert 0.3 < s["prefix_hit_rate"] < 1.0


def test_lagged_events_replay_to_the_cache(conversations: list[TraceRequest]) -> None:
    # check_views replays every worker's published events at the end of the run (all lagged
    # events delivered by then) and compares them, and the router's index, with its cache.
    res = _run(conversations, "exact", cache=200, kv_event_lag_s=0.2, check_views=True)
    s = res.summary()
    assert s["view_checks"] == 5  # one replay per worker; no per-placement check under lag
    assert s["prefix_evicted_blocks"] > 0  # the small cache did evict: removals exercised
    assert s["ok"] == len(conversations)


def test_runs_are_deterministic_and_the_modes_differ_only_in_what_the_router_sees(
    conversations: list[TraceRequest],
) -> None:
    exact = _run(conversations, "exact").summary()
    assert _run(conversations, "exact").summary() == exact
    none = _run(conversations, "none").summary()
    prefill_only = _run(conversations, "exact_prefill").summary()
    oracle = _run(conversations, "oracle").summary()
    assert exact["prefix_hit_rate"] >= none["prefix_hit_rate"]
    assert exact["kv_bytes_moved"] < prefill_only["kv_bytes_moved"]  # D's cache is a fact too
    assert exact == oracle  # no event lag: the index is the cache


def test_without_a_mode_the_simulator_is_as_before(conversations: list[TraceRequest]) -> None:
    res = _run(conversations, None).summary()
    assert "prefix_hit_rate" not in res and "kv_bytes_moved" not in res


@pytest.mark.parametrize(
    "bad",
    [{"affinity": "sometimes"}, {"kv_event_lag_s": -1.0}, {"affinity": "exact", "elastic": True}],
)
def test_bad_knobs_are_refused(bad: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        ClusterConfig.homogeneous(2, 2, **bad)  # type: ignore[arg-type]


def test_the_experiment_smoke_grid_has_every_row_and_verdict() -> None:
    from disagg_tools.experiments import prefix_facts

    if not AZURE_CONV.is_file():
        pytest.skip(f"shared trace not found: {AZURE_CONV}")
    works = [w for w in prefix_facts.workloads(smoke=True) if w.name == "multi_turn"]
    rows = prefix_facts.run_grid(works, caches=("gpu",))
    assert [r["mode"] for r in rows] == list(prefix_facts.MODES)
    by = {r["mode"]: r for r in rows}
    assert by["exact"]["kv_gb_moved"] < by["exact_prefill"]["kv_gb_moved"]
    assert by["exact"]["hit_rate"] > by["none"]["hit_rate"]
    table = prefix_facts.markdown(rows)
    assert table.count("\n") == len(rows) + 1
    (verdict,) = prefix_facts.checks(rows)
    assert verdict.startswith("multi_turn/gpu:")
