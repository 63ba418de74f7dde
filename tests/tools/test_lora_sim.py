"""LoRA adapters in the simulator (disagg_tools/simcluster/loras.py): a Zipf draw of adapters,
workers holding at most max_loras in LRU order, and placement that sees the adapters on both
sides making fewer loads than placement blind to them (deterministic under the seed)."""

from __future__ import annotations

from collections import Counter

from disagg_tools.simcluster.lora_experiment import run_mode, synthetic_trace
from disagg_tools.simcluster.loras import LoraSimConfig, SimLoras, zipf_adapters


def test_zipf_draws_are_deterministic_and_skewed() -> None:
    draws = zipf_adapters(5000, 100, 1.1, seed=3)
    assert draws == zipf_adapters(5000, 100, 1.1, seed=3)
    counts = Counter(draws)
    assert counts["lora-0"] > counts["lora-9"] > counts.get("lora-99", 0)
    assert set(counts) <= {f"lora-{k}" for k in range(100)}


def test_a_worker_holds_at_most_max_loras_and_a_load_is_paid_once() -> None:
    loras = SimLoras(LoraSimConfig(adapters=10, max_loras=2, load_s=0.5), 6)
    loras.adapter_of = ["a", "b", "a", "c", "b", "b"]
    assert loras.ready_in(0, ["p0", "d0"]) == 0.5 and loras.loading == ["p0", "d0"]
    assert loras.ready_in(0, ["p0", "d0"]) == 0.0  # its dispatch after the wait
    loras.ready_in(1, ["p0"])
    assert loras.ready_in(2, ["p0"]) == 0.0  # held
    loras.ready_in(3, ["p0"])  # c evicts b, the least recently used
    assert loras.holds("p0", "a") and loras.holds("p0", "c") and not loras.holds("p0", "b")
    assert loras.evictions == 1 and loras.loads == 4


def test_placement_that_sees_adapters_on_both_sides_loads_least() -> None:
    trace = synthetic_trace(400, 5.0, seed=1)
    loads = {m: run_mode(trace, m, seed=1)["loads_per_1k"] for m in ("aware", "blind")}
    assert loads["aware"] < loads["blind"]
