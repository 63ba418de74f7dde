"""The router's preemption with exact resume in the cluster simulator (issue 31;
disagg_tools/simcluster/preemption.py), on a seeded burst that overruns the estimates
(disagg_tools/experiments/preemption.py: short answers learnt, then long ones under the same
max_tokens).

- on (the default, as in the router): no decode worker is ever held or used past its capacity —
  checked after every reservation, allocation and step boundary, not only by the simulator's own
  counters — the engine never preempts, the router does, and every request completes with its
  whole answer;
- off: today's forced growth (held past capacity, the engine's own preemptions);
- the same seed gives the same records.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from disagg_tools.experiments.preemption import BurstSetup, overrunning_burst, run
from disagg_tools.simcluster.workers import DecodeWorker

SETUP = BurstSetup(warm=40, warm_s=20.0, burst=30, burst_s=4.0, capacity_blocks=500, seed=3)


def _watch(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """The most any decode worker held (the router's count) and used (the engine's blocks)
    past its capacity, after each call that can raise either."""
    worst = {"held": 0, "used": 0}

    def watched(method: Callable[..., Any]) -> Callable[..., Any]:
        def call(d: DecodeWorker, *args: Any) -> Any:
            out = method(d, *args)
            worst["held"] = max(worst["held"], d.held - d.capacity)
            worst["used"] = max(worst["used"], d.used - d.capacity)
            return out

        return call

    for name in ("reserve", "allocate", "boundary"):
        monkeypatch.setattr(DecodeWorker, name, watched(getattr(DecodeWorker, name)))
    return worst


def test_preemption_keeps_every_decode_worker_within_capacity(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    worst = _watch(monkeypatch)
    result = run(SETUP, preemption=True)
    s = result.summary()
    assert worst == {"held": 0, "used": 0}, worst
    assert s["peak_held_past_capacity"] == 0 and s["steps_held_past_capacity"] == 0, s
    assert s["preemptions"] == 0, s  # the engine's: never over-committed, it never has to
    assert s["preemption_forced_growth"] == 0, s
    assert s["router_preemptions"] >= 3, s  # the burst did overrun: the router preempted
    assert s["redone_prefill_tokens"] > 0, s
    # Every request completes with its whole answer; nothing is left held.
    want = [r.output_tokens for r in overrunning_burst(SETUP)]  # a record's index: its position
    assert [r.output_tokens for r in sorted(result.records, key=lambda r: r.index)] == want
    assert all(r.outcome == "ok" for r in result.records)
    assert s["end_reserved_blocks"] == 0 and s["end_used_blocks"] == 0, s
    # A preempted request resumed its answer; what was redone is its prompt + its answer then.
    cut = [r for r in result.records if r.router_preemptions]
    assert cut and all(r.redone_tokens > r.prompt_tokens for r in cut)


def test_without_preemption_the_growth_is_forced_past_capacity(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    worst = _watch(monkeypatch)
    s = run(SETUP, preemption=False).summary()
    assert worst["held"] > 0, worst
    # (its own count sees the boundary before the engine's evictions: at least as much)
    assert s["peak_held_past_capacity"] >= worst["held"], (s, worst)
    assert s["steps_held_past_capacity"] > 0, s
    assert s["preemptions"] > 0, s  # the engine's own, on the over-committed workers
    assert s["router_preemptions"] == 0 and s["redone_prefill_tokens"] == 0, s
    assert s["ok"] == s["requests"], s


def test_the_same_seed_gives_the_same_run() -> None:
    a, b = run(SETUP, preemption=True), run(SETUP, preemption=True)
    assert a.records == b.records
    assert a.summary() == b.summary()
