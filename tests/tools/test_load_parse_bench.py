"""The load-reading benchmark (scripts/load_parse_cost.py) runs, and its vLLM-shaped
text reads as the gauges it was written with."""

from __future__ import annotations

import sys

import pytest

from router.workers.discovery import parse_vllm_metrics
from tests.paths import REPO

sys.path.insert(0, str(REPO / "scripts"))
from load_parse_cost import main, vllm_like_text  # noqa: E402 - scripts/ is not a package


def test_the_vllm_shaped_text_reads_as_written() -> None:
    text = vllm_like_text(engines=2)
    assert len(text) > 50_000  # histograms bucket by bucket, as vLLM's
    snap = parse_vllm_metrics(text, 0.0)
    # Per engine e: running e, waiting 1 + e, usage 2 + e; 27000 blocks each.
    assert (snap.running, snap.waiting, snap.kv_usage, snap.num_gpu_blocks) == (1, 3, 3.0, 54000)


def test_the_benchmark_prints_its_table(capsys: pytest.CaptureFixture[str]) -> None:
    real = REPO / "tests" / "router" / "workers" / "texts" / "vllm-0.32-metrics.txt"
    main(["--engines", "1", "--repeat", "2", "--text", str(real)])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("| text |") and len(lines) == 4
    assert lines[2].startswith("| vLLM-shaped, 1 engine(s) |")
    assert lines[3].startswith("| vllm-0.32-metrics.txt | 53,")
