"""The `vllm bench serve` recipe (scripts/vllm_bench_recipe.py), short: vLLM's own benchmark
client, offline, against `disagg-router demo --serve` (1 prefill + 1 decode worker) and against
one simulated worker directly; asserted on the JSON vLLM saves (`--save-result --save-detailed`).
vLLM lives in the real-vLLM venv (scripts/prepare_real_vllm.sh, run by .ci/run); without it the
test skips and says how to get it; `REAL_VLLM=0` skips it as it skips tests/real_vllm."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.paths import REPO

ROOT = REPO
sys.path.insert(0, str(ROOT / "scripts"))
from vllm_bench_recipe import missing_reason, real_vllm_home  # noqa: E402 - scripts/ is no package

PROMPTS, OUTPUT_LEN = 20, 16
pytestmark = pytest.mark.timeout(900)


def _result(out: Path, leg: str) -> dict[str, Any]:
    result: dict[str, Any] = json.loads((out / leg / "result.json").read_text())
    return result


def test_vllm_bench_serve_against_the_router_and_a_worker(tmp_path: Path) -> None:
    if os.environ.get("REAL_VLLM", "").strip() == "0":
        pytest.skip("vllm bench serve: REAL_VLLM=0")
    if (why := missing_reason(real_vllm_home())) is not None:
        pytest.skip(f"vllm bench serve: {why}")
    cmd = [
        sys.executable, str(ROOT / "scripts" / "vllm_bench_recipe.py"),
        "--num-prompts", str(PROMPTS), "--max-concurrency", "4",
        "--input-len", "64", "--output-len", str(OUTPUT_LEN),
        "--prefill", "1", "--decode", "1", "--out", str(tmp_path), "--timeout", "400",
    ]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=850, check=False)
    assert done.returncode == 0, (done.stdout[-3000:], done.stderr[-3000:])
    results = {leg: _result(tmp_path, leg) for leg in ("router", "direct")}
    for leg, result in results.items():
        assert result["backend"] == "openai-chat" and result["model_id"] == "llama-3-8b", leg
        assert result["completed"] == PROMPTS and result["failed"] == 0, (leg, result["errors"])
        assert result["errors"] == [""] * PROMPTS, leg
        assert len(result["ttfts"]) == PROMPTS and all(t > 0 for t in result["ttfts"]), leg
        # One ITL a streamed chunk after the first: at least one per token after the first.
        assert all(len(itl) >= OUTPUT_LEN - 1 for itl in result["itls"]), leg
        for metric in ("ttft", "itl", "tpot", "e2el"):
            assert 0 < result[f"p50_{metric}_ms"] <= result[f"p99_{metric}_ms"], (leg, metric)
        # The random dataset sets ignore_eos: every request ran to its max_completion_tokens.
        assert result["output_lens"] == [OUTPUT_LEN] * PROMPTS, (leg, result["output_lens"])
        assert result["total_output_tokens"] == PROMPTS * OUTPUT_LEN, leg
    router, direct = results["router"], results["direct"]
    # The same seed gave both legs the same prompts, and the simulated model answers as a pure
    # function of its context: through prefill, KV handoff and decode the router must deliver
    # exactly the tokens one worker produces by itself.
    assert router["input_lens"] == direct["input_lens"]
    assert router["generated_texts"] == direct["generated_texts"]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["ok"] is True
    assert summary["router_workers"] == {"prefill": 1, "decode": 1}
    assert summary["vllm_version"]
    ttft = summary["metrics"]["ttft.p50"]
    assert ttft["router_ms"] == pytest.approx(router["p50_ttft_ms"])
    assert ttft["direct_ms"] == pytest.approx(direct["p50_ttft_ms"])
    assert ttft["added_ms"] == pytest.approx(ttft["router_ms"] - ttft["direct_ms"], abs=1e-3)
