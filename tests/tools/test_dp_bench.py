"""The per-rank / per-URL bench (disagg_tools/launcher/dp_bench.py) runs a short row of each mode:
its shape, every answer exact, and the per-rank mode's ranks never out of KV (no timings)."""

from __future__ import annotations

from disagg_tools.launcher.dp_bench import DpBenchSpec, format_rows, run


async def test_the_dp_bench_runs_both_modes_and_every_answer_is_exact() -> None:
    spec = DpBenchSpec(rate=4.0, duration_s=2.0, time_scale=20.0, blocks_per_rank=64)
    rows = await run(spec)
    assert [r["mode"] for r in rows] == ["per-rank", "per-URL"]
    for row in rows:
        assert row["requests"] > 0 and row["ok"] == row["requests"], row
        assert set(row["requests_per_rank"]) == {f"d{w}@{r}" for w in range(2) for r in range(4)}
        assert row["ttft_s"]["p99"] is not None and row["goodput_rps"] >= 0
    assert rows[0]["preemptions"] == 0 and rows[0]["breaker_open_refusals"] == 0
    assert "| per-rank |" in format_rows(spec, rows)
