"""`disagg-router demo --plot FILE` (disagg_tools/launcher/demo_plot.py): a short demo writes a
real PNG of
its latency distributions, quietly (no progress bar into a pipe); without matplotlib, or with a
file it cannot write, it says so in one line and exits 2 before any cluster starts.

The demo places on the workers' facts (their KV events, exact prompt tokens from the demo
tokenizer) and says so from the router's /admin/state; `--no-kv-events` runs it the old way."""

from __future__ import annotations

import os
import struct
import subprocess
import sys
from pathlib import Path

from disagg_tools.launcher.demo_plot import write_latency_plot
from disagg_tools.replay.replayer import ReplayResult, RequestRecord
from tests.paths import REPO

REPO = REPO
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
BAR_MARKS = ("%|", "█", "▉", "▌")


def _demo(*args: str, prelude: str = "") -> subprocess.CompletedProcess[str]:
    """The demo in a child process, stdout and stderr pipes (not terminals), its own Redis."""
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}
    entry = "from disagg_tools.launcher.main import main"
    code = f"{prelude}import sys; {entry}; sys.exit(main(sys.argv[1:]))"
    return subprocess.run(
        [sys.executable, "-c", code, "demo", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )


def test_a_short_demo_writes_a_png_of_its_latencies_and_draws_no_bar(tmp_path: Path) -> None:
    out = tmp_path / "latency.png"
    run = _demo("--requests", "12", "--time-scale", "50", "--plot", str(out))
    assert run.returncode == 0, run.stderr[-2000:]
    data = out.read_bytes()
    assert data[:8] == PNG_SIGNATURE
    assert data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    assert (width, height) == (1100, 420)  # two panels side by side, 11 x 4.2 in at 100 dpi
    assert len(data) > 20_000  # curves, labels and lines, not a blank canvas
    assert f"plot: {out}" in run.stdout
    # From the router's /admin/state after the run: every worker's prefix cache known from its
    # KV events (synced or rebuilding, not "estimated"), the prompts counted by the tokenizer.
    facts = [line for line in run.stdout.splitlines() if line.startswith("prefix caches: ")]
    assert len(facts) == 1, run.stdout[-2000:]
    assert facts[0].startswith("prefix caches: events on 4/4 workers ("), facts[0]
    assert "estimated" not in facts[0]
    assert facts[0].endswith("; prompt tokens: exact (tokenizer)"), facts[0]
    both = run.stdout + run.stderr
    assert not any(mark in both for mark in BAR_MARKS), both[-2000:]


def test_no_kv_events_runs_on_the_estimates() -> None:
    run = _demo("--requests", "4", "--time-scale", "50", "--no-kv-events")
    assert run.returncode == 0, run.stderr[-2000:]
    assert (
        "prefix caches: events on 0/4 workers, estimated on 4; "
        "prompt tokens: estimated (4.0 characters a token)"
    ) in run.stdout.splitlines(), run.stdout[-2000:]


def test_svg_by_extension_with_both_panels_and_their_slos(tmp_path: Path) -> None:
    records = [
        RequestRecord(index=i, arrival_s=i * 0.1, prompt_tokens=100, output_tokens=8)
        for i in range(20)
    ]
    for i, r in enumerate(records):
        r.outcome, r.ttft_s, r.e2e_s, r.tokens = "ok", 0.05 + i * 0.01, 1.0, 8
        r.itl_s.extend([0.002 * (1 + i % 5)] * 7)
    result = ReplayResult(
        records=records,
        duration_s=3.0,
        base_url="http://x",
        model="m",
        endpoint="chat",
        time_scale=1.0,
        rate_scale=1.0,
        started_at_unix=0.0,
    )
    out = write_latency_plot(result, tmp_path / "l.svg", slo_ttft_s=0.2, slo_tpot_s=0.01)
    svg = out.read_text()
    assert svg.lstrip().startswith("<?xml") and "<svg" in svg
    for text in ("Time to first token", "Inter-token latency", "milliseconds", "TTFT SLO 200 ms"):
        assert text in svg, text
    assert "per-token SLO 10 ms" in svg


def test_without_matplotlib_one_line_and_exit_2_before_the_demo(tmp_path: Path) -> None:
    # `sys.modules[name] = None` makes `import matplotlib` raise ImportError, as if absent.
    run = _demo("--plot", str(tmp_path / "x.png"), prelude="sys_ = __import__('sys'); "
                "sys_.modules['matplotlib'] = None; ")  # fmt: skip
    assert run.returncode == 2
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and "pip install -e '.[bench]'" in lines[0], run.stderr
    assert "starting" not in run.stdout  # no cluster was started
    assert not (tmp_path / "x.png").exists()


def test_a_file_that_is_neither_png_nor_svg_is_refused_up_front(tmp_path: Path) -> None:
    run = _demo("--plot", str(tmp_path / "x.jpg"))
    assert run.returncode == 2
    assert ".png or .svg" in run.stderr and "starting" not in run.stdout
    run = _demo("--serve", "--plot", str(tmp_path / "x.png"))
    assert run.returncode == 2 and "--serve" in run.stderr
