"""Tenants under a flood in the cluster simulator (issue 25): the fairness policy the router
loads orders the simulator's admission queue (disagg_tools/simcluster/fair_queue.py).

Short runs, no timings asserted; every run is charged as the router charges (admission_charge
on the placed candidate, settled at release). What holds is asserted, each against fifo failing
it; the issue's isolation target, which vtc does not meet (docs/benchmarks.md, "Tenants under a
flood"), is a strict xfail, so meeting it turns it into a failure to be promoted."""

from __future__ import annotations

from typing import Any

import pytest

from disagg_tools.experiments.flood import (
    FloodSetup,
    run_mix,
    served,
    share_deviation,
    tenant_row,
)
from disagg_tools.experiments.flood_shares import (
    SharesRun,
    backlogged,
    share_errors,
    shares_across_replicas,
)
from disagg_tools.simcluster.replica_queues import Replicas, placement
from disagg_tools.simcluster.tenants import TenantLoad, parse_mix, tenant_streams
from disagg_tools.traces import TraceRequest

SETUP = FloodSetup(duration_s=40.0, warmup_s=10.0, pool=500)
CAPACITY_RPS = 36.0  # `capacity(FloodSetup())`, docs/benchmarks.md


@pytest.fixture(scope="module")
def pool() -> list[TraceRequest]:
    return SETUP.lengths()


# The shares' runs need the benchmark's window: a 30 s one after a 10 s warm-up still holds the
# start's transient (the estimator cold, every tenant arriving at once; up to 29 % off).
FULL = FloodSetup()


@pytest.fixture(scope="module")
def full_pool() -> list[TraceRequest]:
    return FULL.lengths()


def test_parse_mix_and_streams_are_deterministic(pool: list[TraceRequest]) -> None:
    mix = parse_mix("victim:1:4,aggressor:2:40:1")
    assert [(t.name, t.weight, t.rate, t.priority) for t in mix] == [
        ("victim", 1.0, 4.0, 0),
        ("aggressor", 2.0, 40.0, 1),
    ]
    a = tenant_streams(pool, mix, 10.0, seed=3)
    assert a == tenant_streams(pool, mix, 10.0, seed=3)
    # The victim's requests do not depend on who else is in the mix.
    alone = tenant_streams(pool, mix[:1], 10.0, seed=3)
    assert [r for r in a if r.tenant == "victim"] == alone
    with pytest.raises(ValueError):
        parse_mix("a:1")


def _two_backlogged() -> tuple[TenantLoad, ...]:
    return (TenantLoad("light", 1.0, 3 * CAPACITY_RPS), TenantLoad("heavy", 3.0, 3 * CAPACITY_RPS))


def _deviation(policy: str, pool: list[TraceRequest]) -> float:
    mix = _two_backlogged()
    _, res = run_mix(SETUP, mix, policy, pool, max_wait_s=30.0)
    weights = {t.name: t.weight for t in mix}
    return share_deviation(SETUP, res, weights, SETUP.warmup_s, SETUP.duration_s)["units_max_dev"]


def test_vtc_shares_converge_to_the_weights_and_fifo_does_not(pool: list[TraceRequest]) -> None:
    # Served units within 5 % of the weights 1:3 (measured: 1.1 %).
    assert _deviation("vtc", pool) < 0.05
    # fifo serves in arrival order: equal arrival rates, equal shares, far from 1:3.
    assert _deviation("fifo", pool) > 0.3


def test_the_simulated_run_is_deterministic(pool: list[TraceRequest]) -> None:
    mix = _two_backlogged()
    runs = [run_mix(SETUP, mix, "vtc", pool)[1] for _ in range(2)]
    assert runs[0].summary() == runs[1].summary()
    assert [r.tenant for r in runs[0].records] == [r.tenant for r in runs[1].records]


def _flooded(policy: str, pool: list[TraceRequest]) -> tuple[dict[str, Any], dict[str, Any], float]:
    """The victim's rows solo and flooded, and its share of the flood's served units."""
    victim = TenantLoad("victim", 1.0, 0.5 * CAPACITY_RPS)
    aggressor = TenantLoad("aggressor", 1.0, 5 * CAPACITY_RPS)
    _, solo = run_mix(SETUP, (victim,), policy, pool)
    _, flood = run_mix(SETUP, (victim, aggressor), policy, pool)
    units, _ = served(flood, ("victim", "aggressor"), SETUP.warmup_s, SETUP.duration_s)
    share = units["victim"] / sum(units.values())
    return tenant_row(SETUP, solo, "victim"), tenant_row(SETUP, flood, "victim"), share


def test_vtc_gives_the_flooded_victim_its_share_and_fifo_does_not(
    pool: list[TraceRequest],
) -> None:
    # Weight 1 of 2: half the units served while both want more (measured 49 %; fifo 10 %).
    _, vtc, vtc_share = _flooded("vtc", pool)
    _, fifo, fifo_share = _flooded("fifo", pool)
    assert abs(vtc_share - 0.5) < 0.05
    assert fifo_share < 0.35
    assert vtc["goodput_rps"] > 2 * fifo["goodput_rps"]


@pytest.mark.xfail(
    strict=True,
    reason="a victim offered exactly its share keeps ~53 % of its solo goodput and its TTFT p99 "
    "sits at the 2 s admission deadline under vtc, though it is served its weight share of "
    "units: its solo load is ~95 % of a flooded cluster's block-seconds; below its share "
    "goodput holds but TTFT p99 does not, room frees only as decodes end "
    "(docs/benchmarks.md, 'Tenants under a flood')",
)
def test_vtc_keeps_the_flooded_victim_near_its_solo(pool: list[TraceRequest]) -> None:
    base, under, _ = _flooded("vtc", pool)
    assert under["goodput_rps"] >= 0.9 * base["goodput_rps"]
    assert under["ttft_p99_s"] <= 1.1 * base["ttft_p99_s"]


def test_fifo_lets_the_aggressor_take_the_victims_share(pool: list[TraceRequest]) -> None:
    base, under, _ = _flooded("fifo", pool)
    assert under["goodput_rps"] < 0.5 * base["goodput_rps"]
    assert under["rejected"] > 0


def _victim_p99(pool: list[TraceRequest], name: str, shared: bool) -> float:
    """The victim's TTFT p99 under vtc with the live bench's shape (a light victim, an
    aggressor that alone fills the room and queues, 30 s waits): a queue and vtc counters per
    replica (today's router) or one for the cluster."""
    victim = TenantLoad("victim", 1.0, CAPACITY_RPS / 6)
    aggressor = TenantLoad("aggressor", 1.0, 1.5 * CAPACITY_RPS)
    reps = Replicas(2, placement(name), 0.1, shared)
    _, res = run_mix(SETUP, (victim, aggressor), "vtc", pool, replicas=reps, max_wait_s=30.0)
    row = tenant_row(SETUP, res, "victim")
    assert row["ok"] > 0
    return float(row["ttft_p99_s"])


def test_per_replica_queues_make_the_victim_wait_across_replicas(
    pool: list[TraceRequest],
) -> None:
    # Issue 33: room freed on the aggressor's replica goes to its own waiters first and each
    # replica's counters see one tenant: with the victim on replica 0 and the aggressor on 1 it
    # waits far longer than with both on one replica or one line for the cluster (measured
    # 10.8, 0.9 and 2.4 s over 60 s).
    split = _victim_p99(pool, "split", shared=False)
    assert split > 2 * _victim_p99(pool, "one", shared=False)
    assert split > 2 * _victim_p99(pool, "split", shared=True)


def test_placements_name_each_tenants_replica() -> None:
    assert [placement("one")("victim", n) for n in range(3)] == [0, 0, 0]
    assert [placement("spread")("aggressor", n) for n in range(4)] == [0, 1, 0, 1]
    assert (placement("split")("victim", 5), placement("split")("aggressor", 0)) == (0, 1)
    with pytest.raises(ValueError):
        placement("both")


@pytest.mark.parametrize("shared", [True, False], ids=["one share", "a share per replica"])
def test_shares_across_two_replicas_are_within_5_percent_of_the_weights(
    full_pool: list[TraceRequest], shared: bool
) -> None:
    # Issue 33's target for 2 and 10 tenants (weights 1:3 and 1/2/4), each tenant's requests
    # spread over two replicas, all backlogged; the worst tenant's served units within 5 % of
    # weight / sum of weights over the minute after a 20 s warm-up
    # (disagg_tools/experiments/flood_shares.py; deterministic under the seed; the
    # benchmark's rows: 0.6-3.1 %, docs/benchmarks.md). One share runs as the router does by
    # default, its take-back on: with every tenant backlogged it must not move the shares
    # (before it went by demand, 10 tenants were 19-31 % off).
    # Two minutes measured, not one: the worst of 10 tenants over one minute moves by a few
    # points with the run's event order alone (seed 0, 10 tenants: 5.5 % over one minute,
    # 2.4 % over two; seeds 1 and 2: 2.8 / 2.3 % and 1.2 / 0.6 %).
    runs = [SharesRun(2, duration_s=140.0), SharesRun(10, duration_s=140.0)]
    rows = shares_across_replicas(
        FULL, full_pool, CAPACITY_RPS, runs, shared=shared, take_back=shared
    )
    for row in rows:
        assert row.backlogged == row.tenants, row
        assert row.worst_error < 0.05, row
    # fifo, in the same runs, is far off (equal rates, unequal weights): the measure can fail.
    (fifo,) = shares_across_replicas(
        FULL, full_pool, CAPACITY_RPS, runs[1:], shared=shared, fairness="fifo"
    )
    assert fifo.worst_error > 0.3, fifo


def test_the_share_error_counts_backlogged_tenants_only() -> None:
    from disagg_tools.simcluster.metrics import RequestRecord

    def rec(tenant: str, arrival: float, queued: float, units: float, outcome: str = "ok") -> Any:
        return RequestRecord(
            index=0, arrival_s=arrival, prompt_tokens=0, output_tokens=1, outcome=outcome,  # type: ignore[arg-type]
            ttft_s=0.1, e2e_s=1.0, queued_s=queued, tenant=tenant, decode_block_s=units,
        )  # fmt: skip

    class Res:
        records = [
            # a waits the whole window [0, 10) and is served 30 units; b too, 60 units (weight 2)
            rec("a", 0.0, 5.0, 10.0), rec("a", 0.0, 9.9, 20.0), rec("a", 9.0, 0.0, 0.0, "rejected"),
            rec("b", 0.0, 9.95, 60.0),
            # c waits only from 5 s on: not backlogged, left out
            rec("c", 5.0, 4.0, 500.0),
        ]  # fmt: skip

    assert backlogged(Res(), ["a", "b", "c"], 0.0, 10.0) == {"a", "b"}  # type: ignore[arg-type]
    e = share_errors(Res(), {"a": 1.0, "b": 2.0, "c": 1.0}, 0.0, 10.0)  # type: ignore[arg-type]
    assert e["backlogged"] == 2 and e["admitted"] == 3
    assert e["worst"] == pytest.approx(0.0) and e["classes"] == {1.0: 0.0, 2.0: 0.0}


def test_the_shares_command_line_sets_the_window(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The long 1,000-tenant row of docs/benchmarks.md is one command: --shares-duration and
    # --shares-windows reach each row's SharesRun (the run itself is not made here).
    from disagg_tools.experiments import experiments_cli, flood, flood_shares

    seen: list[SharesRun] = []

    def fake_rows(*args: Any, **kwargs: Any) -> list[Any]:
        seen.extend(args[3])
        return []

    monkeypatch.setattr(flood.FloodSetup, "lengths", lambda self: [])
    monkeypatch.setattr(flood, "capacity", lambda setup, pool: 1.0)
    monkeypatch.setattr(flood_shares, "shares_across_replicas", fake_rows)
    argv = ["flood", "--shares", "10,1000", "--shared-fairness", "--out", str(tmp_path)]
    assert (
        experiments_cli.main([*argv, "--shares-duration", "680", "--shares-windows", "60,120"]) == 0
    )
    assert [(r.tenants, r.scale, r.duration_s, r.warmup_s, r.windows_s) for r in seen] == [
        (10, 1, 680.0, 20.0, (60.0, 120.0)),
        (1000, 16, 680.0, 20.0, (60.0, 120.0)),
    ]
    seen.clear()
    assert experiments_cli.main(argv) == 0  # without them: each row's own
    assert seen == [flood_shares.SharesRun(10), flood_shares.DEFAULT_RUNS[1000]]
