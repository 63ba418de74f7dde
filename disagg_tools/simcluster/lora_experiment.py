"""The LoRA experiment of issue 35 in the simulator: 100 adapters drawn with Zipf popularity 1.1,
`max_loras` 8 per worker, two-sided placement that sees adapters on both sides (the router's)
against one blind to them and one that sees them on the decode side only (an llm-d-style
affinity). Per mode: SLO attainment and TTFT p99 at each offered rate, adapter loads per 1,000
requests, and the goodput (the highest offered rate whose attainment is >= 0.9, found by
bisection as in the replay bench's search).

    python -m disagg_tools.simcluster.lora_experiment [--requests N] [--rates R ...]

The trace is synthetic and deterministic (`--seed`): Poisson arrivals, prompts of 256-2,048
tokens, answers of 32-512, no shared prefixes (the adapter effect alone); the same trace and the
same adapters for every mode. The cluster: 4 prefill + 4 decode llama-3-8b on H100
(`ClusterConfig.homogeneous`), the online-quantile estimator, SLOs TTFT 2 s and TPOT 0.1 s. A load
costs `--load-s` (default 0.5 s) before the request's prefill; disagg_tools/simcluster/loras.py
says what the model leaves out.
"""

from __future__ import annotations

import argparse
import random
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from disagg_tools.simcluster.config import ClusterConfig
from disagg_tools.simcluster.engine import simulate
from disagg_tools.simcluster.loras import MODES, LoraMode, LoraSimConfig
from policies.registry import load_estimator
from policies.two_sided import TwoSidedPolicy

__all__ = ["Request", "goodput_rps", "main", "run_mode", "synthetic_trace"]

SLO_TTFT_S = 2.0
SLO_TPOT_S = 0.1
TARGET = 0.9


@dataclass(frozen=True, slots=True)
class Request:
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    prefix_hash_ids: tuple[int, ...] = ()


def synthetic_trace(n: int, rate_rps: float, seed: int) -> list[Request]:
    """`n` requests at `rate_rps` (Poisson), lengths uniform in their ranges."""
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate_rps)
        out.append(Request(t, rng.randint(256, 2048), rng.randint(32, 512)))
    return out


def run_mode(
    requests: Sequence[Request],
    mode: LoraMode,
    *,
    adapters: int = 100,
    zipf_s: float = 1.1,
    max_loras: int = 8,
    load_s: float = 0.5,
    seed: int = 0,
) -> dict[str, float]:
    """One simulation: its summary's attainment, TTFT p99, and loads per 1,000 requests."""
    config = ClusterConfig.homogeneous(n_prefill=4, n_decode=4)
    loras = LoraSimConfig(adapters, zipf_s, max_loras, load_s, mode, seed)
    result = simulate(
        requests,
        config,
        TwoSidedPolicy(seed=seed),
        load_estimator("online_quantile"),
        seed=seed,
        slo_ttft_s=SLO_TTFT_S,
        slo_tpot_s=SLO_TPOT_S,
        loras=loras,
    )
    s = result.summary()
    return {
        "slo_attainment": float(s["slo_attainment"]),
        "ttft_p50_s": float(s["ttft_p50_s"]),
        "ttft_p99_s": float(s["ttft_p99_s"]),
        "loads_per_1k": 1000.0 * float(s["lora_loads"]) / max(1, int(s["requests"])),
        "rejected": float(s["rejected"]),
    }


def goodput_rps(attainment_at: Callable[[float], float], low: float, high: float) -> float:
    """The highest rate in [low, high] whose attainment is >= TARGET (bisection, 6 steps);
    0 when even `low` misses it."""
    if attainment_at(low) < TARGET:
        return 0.0
    if attainment_at(high) >= TARGET:
        return high
    for _ in range(6):
        mid = (low + high) / 2
        if attainment_at(mid) >= TARGET:
            low = mid
        else:
            high = mid
    return low


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m disagg_tools.simcluster.lora_experiment")
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--rates", type=float, nargs="*", default=[4.0, 8.0, 12.0])
    parser.add_argument("--adapters", type=int, default=100)
    parser.add_argument("--zipf", type=float, default=1.1)
    parser.add_argument("--max-loras", type=int, default=8)
    parser.add_argument("--load-s", type=float, default=0.5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--goodput", action="store_true", help="also search each mode's goodput")
    parser.add_argument("--max-rate", type=float, default=40.0, help="the goodput search's ceiling")
    ns = parser.parse_args(argv)
    knobs = {
        "adapters": ns.adapters,
        "zipf_s": ns.zipf,
        "max_loras": ns.max_loras,
        "load_s": ns.load_s,
        "seed": ns.seed,
    }
    print(
        f"{ns.requests} requests, {ns.adapters} adapters (Zipf {ns.zipf}), max_loras "
        f"{ns.max_loras}, load {ns.load_s} s; 4P+4D llama-3-8b h100; SLO TTFT {SLO_TTFT_S} s, "
        f"TPOT {SLO_TPOT_S} s"
    )
    print("| mode | rate (req/s) | SLO attainment | TTFT p50 (s) | TTFT p99 (s) | loads / 1k |")
    print("|---|---|---|---|---|---|")
    for rate in ns.rates:
        trace = synthetic_trace(ns.requests, rate, ns.seed)
        for mode in MODES:
            r = run_mode(trace, mode, **knobs)
            print(
                f"| {mode} | {rate:g} | {r['slo_attainment']:.3f} | {r['ttft_p50_s']:.3f} | "
                f"{r['ttft_p99_s']:.3f} | {r['loads_per_1k']:.0f} |"
            )
    if ns.goodput:
        print("\n| mode | goodput (req/s, attainment >= 0.9) |\n|---|---|")
        for mode in MODES:

            def attainment(rate: float, mode: LoraMode = mode) -> float:
                trace = synthetic_trace(ns.requests, rate, ns.seed)
                return run_mode(trace, mode, **knobs)["slo_attainment"]

            print(f"| {mode} | {goodput_rps(attainment, 1.0, ns.max_rate):.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
