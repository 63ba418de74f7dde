"""`disagg-router simulate`: replay a trace through the cluster simulator, print a short table.

    disagg-router simulate --trace conv.csv --prefill 2 --decode 6 --policy two_sided \\
        --estimator online_quantile --rate-scale 2 [--no-reserve --on-full refuse] \\
        [--admission predictive] [--compare two_sided,least_loaded/noreserve] [--json out.json]

`compare()` runs several cases (policy + router mode) on one trace and cluster shape and returns
one row per case, for tables such as docs/benchmarks.md. Policies and estimators come from
`policies.registry`, so built-in names and dotted paths both work. The trace is parsed by the
caller (the umbrella CLI, `disagg_tools/launcher/main.py`, with `disagg_tools.traces`) and
passed in: the simulator reads any sequence of `TraceLike` rows and imports no trace format.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from disagg_tools.simcluster.config import Admission, ClusterConfig, OnFull
from disagg_tools.simcluster.engine import TraceLike, simulate

__all__ = [
    "Case",
    "parse_case",
    "compare",
    "format_table",
    "add_simulate_arguments",
    "run_simulate",
    "PEER_CASES",
]


@dataclass(frozen=True, slots=True)
class Case:
    """One policy under one router mode."""

    policy: str
    reserve: bool = True
    on_full: OnFull = "preempt"
    admission: Admission = "instant"
    estimator: str | None = None  # None = compare()'s default
    policy_args: Mapping[str, Any] = field(default_factory=dict)

    @property
    def label(self) -> str:
        parts = [self.policy]
        if not self.reserve:
            parts.append("noreserve")
        if self.on_full != "preempt":
            parts.append(self.on_full)
        if self.admission != "instant":
            parts.append(self.admission)
        if self.estimator:
            parts.append(f"est={self.estimator}")
        return "/".join(parts)


# The modifiers naming a mode, each to the mode it names (a str read from text is no Literal).
_ON_FULL: dict[str, OnFull] = {"refuse": "refuse", "preempt": "preempt"}
_ADMISSION: dict[str, Admission] = {"predictive": "predictive", "instant": "instant"}


def parse_case(text: str) -> Case:
    """`policy[/noreserve][/refuse|/preempt][/predictive|/instant][/est=NAME]`."""
    policy, *mods = [t.strip() for t in text.split("/")]
    case = Case(policy)
    for m in mods:
        if m == "noreserve":
            case = replace(case, reserve=False)
        elif m in _ON_FULL:
            case = replace(case, on_full=_ON_FULL[m])
        elif m in _ADMISSION:
            case = replace(case, admission=_ADMISSION[m])
        elif m.startswith("est="):
            case = replace(case, estimator=m[4:])
        else:
            raise ValueError(f"unknown case modifier {m!r} in {text!r}")
    return case


# Ours, then the peers' policies as the peers run them: nothing reserved, vLLM-style preemption.
PEER_CASES: tuple[str, ...] = (
    "two_sided",
    "two_sided/predictive",
    "least_loaded/noreserve",
    "power_of_two/noreserve",
    "round_robin/noreserve",
    "random/noreserve",
)


def compare(
    requests: Sequence[TraceLike],
    config: ClusterConfig,
    cases: Sequence[str | Case] = PEER_CASES,
    *,
    estimator: str = "online_quantile",
    seed: int = 0,
    slo_ttft_s: float = 2.0,
    slo_tpot_s: float = 0.1,
    rate_scale: float = 1.0,
    send_hints: bool | None = None,
    timing: bool = True,
) -> list[dict[str, Any]]:
    """Run every case on the same requests and cluster; one summary row per case."""
    from policies.registry import load_estimator, load_policy

    rows = []
    for c in cases:
        case = parse_case(c) if isinstance(c, str) else c
        cfg = config.with_(reserve=case.reserve, on_full=case.on_full, admission=case.admission)
        policy = load_policy(case.policy, dict(case.policy_args))
        est = load_estimator(case.estimator or estimator)
        res = simulate(
            requests, cfg, policy, est, seed=seed,
            slo_ttft_s=slo_ttft_s, slo_tpot_s=slo_tpot_s, rate_scale=rate_scale,
            send_hints=send_hints,
        )  # fmt: skip
        rows.append({"case": case.label, **res.summary(timing=timing)})
    return rows


_COLUMNS: tuple[tuple[str, str, str], ...] = (
    # (header, key, format)
    ("ok", "ok", "d"),
    ("rej", "rejected", "d"),
    ("fail", "failed", "d"),
    ("SLO%", "slo_attainment", "%"),
    ("TTFT p50", "ttft_p50_s", "ms"),
    ("TTFT p99", "ttft_p99_s", "ms"),
    ("ITL p50", "itl_p50_s", "ms"),
    ("ITL p99", "itl_p99_s", "ms"),
    ("TBT", "tbt_mooncake_s", "ms"),
    ("preempt", "preemptions", "d"),
    ("overrun", "overrun_grown", "d"),
    ("strand GB·s", "stranded_byte_s", "G"),
    ("unused blk·s", "reserved_unused_block_s", "k"),
)


def _fmt(v: Any, kind: str) -> str:
    if kind == "d":
        return str(int(v))
    if kind == "%":
        return f"{100 * v:.1f}"
    if kind == "ms":
        return f"{1e3 * v:.1f}"
    if kind == "G":
        return f"{v / 1e9:.1f}"
    return f"{v / 1e3:.0f}k"


def format_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """A fixed-width text table (times in ms) of `compare()` or single-run rows."""
    heads = ["case", *(h for h, _, _ in _COLUMNS)]
    if rows and "events_per_s" in rows[0]:
        heads += ["events", "ev/s", "wall s"]
    body = []
    for r in rows:
        line = [str(r.get("case", "-")), *(_fmt(r[k], f) for _, k, f in _COLUMNS)]
        if "events_per_s" in r:
            line += [str(r["events"]), f"{r['events_per_s']:,.0f}", f"{r['wall_s']:.1f}"]
        body.append(line)
    widths = [max(len(x) for x in col) for col in zip(heads, *body, strict=True)]
    out = ["  ".join(h.rjust(w) for h, w in zip(heads, widths, strict=True))]
    out += ["  ".join(x.rjust(w) for x, w in zip(line, widths, strict=True)) for line in body]
    return "\n".join(out)


def add_simulate_arguments(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    a("--trace", required=True, help="trace file (Azure CSV, Mooncake JSONL, lengths CSV)")
    a("--limit", type=int, default=None, help="first N requests only")
    a("--poisson-rate", type=float, default=None, help="req/s for traces without arrival times")
    a("--prefill", type=int, default=2, help="prefill workers")
    a("--decode", type=int, default=6, help="decode workers")
    a("--model", default="llama-3-8b")
    a("--gpu", default="h100")
    a("--decode-gpu", default=None, help="GPU profile of decode workers (default: --gpu)")
    a("--tp", type=int, default=None, help="tensor parallel size (default: the model's)")
    a("--capacity-blocks", type=int, default=None, help="override decode KV blocks per worker")
    a("--link-gbps", type=float, default=None, help="P→D link, Gbit/s (default: the NIC)")
    a("--policy", default="two_sided", help="built-in name or pkg.mod:Name")
    a("--policy-args", default="{}", help="JSON object of policy constructor arguments")
    a("--estimator", default="online_quantile")
    a("--rate-scale", type=float, default=1.0, help="multiply the arrival rate")
    a("--slo-ttft", type=float, default=2.0, help="TTFT SLO, seconds (also the queue deadline)")
    a("--slo-tpot", type=float, default=0.1, help="time-per-output-token SLO, seconds")
    a("--no-reserve", action="store_true", help="reserve nothing on D (the peers' router)")
    a("--on-full", choices=("preempt", "refuse"), default="preempt")
    a("--admission", choices=("instant", "predictive"), default="instant")
    a("--queue-limit", type=int, default=1024)
    a("--stranded-cap-mib", type=float, default=0.0, help="per prefill worker; 0 = no cap")
    a("--prefix-cache-blocks", type=int, default=0, help="per prefill worker; 0 = off")
    a("--max-tokens", type=int, default=4096)
    a("--seed", type=int, default=0)
    a("--hints", action="store_true", help="send each true output length as the client hint")
    a("--compare", default=None, help="comma-separated cases, e.g. two_sided,random/noreserve")
    a("--json", default=None, metavar="OUT", help="write the rows as JSON")


def _config(ns: argparse.Namespace) -> ClusterConfig:
    link = ns.link_gbps * 1e9 / 8 if ns.link_gbps else None
    return ClusterConfig.homogeneous(
        ns.prefill,
        ns.decode,
        ns.model,
        ns.gpu,
        tp_size=ns.tp,
        decode_gpu=ns.decode_gpu,
        link_bytes_per_s=link,
        capacity_blocks=ns.capacity_blocks,
        reserve=not ns.no_reserve,
        on_full=ns.on_full,
        admission=ns.admission,
        queue_limit=ns.queue_limit,
        stranded_cap_bytes=int(ns.stranded_cap_mib * 2**20),
        prefix_cache_blocks=ns.prefix_cache_blocks,
        max_tokens=ns.max_tokens,
    )


def run_simulate(ns: argparse.Namespace, requests: Sequence[TraceLike]) -> int:
    """Run the parsed `simulate` options on `requests` (read from `ns.trace` by the caller)."""
    config = _config(ns)
    if ns.compare:
        cases: list[str | Case] = [c for c in ns.compare.split(",") if c.strip()]
    else:
        cases = [
            Case(
                ns.policy,
                reserve=not ns.no_reserve,
                on_full=ns.on_full,
                admission=ns.admission,
                policy_args=json.loads(ns.policy_args),
            )
        ]
    rows = compare(
        requests, config, cases, estimator=ns.estimator, seed=ns.seed,
        slo_ttft_s=ns.slo_ttft, slo_tpot_s=ns.slo_tpot, rate_scale=ns.rate_scale,
        send_hints=True if ns.hints else None,
    )  # fmt: skip
    print(
        f"{len(requests)} requests, {config!r}, rate x{ns.rate_scale}, "
        f"SLO TTFT {ns.slo_ttft}s TPOT {ns.slo_tpot}s"
    )
    print(format_table(rows))
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0
