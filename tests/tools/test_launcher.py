"""The umbrella command (`disagg_tools/launcher/main.py`): every subcommand mounted, and `simulate`
fed a trace
that the launcher parses (the simulator itself reads no trace format)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from disagg_tools.launcher.main import build_parser, main


def _azure_trace(path: Path, n: int = 40) -> Path:
    rows = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
    for i in range(n):
        rows.append(f"2023-11-16 18:15:{i:02d}.0000000,{200 + 10 * i},{20 + i}")
    path.write_text("\n".join(rows) + "\n")
    return path


def test_every_subcommand_is_mounted_and_serve_is_the_routers_own() -> None:
    parser = build_parser()
    for argv in (
        ["serve", "--port", "0"],
        ["worker", "--role", "decode"],
        ["demo", "--requests", "5"],
        ["bench", "--url", "http://127.0.0.1:1", "--trace", "t.csv"],
        ["simulate", "--trace", "t.csv"],
    ):
        assert parser.parse_args(argv).command == argv[0]
    from router.edge.serve_cli import build_parser as router_parser

    # The same serve options in both entries (one definition:
    # router.edge.serve_cli.add_serve_arguments).
    ours = vars(parser.parse_args(["serve", "--policy", "random", "--port", "7"]))
    theirs = vars(router_parser().parse_args(["serve", "--policy", "random", "--port", "7"]))
    assert ours == theirs


def test_simulate_runs_a_trace_the_launcher_parsed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = _azure_trace(tmp_path / "conv.csv")
    out = tmp_path / "rows.json"
    argv = ["simulate", "--trace", str(trace), "--prefill", "1", "--decode", "2"]
    argv += ["--compare", "two_sided,least_loaded/noreserve", "--json", str(out)]
    code = main(argv)
    assert code == 0
    printed = capsys.readouterr().out
    assert printed.startswith("40 requests")
    rows = json.loads(out.read_text())
    assert [r["case"] for r in rows] == ["two_sided", "least_loaded/noreserve"]
    assert all(r["requests"] == r["ok"] + r["rejected"] + r["failed"] == 40 for r in rows)


def test_simulate_says_what_is_wrong_without_a_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["simulate", "--trace", str(tmp_path / "missing.csv")]) == 2
    bad = tmp_path / "bad.csv"
    bad.write_text("no,such,columns\n1,2,3\n")
    assert main(["simulate", "--trace", str(bad)]) == 2
    trace = _azure_trace(tmp_path / "conv.csv")
    assert main(["simulate", "--trace", str(trace), "--policy", "no_such_policy"]) == 2
    err = capsys.readouterr().err
    assert err.count("disagg-router: ") == 3
