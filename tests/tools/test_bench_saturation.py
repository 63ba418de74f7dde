"""The sustained-rate search (issue 36, `disagg_tools.overhead.saturation`) finds the rate it
should: the ladder and the bisection against a fake step whose verdict depends on the rate
alone, and one tiny live run against `ours` (in-process store). No timed assertions: the live
run checks only that the records are complete and the result well formed.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path

from disagg_tools.overhead.saturation import (
    CLIENT,
    FAIL,
    PASS,
    Step,
    add_ratios,
    arrival_offsets,
    find_sustained,
    grid,
)
from tests.paths import REPO


def _fake(
    limit: float, client_from: float = float("inf")
) -> tuple[list[float], Callable[[float], Awaitable[Step]]]:
    tried: list[float] = []

    async def probe(rate: float) -> Step:
        tried.append(rate)
        if rate >= client_from:
            return Step(rate, CLIENT)
        return Step(rate, PASS if rate <= limit else FAIL)

    return tried, probe


async def test_the_ladder_climbs_then_bisects_between_pass_and_fail() -> None:
    tried, probe = _fake(limit=300.0)
    found = await find_sustained(probe, start=50, factor=2, bisect=3)
    assert tried[:4] == [50, 100, 200, 400]  # the ladder: 400 fails
    assert tried[4:] == [grid((200 * 400) ** 0.5), 336.0, 308.0]  # 283 passes, 336 and 308 fail
    assert found["sustained"] == 283.0 and found["limited_by"] == "router"
    assert [s.rate for s in found["steps"]] == tried


async def test_a_failing_first_rate_steps_down() -> None:
    tried, probe = _fake(limit=30.0)
    found = await find_sustained(probe, start=100, factor=2, bisect=1)
    assert tried == [100, 50, 25, grid((25 * 50) ** 0.5)]
    assert found["sustained"] == 25 and found["limited_by"] == "router"


async def test_nothing_passes_down_to_the_minimum() -> None:
    _, probe = _fake(limit=1.0)
    found = await find_sustained(probe, start=100, factor=2, min_rate=20)
    assert found["sustained"] is None and found["limited_by"] == "min rate"


async def test_the_load_generator_limit_is_a_bound_not_the_routers() -> None:
    tried, probe = _fake(limit=10_000.0, client_from=700.0)
    found = await find_sustained(probe, start=100, factor=2, bisect=2)
    assert tried[:4] == [100, 200, 400, 800]
    assert found["limited_by"] == "load generator"
    assert 400 <= found["sustained"] < 700


async def test_the_ceiling_stops_the_ladder() -> None:
    _, probe = _fake(limit=10_000.0)
    found = await find_sustained(probe, start=100, factor=2, max_rate=500)
    assert found["sustained"] == 400 and found["limited_by"] == "max rate"


def test_arrivals_are_seeded_and_near_the_rate() -> None:
    a = arrival_offsets(200.0, 2000, seed=1)
    assert a == arrival_offsets(200.0, 2000, seed=1) and a != arrival_offsets(200.0, 2000, seed=2)
    assert a[0] == 0.0 and all(x <= y for x, y in zip(a, a[1:], strict=False))
    assert 8.0 < a[-1] < 12.0  # 2,000 arrivals at 200/s: about 10 s
    even = arrival_offsets(100.0, 101, seed=1, poisson=False)
    assert 0.75 < even[-1] < 1.25


def test_ratios_say_when_they_are_bounds() -> None:
    keys = ("target", "max_tokens", "sustained_rps", "limited_by")
    rows = [
        dict(zip(keys, row, strict=True))
        for row in [
            ("vllm", 16, 1000.0, "router"),
            ("ours_redis", 16, 700.0, "router"),
            ("vllm", 128, 500.0, "load generator"),
            ("ours_redis", 128, 400.0, "router"),
        ]
    ]
    add_ratios(rows)
    assert (rows[1]["ratio_vs_vllm"], rows[1]["ratio_bound"]) == (0.7, "=")
    assert (rows[3]["ratio_vs_vllm"], rows[3]["ratio_bound"]) == (0.8, "<=")
    assert "ratio_vs_vllm" not in rows[0]


def test_smoke_our_router_over_a_tiny_search(tmp_path: Path) -> None:
    out = tmp_path / "sustain.json"
    md = tmp_path / "sustain.md"
    cmd = [
        sys.executable, "-m", "disagg_tools.overhead.saturation",
        "--targets", "ours", "--tokens", "4", "--interval-ms", "2", "--prefill-ms", "1",
        "--start-rps", "10", "--max-rps", "20", "--bisect", "1",
        "--step-requests", "10", "--step-s", "0.3", "--warmup-s", "0.2", "--pause-s", "0.05",
        "--max-lag-ms", "1000", "--no-pin",
        "--json", str(out), "--markdown", str(md), "--log-dir", str(tmp_path / "logs"),
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=100)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    [row] = result["sustained"]
    assert row["target"] == "ours" and row["max_tokens"] == 4
    assert row["limited_by"] in ("router", "load generator", "max rate", "min rate")
    for step in row["steps"]:
        assert step["verdict"] in (PASS, FAIL, CLIENT)
    for base in result["baseline_steps"]:
        assert base["requests"] >= 10 and base["complete"] == base["requests"], base["errors"]
        assert base["router_cpu_s"] is None
    if row["sustained_rps"] is not None:
        assert row["requests"] >= 10 and row["router_cpu_ms_per_request"] is not None
        assert row["added_ttft_ms"]["p99"] is not None
    text = md.read_text()
    assert "<!-- sustain:begin -->" in text and "| 4 | ours |" in text
