"""Issue 26, the calm policy: smoothing across snapshots, the switch-cost model, the engine's
pause in the simulator, and the decode-heavy phase's generator."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from disagg_tools.experiments.long_answers import LongAnswers, long_answer_phase
from disagg_tools.simcluster.config import ClusterConfig
from disagg_tools.traces import TraceRequest
from policies.base import RoleSnapshot, RoleWorkerView
from policies.role_pauses import ENGINE_RECONFIG_PAUSE_S
from policies.role_policies import ElasticRoles

RATE = 20_000.0


def worker(wid: str, role: str, **kw: Any) -> RoleWorkerView:
    base: dict[str, Any] = {
        "prefill_tokens_per_s": RATE,
        "capacity_blocks": 10_000,
        "step_base_s": 0.008,
        "step_s_per_block": 1e-6,
    }
    return RoleWorkerView(wid, role, **(base | kw))  # type: ignore[arg-type]


def balanced(now: float, queued_on_p0: int = 0) -> RoleSnapshot:
    """5P:3D with prefill at 0.8 and decode at 0.6 of their SLO-bound capacity."""
    ws = [worker(f"p{i}", "prefill") for i in range(5)]
    ws[0] = replace(ws[0], queued_prompt_tokens=queued_on_p0)
    ws += [worker(f"d{i}", "decode", held_blocks=6_000) for i in range(3)]
    return RoleSnapshot(
        now_s=now, workers=tuple(ws), prefill_demand_tokens_per_s=0.8 * 0.85 * 5 * RATE
    )


def test_one_giant_prompt_does_not_flip_a_worker() -> None:
    # A 2 M-token prompt queued on one prefill worker: this snapshot alone reads as a prefill
    # overload that moving a decode worker would ease...
    giant = balanced(1030.0, queued_on_p0=2_000_000)
    assert ElasticRoles().decide(giant).switches
    # ...but after 30 s of the steady mix it is one outlier in the window: the median holds.
    policy = ElasticRoles()
    for t in range(1000, 1030):
        assert policy.decide(balanced(float(t))).switches == ()
    plan = policy.decide(giant)
    assert plan.switches == ()
    assert plan.prefill_pressure == pytest.approx(0.8)
    # A shift that lasts (half the window and more) is acted on.
    for t in range(1031, 1060):
        plan = policy.decide(balanced(float(t), queued_on_p0=2_000_000))
        if plan.switches:
            break
    assert plan.switches and plan.switches[0].to_role == "prefill"


def test_smoothing_is_deterministic_and_restarts_on_an_older_snapshot() -> None:
    seq = [balanced(float(t), queued_on_p0=(2_000_000 if t % 7 == 0 else 0)) for t in range(60)]
    a, b = ElasticRoles(), ElasticRoles()
    assert [a.decide(s) for s in seq] == [b.decide(s) for s in seq]
    # An older snapshot (a new sequence, a new leader's clock) starts the window afresh.
    assert a.decide(balanced(0.0, queued_on_p0=2_000_000)).switches


def costly(n_p: int, held: int, resident: int, hold_s: float) -> RoleSnapshot:
    """n_p prefill workers at 0.6; 3 decode workers with lots of room, each holding `held`
    blocks of `resident` streams that hold their room `hold_s` on average."""
    ws = [worker(f"p{i}", "prefill") for i in range(n_p)]
    ws += [
        worker(
            f"d{i}",
            "decode",
            capacity_blocks=100_000,
            held_blocks=held,
            resident_seqs=resident,
        )
        for i in range(3)
    ]
    return RoleSnapshot(
        now_s=1000.0,
        workers=tuple(ws),
        prefill_demand_tokens_per_s=0.6 * 0.85 * n_p * RATE,
        decode_hold_s=hold_s,
    )


def test_the_cost_model_refuses_a_switch_its_gain_does_not_pay_for() -> None:
    # 3P at 0.6 -> 4P at 0.45: the gain is the pressure above the knee (0.5): 0.1 x 60 s = 6
    # pressure-s. Every decode worker holds 100 streams of 1,440 tokens that hold their room
    # ~600 s: 99 % of them would still run at the 5 s deadline and be re-prefilled elsewhere,
    # 143 K tokens = 7.1 s of one prefill worker's stalls: it does not pay.
    loaded = costly(3, held=9_000, resident=100, hold_s=600.0)
    policy = ElasticRoles()
    plan = policy.decide(loaded)
    assert plan.switches == ()
    assert "does not pay" in plan.note
    roles = {w.worker_id: w.role for w in loaded.workers} | {"d0": "prefill"}
    p, d = policy.pressures(loaded)
    cost = policy.switch_cost(loaded, loaded.workers[3], roles, max(p, d), 0.45, 0.1)
    assert cost.gain_ps == pytest.approx(6.0)
    assert cost.migrated == pytest.approx(99.2, abs=0.1)
    assert cost.cost_ps > cost.gain_ps and not cost.pays
    # The same gain with short-lived streams (all done within the deadline) pays for itself.
    quick = costly(3, held=9_000, resident=100, hold_s=0.5)
    plan = ElasticRoles().decide(quick)
    assert [sw.to_role for sw in plan.switches] == ["prefill"]
    assert "gain 6.0 vs cost" in plan.switches[0].reason


def test_the_pause_of_a_switch_grows_what_the_gain_must_pay() -> None:
    s = costly(3, held=0, resident=0, hold_s=0.0)
    roles = {w.worker_id: w.role for w in s.workers} | {"d0": "prefill"}
    policy = ElasticRoles()
    free = policy.switch_cost(s, s.workers[3], roles, 0.6, 0.45, 0.1)
    slow = policy.switch_cost(
        replace(s, reconfig_pause_s=59.0), s.workers[3], roles, 0.6, 0.45, 0.1
    )
    assert free.cost_ps == 0.0 and free.pays
    assert slow.cost_ps == pytest.approx(0.1 * 59.0) and slow.pays
    # A pause longer than the horizon: nothing of the gain is left to pay for it.
    late = replace(s, reconfig_pause_s=policy.horizon_s + 1.0)
    assert not policy.switch_cost(late, s.workers[3], roles, 0.6, 0.45, 0.1).pays


def test_the_simulator_takes_its_pause_from_the_engine_table() -> None:
    cfg = ClusterConfig.homogeneous(2, 3, elastic=True)
    assert cfg.engine == "sglang" and cfg.pause_s == ENGINE_RECONFIG_PAUSE_S["sglang"] == 2.0
    assert ClusterConfig.homogeneous(2, 3, elastic=True, engine="vllm").pause_s == 0.0
    assert ClusterConfig.homogeneous(2, 3, elastic=True, reconfig_pause_s=1.5).pause_s == 1.5
    with pytest.raises(ValueError, match="engine"):
        ClusterConfig.homogeneous(2, 3, elastic=True, engine="tgi")


def test_the_long_answer_phase_is_deterministic_under_a_seed() -> None:
    rows = [TraceRequest(0.1 * i, 1000 + i, 100, index=500 + i) for i in range(2000)]
    a, b = long_answer_phase(rows, seed=7), long_answer_phase(rows, seed=7)
    assert a == b
    assert long_answer_phase(rows, seed=8) != a
    # Arrivals, prompts and indexes kept; only the answers change, within the cut.
    assert [(r.arrival_s, r.prompt_tokens, r.index) for r in a] == [
        (r.arrival_s, r.prompt_tokens, r.index) for r in rows
    ]
    dist = LongAnswers()
    outs = sorted(r.output_tokens for r in a)
    assert dist.lo <= outs[0] and outs[-1] <= dist.hi
    assert 1800 <= outs[len(outs) // 2] <= 2300  # the median, 2,048
    # Seeded per row: a slice of the rows gets the same answers as in the whole.
    assert long_answer_phase(rows[100:200], seed=7) == a[100:200]


def test_a_phase_with_no_worker_gets_one_whatever_the_move_costs() -> None:
    """Every `both` worker decoding and prompts queued: the prefill pressure is infinite, and
    a move that gives prefill a worker pays (found live: inf gain against a NaN cost refused
    it, so a cluster that started all-decode never served a prefill)."""
    import math as _math

    from policies.base import RoleSnapshot, RoleWorkerView
    from policies.role_policies import ElasticRoles

    workers = tuple(
        RoleWorkerView(
            worker_id=f"b{i}", role="decode", state="active", can_switch=True,
            since_s=-_math.inf, queued_prompt_tokens=2_000_000 if i == 0 else 0,
            prefill_tokens_per_s=10_000.0, capacity_blocks=4096, held_blocks=0,
            resident_seqs=0, step_base_s=0.005, step_s_per_block=0.0,
        )
        for i in range(3)
    )  # fmt: skip
    snapshot = RoleSnapshot(now_s=1000.0, workers=workers, peak_queued_prompt_tokens=2e6)
    plan = ElasticRoles(min_time_in_role_s=0.0, reverse_after_s=0.0).decide(snapshot)
    assert [s.to_role for s in plan.switches][:1] == ["prefill"], plan
