"""The aiperf recipe (scripts/aiperf_recipe.py), short: aiperf from PyPI, offline, against
`disagg-router demo --serve` (1 prefill + 1 decode worker) and against one simulated worker
directly; asserted on aiperf's own exported JSON. aiperf lives in its own venv
(scripts/install_aiperf.sh, run by .ci/run); without it the test skips and says how to get it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.paths import REPO

ROOT = REPO
sys.path.insert(0, str(ROOT / "scripts"))
from aiperf_recipe import aiperf_binary  # noqa: E402 - scripts/ is not a package

REQUESTS = 20
pytestmark = pytest.mark.timeout(900)


def _summary(out: Path, leg: str) -> dict[str, Any]:
    result: dict[str, Any] = json.loads((out / leg / "profile_export_aiperf.json").read_text())
    return result


def test_aiperf_against_the_router_and_a_worker(tmp_path: Path) -> None:
    if not aiperf_binary().exists():
        pytest.skip(f"aiperf is not installed at {aiperf_binary()}: run scripts/install_aiperf.sh")
    cmd = [
        sys.executable, str(ROOT / "scripts" / "aiperf_recipe.py"),
        "--requests", str(REQUESTS), "--concurrency", "4", "--isl", "64", "--osl", "16",
        "--prefill", "1", "--decode", "1", "--out", str(tmp_path), "--timeout", "400",
    ]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=850, check=False)
    assert done.returncode == 0, (done.stdout[-3000:], done.stderr[-3000:])
    for leg in ("router", "direct"):
        result = _summary(tmp_path, leg)
        assert result["request_count"]["avg"] == REQUESTS, (leg, result["request_count"])
        assert not result.get("error_summary"), (leg, result["error_summary"])
        assert (result.get("error_request_count") or {}).get("avg", 0) == 0, leg
        ttft = result["time_to_first_token"]
        assert ttft["count"] == REQUESTS and 0 < ttft["p50"] <= ttft["p99"], (leg, ttft)
        assert result["output_sequence_length"]["sum"] > 0, leg  # tokens were streamed
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["ok"] is True
    assert summary["router_workers"] == {"prefill": 1, "decode": 1}
    added = summary["metrics"]["time_to_first_token.p50"]
    assert added["router_ms"] > 0 and added["direct_ms"] > 0 and added["added_ms"] is not None
