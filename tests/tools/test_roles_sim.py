"""Elastic roles in the cluster simulator: drain, deadline resume, pause, exact accounting."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest

from disagg_tools.simcluster.config import ClusterConfig
from disagg_tools.simcluster.engine import simulate
from disagg_tools.simcluster.role_switching import RoleAccountingError
from policies.base import RolePlan, RoleSnapshot, RoleSwitch
from policies.role_policies import ElasticRoles, StaticRoles
from policies.two_sided import TwoSidedPolicy


@dataclass(frozen=True)
class Req:
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    prefix_hash_ids: tuple[int, ...] = ()


def trace(n: int, rate: float, prompt: int = 1000, out: int = 200, seed: int = 0) -> list[Req]:
    rng = random.Random(seed)
    t, reqs = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        reqs.append(Req(t, rng.randint(1, 2 * prompt), rng.randint(1, 2 * out)))
    return reqs


class Script:
    """A role policy that makes the given switches at the given times (once each)."""

    name = "script"

    def __init__(self, moves: list[tuple[float, str, str]]) -> None:
        self.moves = sorted(moves)

    def decide(self, snapshot: RoleSnapshot) -> RolePlan:
        due = [m for m in self.moves if m[0] <= snapshot.now_s]
        self.moves = [m for m in self.moves if m[0] > snapshot.now_s]
        return RolePlan(tuple(RoleSwitch(w, role, "scripted") for _, w, role in due))  # type: ignore[arg-type]


def clean(res, n: int) -> dict:
    s = res.summary()
    assert s["requests"] == n and s["ok"] + s["rejected"] + s["failed"] == n
    assert s["end_reserved_blocks"] == 0
    assert s["end_used_blocks"] == 0
    assert s["end_stranded_bytes"] == 0
    return s


def test_elastic_with_the_static_policy_is_the_fixed_cluster() -> None:
    reqs = trace(400, 30.0)
    cfg = ClusterConfig.homogeneous(2, 3)
    fixed = simulate(reqs, cfg, TwoSidedPolicy())
    elastic = simulate(reqs, cfg.with_(elastic=True), TwoSidedPolicy(), role_policy=StaticRoles())
    assert elastic.records == fixed.records
    assert elastic.summary()["role_switches"] == 0
    assert elastic.roles is not None and elastic.roles["timeline"]


def test_a_role_policy_needs_an_elastic_cluster() -> None:
    with pytest.raises(ValueError, match="elastic"):
        simulate(trace(3, 1.0), ClusterConfig.homogeneous(1, 1), TwoSidedPolicy(),
                 role_policy=StaticRoles())  # fmt: skip


def test_switches_both_ways_under_traffic_keep_the_accounting_exact() -> None:
    reqs = trace(1500, 40.0)
    cfg = ClusterConfig.homogeneous(2, 3, elastic=True, reconfig_pause_s=1.5)
    moves = [(5.0, "d0", "prefill"), (12.0, "p1", "decode"), (25.0, "d0", "decode"),
             (30.0, "p1", "prefill")]  # fmt: skip
    res = simulate(reqs, cfg, TwoSidedPolicy(), role_policy=Script(moves))
    s = clean(res, len(reqs))
    assert s["ok"] == len(reqs)
    log = res.roles["switches"]  # type: ignore[index]
    assert [(x["worker"], x["to"]) for x in log] == [(w, r) for _, w, r in moves]
    for x in log:
        assert x["t"] <= x["drained_t"] <= x["active_t"]
        assert x["active_t"] - x["drained_t"] == pytest.approx(1.5)
    # Every request got exactly its tokens, wherever it decoded.
    assert sorted(r.output_tokens for r in res.records) == sorted(r.output_tokens for r in reqs)


def test_drain_past_its_deadline_resumes_sequences_elsewhere() -> None:
    # Long answers: without a deadline the drain waits for them; with one they move.
    reqs = trace(300, 4.0, prompt=500, out=2000)
    cfg = ClusterConfig.homogeneous(1, 3, elastic=True, drain_deadline_s=1.0)
    res = simulate(reqs, cfg, TwoSidedPolicy(), role_policy=Script([(10.0, "d1", "prefill")]))
    s = clean(res, len(reqs))
    assert s["ok"] == len(reqs)
    assert s["role_migrated"] > 0
    (sw,) = res.roles["switches"]  # type: ignore[index]
    assert sw["migrated"] == s["role_migrated"]
    assert sw["drained_t"] - sw["t"] < 3.0
    slow = simulate(reqs, cfg.with_(drain_deadline_s=None), TwoSidedPolicy(),
                    role_policy=Script([(10.0, "d1", "prefill")]))  # fmt: skip
    clean(slow, len(reqs))
    (slow_sw,) = slow.roles["switches"]  # type: ignore[index]
    assert slow_sw["migrated"] == 0 and slow_sw["drained_t"] - slow_sw["t"] > 3.0


def test_leaving_prefill_hands_its_queue_on() -> None:
    reqs = [Req(0.001 * i, 4000, 20) for i in range(60)]  # a burst: deep prefill queues
    cfg = ClusterConfig.homogeneous(2, 2, elastic=True, role_interval_s=0.05)
    res = simulate(reqs, cfg, TwoSidedPolicy(), role_policy=Script([(0.05, "p0", "decode")]))
    s = clean(res, len(reqs))
    assert s["ok"] == len(reqs)
    assert res.roles["redispatched"] > 0  # type: ignore[index]


def test_elastic_policy_moves_workers_to_the_bottleneck() -> None:
    reqs = trace(3000, 60.0, prompt=1500, out=60)  # prefill-heavy
    cfg = ClusterConfig.homogeneous(1, 5, elastic=True)
    res = simulate(reqs, cfg, TwoSidedPolicy(), role_policy=ElasticRoles(), slo_ttft_s=2.0)
    clean(res, len(reqs))
    fixed = simulate(reqs, cfg, TwoSidedPolicy(), role_policy=StaticRoles(), slo_ttft_s=2.0)
    tl = res.roles["timeline"]  # type: ignore[index]
    assert tl[-1][1] > 1  # more prefill workers at the end than the one it started with
    assert res.summary()["slo_attainment"] > fixed.summary()["slo_attainment"]
    assert 0 < res.summary()["role_switches"] <= 6 * (tl[-1][0] / 60 + 1)


def test_a_drained_worker_that_still_holds_blocks_is_an_error(monkeypatch) -> None:
    from disagg_tools.simcluster import workers as cluster_workers

    original = cluster_workers.DecodeWorker.take

    def leaky(self, job, now):  # forgets to release one block of what it hands over
        ctx = original(self, job, now)
        self.held += 1
        return ctx

    monkeypatch.setattr(cluster_workers.DecodeWorker, "take", leaky)
    reqs = trace(300, 4.0, prompt=500, out=2000)
    cfg = ClusterConfig.homogeneous(1, 3, elastic=True, drain_deadline_s=1.0)
    with pytest.raises(RoleAccountingError):
        simulate(reqs, cfg, TwoSidedPolicy(), role_policy=Script([(10.0, "d1", "prefill")]))


def test_attainment_by_window_covers_every_counted_request() -> None:
    reqs = trace(500, 20.0)
    res = simulate(reqs, ClusterConfig.homogeneous(1, 2), TwoSidedPolicy())
    wins = res.attainment_by_window(5.0, first_index=100)
    assert sum(n for _, n, _ in wins) == 400
    assert all(0.0 <= a <= 1.0 for *_, a in wins)
    with pytest.raises(ValueError):
        res.attainment_by_window(0.0)


def test_transfers_queue_on_the_nics_with_link_contention() -> None:
    reqs = [Req(0.0, 8000, 2), Req(0.0, 8000, 2)]
    cfg = ClusterConfig.homogeneous(1, 2, link_bytes_per_s=1e9)
    free = simulate(reqs, cfg, TwoSidedPolicy())
    queued = simulate(reqs, cfg.with_(link_contention=True), TwoSidedPolicy())
    clean(queued, 2)
    transfer = 8000 * cfg.kv_bytes_per_token / 1e9
    first, second = sorted(r.ttft_s for r in free.records)
    q_first, q_second = sorted(r.ttft_s for r in queued.records)
    assert q_first == pytest.approx(first)
    # The second KV leaves P only when the first is through: one transfer time after it.
    assert q_second - q_first == pytest.approx(transfer, rel=0.05)
    assert q_second > second


def test_every_gpu_both_phases_needs_local_prefill() -> None:
    with pytest.raises(ValueError, match="local_prefill"):
        ClusterConfig.homogeneous(0, 4)
    reqs = trace(300, 20.0)
    res = simulate(reqs, ClusterConfig.homogeneous(0, 4, local_prefill=True), TwoSidedPolicy())
    s = clean(res, len(reqs))
    assert s["ok"] == len(reqs)
    assert s["stranded_byte_s"] == 0  # no KV ever left a GPU
