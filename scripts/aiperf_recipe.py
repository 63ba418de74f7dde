"""aiperf, offline, against the router and against one simulated worker directly.

    scripts/install_aiperf.sh                      # once: aiperf in its own venv
    python scripts/aiperf_recipe.py --requests 400 --concurrency 8 --out /tmp/aiperf
    python scripts/aiperf_recipe.py --prefill 1 --decode 1 ...   # 1P+1D: two GPUs behind the router

Starts `disagg-router demo --serve` (`--prefill` + `--decode` simulated workers behind the router,
2 + 2 by default)
and one simulated worker that does both phases (`disagg-router worker --role both`), at the same
time scale; runs the same aiperf profile (same seed, prompts, lengths, concurrency) against each;
prints TTFT, ITL and request latency side by side. The router's added latency reads off one
client's numbers — it includes the simulated KV handoff, which a single worker does not do.

No hub access: the tokenizer is the checked-in examples/aiperf/tokenizer (an absolute path, which
aiperf loads as a local folder), and HF_ENDPOINT points at a closed loopback port so that any
attempt to reach the hub fails at once. aiperf's GPU telemetry and server-metrics scraping are
off. Artifacts: OUT/router/ and OUT/direct/ (aiperf's profile_export_aiperf.json each) and
OUT/summary.json. Exit status: 0 when both runs completed every request without an error.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from bench_clients import (
    ROOT,
    add_cluster_args,
    added_row,
    check_cluster_args,
    offline_env,
    print_table,
    run_both,
)

TOKENIZER = ROOT / "examples" / "aiperf" / "tokenizer"
DEFAULT_AIPERF_HOME = Path(os.environ.get("HOME", "/root")) / ".cache" / "disagg-router" / "aiperf"
METRICS = ("time_to_first_token", "inter_token_latency", "request_latency")
STATS = ("p50", "p90", "p99")


def aiperf_binary() -> Path:
    """Where scripts/install_aiperf.sh put aiperf ($AIPERF_HOME or its default)."""
    home = Path(os.environ.get("AIPERF_HOME") or DEFAULT_AIPERF_HOME)
    return home / "bin" / "aiperf"


def run_aiperf(url: str, out: Path, ns: argparse.Namespace) -> dict[str, Any]:
    """One aiperf profile against `url`; its exported JSON summary."""
    shutil.rmtree(out, ignore_errors=True)
    cmd = [
        str(ns.aiperf), "profile",
        "--model", ns.model, "--url", url, "--endpoint-type", "chat", "--streaming",
        "--tokenizer", str(TOKENIZER.resolve()),
        "--request-count", str(ns.requests), "--concurrency", str(ns.concurrency),
        "--isl", str(ns.isl), "--osl", str(ns.osl), "--random-seed", str(ns.seed),
        "--ui", "none", "--no-server-metrics", "--no-gpu-telemetry",
        "--artifact-dir", str(out),
    ]  # fmt: skip
    out.mkdir(parents=True)
    with (out / "aiperf.stdout").open("w") as log:
        done = subprocess.run(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=offline_env(), timeout=ns.timeout
        )
    summary = out / "profile_export_aiperf.json"
    if done.returncode != 0 or not summary.exists():
        raise RuntimeError(f"aiperf failed ({done.returncode}) against {url}; see {out}")
    result: dict[str, Any] = json.loads(summary.read_text())
    return result


def _stat(result: dict[str, Any], metric: str, stat: str) -> float | None:
    value = (result.get(metric) or {}).get(stat)
    return float(value) if isinstance(value, int | float) else None


def completed_without_errors(result: dict[str, Any], requests: int) -> bool:
    count = (result.get("request_count") or {}).get("avg")
    errors = (result.get("error_request_count") or {}).get("avg", 0)
    return count == requests and not errors and not result.get("error_summary")


def compare(router: dict[str, Any], direct: dict[str, Any]) -> dict[str, Any]:
    """Per metric and percentile: router, direct, and what the router adds (ms)."""
    table: dict[str, Any] = {}
    for metric in METRICS:
        for stat in STATS:
            r, d = _stat(router, metric, stat), _stat(direct, metric, stat)
            table[f"{metric}.{stat}"] = added_row(r, d)
    return table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--isl", type=int, default=256, help="prompt tokens (mean)")
    parser.add_argument("--osl", type=int, default=64, help="output tokens (mean)")
    add_cluster_args(parser, pools=2)
    parser.add_argument("--out", type=Path, default=Path("aiperf-out"))
    parser.add_argument("--aiperf", type=Path, default=aiperf_binary())
    parser.add_argument("--timeout", type=float, default=1800.0, help="per aiperf run (s)")
    ns = parser.parse_args(argv)
    check_cluster_args(parser, ns)
    if not ns.aiperf.exists():
        print(f"aiperf not found at {ns.aiperf}: run scripts/install_aiperf.sh", file=sys.stderr)
        return 2
    ns.out.mkdir(parents=True, exist_ok=True)
    router, direct, load = run_both(ns, ns.out, lambda url, out, _name: run_aiperf(url, out, ns))
    ok = all(completed_without_errors(r, ns.requests) for r in (router, direct))
    table = compare(router, direct)
    summary = {
        "command": " ".join(sys.argv),
        "requests": ns.requests,
        "concurrency": ns.concurrency,
        "router_workers": {"prefill": ns.prefill, "decode": ns.decode},
        "load_average_1m": load,
        "isl": ns.isl,
        "osl": ns.osl,
        "time_scale": ns.time_scale,
        "aiperf_version": router.get("aiperf_version"),
        "ok": ok,
        "metrics": table,
    }
    (ns.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print_table(table)
    print(f"{'all requests completed, no errors' if ok else 'FAILED'}; artifacts in {ns.out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
