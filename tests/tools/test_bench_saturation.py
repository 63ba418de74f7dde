"""The sustained-rate search (issue 36, `disagg_tools.overhead.saturation`) finds the rate it
should: the ladder and the bisection against a fake step whose verdict depends on the rate
alone, a step's verdict as the majority of scripted tries (one spike no longer ends a search),
the report of the votes, and one tiny live run against `ours` (in-process store). No timed
assertions: the live run checks only that the records are complete and the result well formed.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from disagg_tools.overhead.saturation import (
    CLIENT,
    FAIL,
    PASS,
    Step,
    _result_row,
    add_ratios,
    arrival_offsets,
    build_parser,
    find_sustained,
    grid,
    majority,
    markdown,
    vote_text,
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


def _scripted(
    verdicts: list[str], p99s: list[float | None] | None = None
) -> tuple[list[str], Callable[[], Awaitable[Step]]]:
    """A try that returns the next of `verdicts` (with the next added TTFT p99, else 0, 1,
    2, ...); the verdicts returned so far, to count the tries made."""
    given: list[str] = []
    added = list(range(len(verdicts))) if p99s is None else p99s

    async def try_once() -> Step:
        p99 = added[len(given)]
        given.append(verdicts[len(given)])
        return Step(100.0, given[-1], {"added_ttft_ms": {"p50": 1.0, "p99": p99}})

    return given, try_once


@pytest.mark.parametrize(
    ("tries", "script", "verdict", "used", "votes"),
    [
        (3, [PASS, PASS, FAIL], PASS, 2, "2/2 pass"),
        (3, [FAIL, PASS, PASS], PASS, 3, "2/3 pass"),
        (3, [PASS, FAIL, FAIL], FAIL, 3, "2/3 fail"),
        (3, [FAIL, FAIL, PASS], FAIL, 2, "2/2 fail"),
        (3, [CLIENT, PASS, PASS], CLIENT, 1, "1/1 client"),
        (3, [PASS, CLIENT, PASS], CLIENT, 2, "1/2 client"),
        (3, [FAIL, PASS, CLIENT], CLIENT, 3, "1/3 client"),
        (1, [FAIL, PASS, PASS], FAIL, 1, "1/1 fail"),
        (1, [PASS, FAIL, FAIL], PASS, 1, "1/1 pass"),
        (2, [PASS, FAIL, PASS], FAIL, 2, "1/2 fail"),  # a tie is no majority of passes
        (5, [FAIL, PASS, FAIL, PASS, PASS], PASS, 5, "3/5 pass"),
    ],
)
async def test_a_majority_of_tries_decides_a_step(
    tries: int, script: list[str], verdict: str, used: int, votes: str
) -> None:
    given, try_once = _scripted(script)
    step = await majority(try_once, tries)
    assert (step.verdict, len(given), vote_text(step)) == (verdict, used, votes)
    assert [t["verdict"] for t in step.detail["tries"]] == script[:used]
    assert [t["added_ttft_ms"]["p99"] for t in step.detail["tries"]] == list(range(used))


async def test_a_step_reports_the_median_try_of_its_verdict_and_keeps_every_try() -> None:
    _, try_once = _scripted([PASS, FAIL, PASS], p99s=[30.0, 80.0, 10.0])
    step = await majority(try_once, 3)
    assert step.detail["added_ttft_ms"]["p99"] == 30.0  # of the passes 10 and 30, the worse
    assert step.detail["votes"] == {PASS: 2, FAIL: 1, CLIENT: 0}
    assert [(t["verdict"], t["added_ttft_ms"]["p99"]) for t in step.detail["tries"]] == [
        (PASS, 30.0),
        (FAIL, 80.0),
        (PASS, 10.0),
    ]
    _, try_once = _scripted([FAIL, PASS, FAIL], p99s=[None, 20.0, 70.0])
    step = await majority(try_once, 3)
    assert step.detail["added_ttft_ms"]["p99"] is None  # unmeasured (errors) is the worse fail


async def test_a_step_needs_a_try() -> None:
    _, try_once = _scripted([PASS])
    with pytest.raises(ValueError, match="tries=0"):
        await majority(try_once, 0)


def _flaky(
    limit: float, spikes: dict[float, list[str]], tries: int
) -> tuple[list[float], Callable[[float], Awaitable[Step]]]:
    """A step at a rate: its tries go through `majority`; the first ones at a rate in `spikes`
    return the verdicts scripted there, the rest pass up to `limit`. Every try's rate, in order."""
    tried: list[float] = []

    async def try_at(rate: float) -> Step:
        tried.append(rate)
        script = spikes.get(rate)
        return Step(rate, script.pop(0) if script else PASS if rate <= limit else FAIL)

    async def probe(rate: float) -> Step:
        return await majority(lambda: try_at(rate), tries)

    return tried, probe


async def test_one_spike_at_a_rate_no_longer_ends_the_search() -> None:
    _, alone = _flaky(300.0, {200.0: [FAIL]}, tries=1)
    found = await find_sustained(alone, start=50, factor=2, bisect=3)
    assert [s.rate for s in found["steps"]] == [50, 100, 200, 141, 168, 183]
    assert found["sustained"] == 183.0  # the spike at 200 turned the ladder

    tried, probe = _flaky(300.0, {200.0: [FAIL]}, tries=3)
    found = await find_sustained(probe, start=50, factor=2, bisect=3)
    assert [s.rate for s in found["steps"]] == [50, 100, 200, 400, 283, 336, 308]
    assert found["sustained"] == 283.0 and found["limited_by"] == "router"
    assert [vote_text(s) for s in found["steps"]] == [
        "2/2 pass", "2/2 pass", "2/3 pass", "2/2 fail", "2/2 pass", "2/2 fail", "2/2 fail",
    ]  # fmt: skip
    assert tried[:7] == [50, 50, 100, 100, 200, 200, 200]


async def test_two_spikes_at_a_rate_still_fail_it() -> None:
    _, probe = _flaky(300.0, {200.0: [FAIL, PASS, FAIL]}, tries=3)
    found = await find_sustained(probe, start=50, factor=2, bisect=0)
    assert found["sustained"] == 100.0 and vote_text(found["steps"][-1]) == "2/3 fail"


def test_the_parser_takes_tries_and_rejects_none(capsys: pytest.CaptureFixture[str]) -> None:
    assert build_parser().parse_args([]).tries == 3
    assert build_parser().parse_args(["--tries", "5"]).tries == 5
    assert build_parser().parse_args(["--tries", "1"]).tries == 1
    for bad in ("0", "-1", "two"):
        with pytest.raises(SystemExit) as exit_:
            build_parser().parse_args(["--tries", bad])
        assert exit_.value.code == 2
        assert f"argument --tries: '{bad}': a positive integer" in capsys.readouterr().err


def _measured(rate: float, verdict: str, added_p99: float, cpu_ms: float) -> Step:
    """A try with the numbers `_result_row` reads (a router run and its baseline)."""
    run = {
        "ttft_ms": {"p50": 8.0, "p99": 30.0 + added_p99},
        "achieved_rps": rate,
        "achieved_fraction": 0.99,
        "errors": {},
        "lag_ms": {"p50": 0.1, "p99": 0.5},
        "cpu_ms_per_request": cpu_ms,
        "router_cpu_util": 0.4,
        "load_core_util": 0.6,
        "requests": 400,
        "loadavg_1m": 1.0,
    }
    base = {"ttft_ms": {"p50": 7.0, "p99": 30.0}, "achieved_fraction": 1.0, "lag_ms": {"p99": 0.4}}
    added = {"p50": 1.0, "p99": added_p99}
    return Step(rate, verdict, {"run": run, "baseline": base, "added_ttft_ms": added})


async def test_the_report_shows_the_votes_and_the_median_cpu_over_tries() -> None:
    script: dict[float, list[Step]] = {
        100.0: [_measured(100, PASS, 20.0, 1.2), _measured(100, FAIL, 90.0, 1.9),
                _measured(100, PASS, 35.0, 1.4)],
        200.0: [_measured(200, FAIL, 60.0, 1.0), _measured(200, FAIL, 70.0, 1.1)],
        141.0: [_measured(141, PASS, 40.0, 1.3), _measured(141, FAIL, 55.0, 1.3),
                _measured(141, FAIL, 52.0, 1.3)],
    }  # fmt: skip

    async def probe(rate: float) -> Step:
        async def try_once() -> Step:
            return script[rate].pop(0)

        return await majority(try_once, 3)

    found = await find_sustained(probe, start=100, factor=2, bisect=1)
    row = _result_row("ours_dropin", 16, found)
    assert [(s["rate"], s["votes"]) for s in row["steps"]] == [
        (100.0, "2/3 pass"),
        (200.0, "2/2 fail"),
        (141.0, "2/3 fail"),
    ]
    assert (row["sustained_rps"], row["sustained_votes"]) == (100.0, "2/3 pass")
    assert row["first_failing"] == {"rate": 200.0, "verdict": FAIL, "votes": "2/2 fail"}
    assert row["router_cpu_ms_per_request"] == 1.4  # the median of 1.2, 1.9, 1.4
    assert row["added_ttft_ms"] == {"p50": 1.0, "p99": 35.0}  # of the passes, the worse
    assert row["steps"][0]["tries"] == [
        {"verdict": v, "why": None, "added_ttft_ms": {"p50": 1.0, "p99": p99},
         "router_cpu_ms_per_request": cpu}
        for v, p99, cpu in [(PASS, 20.0, 1.2), (FAIL, 90.0, 1.9), (PASS, 35.0, 1.4)]
    ]  # fmt: skip
    result: dict[str, Any] = {
        "params": vars(build_parser().parse_args([])),
        "machine": {"loadavg_at_start": [0.5, 0.5, 0.5], "loadavg_at_end": [0.7, 0.6, 0.5]},
        "elapsed_s": 61.0,
        "sustained": [row],
    }
    text = markdown(result)
    assert "each step up to 3 tries (their majority decides)" in text
    assert (
        "| 16 | ours_dropin | 100 | router | 1.0 / 35.0 | 1.400 | 0.50 | 0.60 "
        "| 2/3 pass · 2/2 fail at 200 | — |"
    ) in text.splitlines()


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
        assert step["votes"].endswith(f" {step['verdict']}") and 1 <= len(step["tries"]) <= 3
    for base in result["baseline_steps"]:
        assert base["requests"] >= 10 and base["complete"] == base["requests"], base["errors"]
        assert base["router_cpu_s"] is None
    if row["sustained_rps"] is not None:
        assert row["requests"] >= 10 and row["router_cpu_ms_per_request"] is not None
        assert row["added_ttft_ms"]["p99"] is not None
    text = md.read_text()
    assert "<!-- sustain:begin -->" in text and "| 4 | ours |" in text
