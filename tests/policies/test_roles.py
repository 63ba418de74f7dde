"""Role policies as pure functions: pressures, the elastic rule's guards, the registry."""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from policies.base import Role, RolePlan, RolePolicy, RoleSnapshot, RoleSwitch, RoleWorkerView
from policies.registry import BUILTIN_ROLE_POLICIES, PolicyLoadError, load_role_policy
from policies.role_policies import ElasticRoles, StaticRoles, role_pressures, split_of

RATE = 20_000.0  # prefill tokens/s per worker
CAP = 10_000  # KV blocks per worker


def worker(wid: str, role: str, **kw: Any) -> RoleWorkerView:
    base: dict[str, Any] = {
        "prefill_tokens_per_s": RATE,
        "capacity_blocks": CAP,
        "step_base_s": 0.008,
        "step_s_per_block": 1e-6,
    }
    base.update(kw)
    return RoleWorkerView(wid, role, **base)  # type: ignore[arg-type]


def snap(
    n_p: int, n_d: int, *, demand: float, held: int = 0, now: float = 1000.0, **kw: Any
) -> RoleSnapshot:
    """n_p prefill + n_d decode workers; `held` blocks spread evenly over the decode side."""
    ws = [worker(f"p{i}", "prefill") for i in range(n_p)]
    ws += [worker(f"d{i}", "decode", held_blocks=held // max(1, n_d)) for i in range(n_d)]
    return RoleSnapshot(now_s=now, workers=tuple(ws), prefill_demand_tokens_per_s=demand, **kw)


def test_pressures_scale_with_the_pool_size() -> None:
    s = snap(2, 6, demand=34_000.0, held=27_000)
    p, d = role_pressures(s)
    assert p == pytest.approx(34_000 / (0.85 * 2 * RATE))
    assert d == pytest.approx(27_000 / (6 * 0.9 * CAP))
    roles = {w.worker_id: w.role for w in s.workers} | {"d0": "prefill", "d1": "prefill"}
    p2, d2 = role_pressures(s, roles)  # type: ignore[arg-type]
    assert p2 == pytest.approx(p / 2)
    assert d2 == pytest.approx(d * 6 / 4)
    assert split_of(roles) == (4, 4)  # type: ignore[arg-type]


def test_decode_capacity_is_the_tighter_of_kv_and_step_time() -> None:
    # 0.8 × 100 ms ITL: (0.08 - 0.008) / 1e-5 = 7,200 blocks < 0.9 × 10,000 of KV.
    d0 = worker("d0", "decode", held_blocks=3600, step_s_per_block=1e-5)
    slow = replace(snap(1, 1, demand=0.0, held=3600), workers=(worker("p0", "prefill"), d0))
    assert role_pressures(slow)[1] == pytest.approx(0.5)
    # A worker whose bare step breaks the ITL SLO adds no decode capacity.
    useless = replace(slow, workers=(worker("d0", "decode", held_blocks=1, step_base_s=0.2),))
    assert role_pressures(useless)[1] == math.inf


def test_queued_prompts_and_their_recent_peak_count_as_prefill_load() -> None:
    quiet = snap(2, 2, demand=0.0)
    assert role_pressures(quiet)[0] == 0.0
    queued = replace(
        quiet, workers=(worker("p0", "prefill", queued_prompt_tokens=20_000), *quiet.workers[1:])
    )
    # 20k tokens over 2 × 20k tokens/s = 0.5 s of wait, against 0.5 × the 2 s TTFT SLO.
    assert role_pressures(queued, wait_fraction=0.5)[0] == pytest.approx(0.5)
    peak = replace(quiet, peak_queued_prompt_tokens=40_000.0)
    assert role_pressures(peak, wait_fraction=0.5)[0] == pytest.approx(1.0)


def test_decode_demand_forecast_and_waiting_requests_count() -> None:
    s = snap(1, 2, demand=0.0, held=1000, decode_demand_blocks=9000.0, decode_waiting_blocks=900)
    assert role_pressures(s)[1] == pytest.approx((9000 + 900) / (2 * 0.9 * CAP))


def test_static_never_switches_but_reports_pressures() -> None:
    plan = StaticRoles().decide(snap(1, 7, demand=100_000.0))
    assert plan.switches == ()
    assert plan.prefill_pressure > 5
    assert isinstance(StaticRoles(), RolePolicy)


def test_elastic_moves_decode_workers_to_an_overloaded_prefill_pool() -> None:
    s = snap(2, 6, demand=60_000.0, held=6000)
    plan = ElasticRoles().decide(s)
    assert plan.switches
    assert all(sw.to_role == "prefill" and sw.worker_id.startswith("d") for sw in plan.switches)
    assert len(plan.switches) <= 2  # max_switches_per_decision
    assert "2P:6D -> 3P:5D" in plan.switches[0].reason
    assert plan.prefill_pressure == pytest.approx(role_pressures(s)[0])


def test_elastic_moves_prefill_workers_to_a_full_decode_pool() -> None:
    plan = ElasticRoles().decide(snap(6, 2, demand=10_000.0, held=17_000))
    assert plan.switches and plan.switches[0].to_role == "decode"


def test_hysteresis_keeps_a_balanced_split() -> None:
    # 5P:3D at (0.8, 0.7): 6P:2D would be (0.67, 1.05), 4P:4D (1.0, 0.53): neither is better.
    s = snap(5, 3, demand=0.8 * 0.85 * 5 * RATE, held=int(0.7 * 3 * 0.9 * CAP))
    assert ElasticRoles().decide(s).switches == ()
    # A move that improves the worst pressure by less than the hysteresis is not made either.
    s2 = snap(2, 2, demand=1.1 * 0.85 * 2 * RATE, held=int(0.95 * 2 * 0.9 * CAP))
    assert ElasticRoles(hysteresis=0.15).decide(s2).switches == ()


def test_minimum_time_in_role_grows_with_the_pause() -> None:
    s = snap(1, 3, demand=60_000.0, held=100, now=100.0)
    recent = replace(s, workers=tuple(replace(w, since_s=90.0) for w in s.workers))
    assert ElasticRoles(min_time_in_role_s=5.0, reverse_after_s=0).decide(recent).switches
    assert not ElasticRoles(min_time_in_role_s=20.0, reverse_after_s=0).decide(recent).switches
    # 3 × a 10 s pause = 30 s in role before a move, whatever min_time_in_role_s says.
    paused = replace(recent, reconfig_pause_s=10.0)
    assert not ElasticRoles(min_time_in_role_s=5.0, reverse_after_s=0).decide(paused).switches


def test_a_recent_switch_is_reversed_only_to_end_an_overload() -> None:
    # d0 left prefill for decode 30 s ago; now prefill reads a little heavier than decode.
    base = snap(2, 4, demand=0.7 * 0.85 * 2 * RATE, held=int(0.3 * 4 * CAP), now=100.0)
    ws = tuple(replace(w, since_s=70.0) if w.worker_id == "d0" else w for w in base.workers)
    mild = replace(base, workers=ws)
    assert ElasticRoles(reverse_after_s=0).decide(mild).switches
    plan = ElasticRoles(reverse_after_s=60).decide(mild)
    assert not plan.switches and "not reversing" in plan.note
    # An overload (prefill 1.2) that one move ends (-> 0.8) is reversed at once.
    hot = replace(mild, prefill_demand_tokens_per_s=1.2 * 0.85 * 2 * RATE)
    assert ElasticRoles(reverse_after_s=60, max_switches_per_decision=1).decide(hot).switches


def test_switches_per_minute_are_capped() -> None:
    s = snap(1, 7, demand=200_000.0, held=100, now=100.0)
    full = replace(s, recent_switches_s=(41.0, 50.0, 60.0, 70.0, 80.0, 90.0))
    assert ElasticRoles(max_switches_per_minute=6).decide(full).switches == ()
    expired = replace(s, recent_switches_s=(10.0, 20.0, 30.0, 39.0, 40.0, 90.0))
    assert len(ElasticRoles(max_switches_per_minute=6).decide(expired).switches) == 2


def test_light_load_moves_nothing() -> None:
    plan = ElasticRoles().decide(snap(1, 7, demand=2_000.0))
    assert plan.switches == () and "lightly" in plan.note


def test_pools_never_go_below_their_minimum() -> None:
    plan = ElasticRoles(max_switches_per_decision=8, max_switches_per_minute=8).decide(
        snap(1, 3, demand=1e9, held=0)
    )
    n_p, n_d = 1 + len(plan.switches), 3 - len(plan.switches)
    assert n_d == 1 and n_p == 3


def test_only_active_switchable_workers_move_and_the_cheapest_drain_first() -> None:
    ws = (
        worker("p0", "prefill"),
        worker("d0", "decode", can_switch=False),
        worker("d1", "decode", state="draining"),
        worker("d2", "decode", held_blocks=900),
        worker("d3", "decode", held_blocks=100),
    )
    s = RoleSnapshot(now_s=1000.0, workers=ws, prefill_demand_tokens_per_s=60_000.0)
    plan = ElasticRoles(max_switches_per_decision=1).decide(s)
    assert [sw.worker_id for sw in plan.switches] == ["d3"]
    # Deterministic: the same snapshot gives the same plan.
    assert ElasticRoles(max_switches_per_decision=1).decide(s) == plan


def test_workers_in_transition_count_where_they_are_heading() -> None:
    s = snap(2, 6, demand=60_000.0, held=6000)
    heading = replace(
        s,
        workers=tuple(
            replace(w, role="prefill", state="paused") if w.worker_id in ("d0", "d1") else w
            for w in s.workers
        ),
    )
    first = ElasticRoles().decide(s).switches
    later = ElasticRoles().decide(heading).switches
    assert len(later) <= len(first)
    assert not {"d0", "d1"} & {sw.worker_id for sw in later}


def _snapshots() -> st.SearchStrategy[RoleSnapshot]:
    def build(
        roles: list[bool],
        demand: float,
        held: list[int],
        queued: list[int],
        since: list[float],
        recent: int,
    ) -> RoleSnapshot:
        ws = tuple(
            worker(
                f"w{i}",
                "prefill" if r else "decode",
                held_blocks=0 if r else h,
                queued_prompt_tokens=q if r else 0,
                since_s=t,
            )
            for i, (r, h, q, t) in enumerate(zip(roles, held, queued, since, strict=False))
        )
        return RoleSnapshot(
            now_s=1000.0,
            workers=ws,
            prefill_demand_tokens_per_s=demand,
            recent_switches_s=tuple(999.0 - i for i in range(recent)),
        )

    n = st.integers(2, 12)
    return n.flatmap(
        lambda k: st.builds(
            build,
            st.lists(st.booleans(), min_size=k, max_size=k),
            st.floats(0, 1e6),
            st.lists(st.integers(0, 3 * CAP), min_size=k, max_size=k),
            st.lists(st.integers(0, 10**6), min_size=k, max_size=k),
            st.lists(st.floats(0, 1000), min_size=k, max_size=k),
            st.integers(0, 8),
        )
    )


def _edge_snapshot() -> RoleSnapshot:
    """The draw that looked like a broken promise (before 0.3, after 0.2609: 1.15 x after 3e-6
    over before): the test measured with `role_pressures`' own KV target (0.9) where the policy
    measures with its own (1.0), so decode pressures differed by 1/0.9 between the two. In the
    policy's own pressures the move keeps the margin; the test now asks the policy for them."""

    def view(i: int, role: Role, queued: int = 0, held: int = 0) -> RoleWorkerView:
        return RoleWorkerView(
            worker_id=f"w{i}", role=role, state="active", can_switch=True, since_s=0.0,
            queued_prompt_tokens=queued, prefill_tokens_per_s=20000.0, capacity_blocks=10000,
            held_blocks=held, pending_blocks=0, resident_seqs=0, step_base_s=0.008,
            step_s_per_block=1e-06,
        )  # fmt: skip

    workers = [view(0, "prefill", queued=12000), *(view(i, "decode") for i in range(1, 8))]
    workers += [view(8, "prefill"), view(9, "decode", held=16435)]
    return RoleSnapshot(
        now_s=1000.0, workers=tuple(workers), prefill_demand_tokens_per_s=0.0,
        peak_queued_prompt_tokens=0.0, decode_waiting_blocks=0, decode_waiting_prompt_tokens=0,
        decode_demand_blocks=0.0, decode_hold_s=0.0, slo_ttft_s=2.0, slo_itl_s=0.1,
        reconfig_pause_s=0.0, recent_switches_s=(),
    )  # fmt: skip


@settings(max_examples=200, deadline=None)
@example(_edge_snapshot())
@given(_snapshots())
def test_elastic_plans_are_well_formed_and_lower_the_worst_pressure(s: RoleSnapshot) -> None:
    policy = ElasticRoles()
    plan = policy.decide(s)
    assert isinstance(plan, RolePlan)
    by_id = {w.worker_id: w for w in s.workers}
    moved = [sw.worker_id for sw in plan.switches]
    assert len(moved) == len(set(moved)) <= policy.max_switches_per_decision
    assert len(moved) + len(s.recent_switches_s) <= max(
        policy.max_switches_per_minute, len(s.recent_switches_s)
    )
    roles = {w.worker_id: w.role for w in s.workers}
    for sw in plan.switches:
        w = by_id[sw.worker_id]
        assert sw.to_role != w.role and w.can_switch and w.serving
        assert s.now_s - w.since_s >= policy.min_time_in_role_s
        roles[sw.worker_id] = sw.to_role
    if moved:
        n_p, n_d = split_of(roles)
        assert n_p >= policy.min_prefill and n_d >= policy.min_decode
        # The promise is in the policy's own pressures (its targets, not role_pressures' defaults).
        before, after = max(policy.pressures(s)), max(policy.pressures(s, roles))
        assert after * (1 + policy.hysteresis) <= before * (1 + 1e-9)


# -- the registry ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(BUILTIN_ROLE_POLICIES))
def test_builtin_role_policies_load(name: str) -> None:
    policy = load_role_policy(name)
    assert policy.name == name and isinstance(policy, RolePolicy)


def test_default_role_policy_is_static_and_arguments_reach_it() -> None:
    assert load_role_policy(None).name == "static"
    assert load_role_policy("elastic", {"hysteresis": 0.3}).hysteresis == 0.3


class _Stuck:
    name = "stuck"

    def decide(self, snapshot: RoleSnapshot) -> RolePlan:
        return RolePlan((RoleSwitch("nobody", "prefill"),))


class _NotAPlan:
    name = "not_a_plan"

    def decide(self, snapshot: RoleSnapshot) -> Any:
        return ["smoke-a"]


def test_dotted_path_role_policy() -> None:
    assert load_role_policy("policies.role_policies:ElasticRoles", {"seed": 3}).seed == 3


@pytest.mark.parametrize(
    ("spec", "kwargs", "message"),
    [
        ("nope", None, "unknown role policy"),
        ("elastic", {"hysteresis": -1}, "raised ValueError"),
        ("elastic", {"bogus": 1}, "does not accept"),
        ("tests.policies.test_roles:_Stuck", None, "unknown worker"),
        ("tests.policies.test_roles:_NotAPlan", None, "expected a RolePlan"),
        ("policies.two_sided:TwoSidedPolicy", None, "not a role policy"),
    ],
)
def test_broken_role_policy_specs_fail_at_load(spec: str, kwargs: Any, message: str) -> None:
    with pytest.raises(PolicyLoadError, match=message):
        load_role_policy(spec, kwargs)


def test_room_held_for_requests_still_in_prefill_is_prefill_backlog() -> None:
    ws = (worker("p0", "prefill"), worker("d0", "decode", held_blocks=9000, pending_blocks=6000))
    s = RoleSnapshot(
        now_s=10.0, workers=ws, decode_waiting_blocks=3000, decode_waiting_prompt_tokens=40_000
    )
    p, d = role_pressures(s, wait_fraction=0.5)
    # Decode: 3,000 blocks really decoding plus a third of the waiting ones (W adds to H when the
    # hold time is unknown); prefill: two thirds of the waiting prompts.
    assert d == pytest.approx((3000 + 1000) / (0.9 * CAP))
    assert p == pytest.approx((40_000 * 2 / 3) / (0.5 * 2.0 * RATE), rel=1e-3)
    # With a hold time, waiting room is the wait it causes: 1,000 blocks × 4 s / (1 s × 9,000).
    p2, d2 = role_pressures(replace(s, decode_hold_s=4.0), wait_fraction=0.5)
    assert d2 == pytest.approx(max(3000 / 9000, 1000 * 4.0 / (0.5 * 2.0 * 9000)))


def test_one_switch_toward_a_role_at_a_time_when_asked() -> None:
    s = snap(2, 6, demand=60_000.0, held=6000)
    assert len(ElasticRoles().decide(s).switches) == 2
    one = ElasticRoles(max_in_flight_per_role=1)
    assert len(one.decide(s).switches) == 1
    under_way = replace(
        s,
        workers=tuple(
            replace(w, role="prefill", state="draining") if w.worker_id == "d0" else w
            for w in s.workers
        ),
    )
    plan = one.decide(under_way)
    assert plan.switches == () and "under way" in plan.note
