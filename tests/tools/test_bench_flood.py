"""The live flood benchmark (disagg_tools/overhead/flood.py) end to end, with tiny counts: the
router process, the stand-in workers and the session's Redis. What it checks is the report's
shape and the contract under a flood (no 5xx, every 429 with a Retry-After, the victim served
in both runs), never timings: those are the benchmark's to measure, on a quiet machine."""

from __future__ import annotations

from pathlib import Path

import redis.asyncio as aioredis

from disagg_tools.loadgen import flood_replicas_cli
from disagg_tools.loadgen.flood_replicas_report import placement_table
from disagg_tools.overhead.flood import parse_args, run_flood, write_report
from tests.conftest import REDIS_URL

_TENANT_KEYS = {
    "sent", "sent_per_s", "answered", "answered_per_s", "goodput_per_s", "ttft_p50_s",
    "ttft_p99_s", "statuses", "http_5xx", "no_status", "stream_errors", "rejected_429",
    "rejected_429_by_code", "rejected_429_with_retry_after", "retry_after_s",
}  # fmt: skip


async def test_flood_bench_end_to_end(tmp_path: Path) -> None:
    ns = parse_args(
        [
            "--redis-url", REDIS_URL, "--out", str(tmp_path), "--capacity-s", "2",
            "--duration", "4", "--warmup", "1", "--aggressor-x", "4",
            # A limit the aggressor passes within the run: 429s for its quota show too.
            "--aggressor-rpm-x", "0.05",
        ]
    )  # fmt: skip
    (tmp_path / "logs-vtc").mkdir()
    report = await run_flood(ns)

    assert report["capacity"]["measured_per_s"] > 0
    assert set(report["runs"]) == {"solo", "flood"}
    for run in report["runs"].values():
        assert set(run) == {"victim", "aggressor"}
        for stats in run.values():
            assert _TENANT_KEYS <= set(stats)
    solo_victim = report["runs"]["solo"]["victim"]
    flood_victim = report["runs"]["flood"]["victim"]
    aggressor = report["runs"]["flood"]["aggressor"]
    assert report["runs"]["solo"]["aggressor"]["sent"] == 0

    for stats in (solo_victim, flood_victim, aggressor):
        assert stats["http_5xx"] == 0, stats["statuses"]
        assert stats["no_status"] == 0 and stats["stream_errors"] == 0, stats
        assert set(stats["statuses"]) <= {"200", "429"}, stats["statuses"]
        assert stats["rejected_429_with_retry_after"] == stats["rejected_429"], stats
    assert solo_victim["answered"] > 0 and flood_victim["answered"] > 0
    assert aggressor["rejected_429"] > 0  # it flooded a saturated cluster
    assert "requests_per_minute" in aggressor["rejected_429_by_code"], aggressor
    verdict = report["verdict"]
    assert verdict["no_5xx"] and verdict["every_429_had_retry_after"]
    assert {"victim_ttft_p99_ratio", "victim_goodput_ratio", "ttft_p99_within_tol"} <= set(verdict)
    assert "tenants:" in report["router_config"] and "fairness: vtc" in report["router_config"]

    client = aioredis.from_url(REDIS_URL)
    try:
        assert [k async for k in client.scan_iter(match=f"{report['key_prefix']}*")] == []
    finally:
        await client.aclose()
    assert report["redis_keys_deleted"] > 0

    jpath, mpath = write_report({"command": "test", **report}, tmp_path, "vtc")
    assert jpath.stat().st_size > 0
    assert "| flood | aggressor |" in mpath.read_text()


async def test_flood_bench_across_replicas_reports_each_row(tmp_path: Path) -> None:
    """Issue 33's bench, one placement for a few seconds: two replicas on a private Redis,
    simulated workers. The row's shape, the aggressor never a 5xx, every 429 with a
    Retry-After, every answer's text exactly the simulated worker's; not the timing targets."""
    ns = flood_replicas_cli.parse_args(
        [
            "--placement", "split", "--fairness", "vtc", "--duration", "6", "--warmup", "1",
            "--aggressor-clients", "8", "--victim-tokens", "16", "--aggressor-tokens", "64",
            "--decode-blocks", "40", "--out", str(tmp_path),
        ]
    )  # fmt: skip
    specs = flood_replicas_cli.placement_specs(ns)
    assert [(s.placement, s.fairness, s.victim_pause_s) for s in specs] == [("split", "vtc", 1.0)]
    report = await flood_replicas_cli.run_placements(ns)

    (row,) = report["rows"]
    assert (row["placement"], row["fairness"]) == ("split", "vtc")
    assert set(row["targets"]) == {
        "victim_goodput", "victim_ttft_p99", "work_conserving", "aggressor_no_5xx",
        "honest_429", "texts_exact",
    }  # fmt: skip
    assert len(report["baselines"]) == 2  # the victim's solo run, the aggressor's run alone
    victim, aggressor = row["victim"], row["aggressor"]
    assert victim["ok"] > 0 and aggressor["ok"] > 0 and row["victim_solo"]["ok"] > 0
    assert row["aggressor_alone"]["ok"] > 0
    for stats in (victim, aggressor, row["victim_solo"], row["aggressor_alone"]):
        assert stats["http_5xx"] == 0, stats["outcomes"]
        assert stats["not_exact"] == 0, stats["outcomes"]
        assert stats["rejected_429"] == stats["rejected_429_with_retry_after"], stats
        assert set(stats["outcomes"]) <= {"ok", "shed"}, stats["outcomes"]
    assert row["targets"]["aggressor_no_5xx"] and row["targets"]["texts_exact"]
    assert row["dead_processes"] == []
    assert row["preemptions_per_1k"] >= 0 and row["work_ratio"] is not None
    table = placement_table(report["rows"])
    assert "| vtc, victim on replica 1, aggressor on replica 2 | 1 s pause |" in table
    assert report["router_settings"]["admission"]["fairness"] == "vtc"
