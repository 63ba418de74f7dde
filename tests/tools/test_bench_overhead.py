"""The router-overhead instrument works: a tiny run produces complete, sane records.

Smoke only (a handful of short streams at concurrency 1 and 4): no timed assertions. The full
measurement is `python -m disagg_tools.overhead` (docs/benchmarks-overhead.md).
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from disagg_tools.overhead.overhead_client import StreamRecord, _Conn
from disagg_tools.overhead.overhead_report import percentile, replace_between_markers
from tests.paths import REPO

ROOT = REPO
TOKENS = 6


def _run_bench(tmp_path: Path, targets: str, *extra: str) -> dict[str, Any]:
    out = tmp_path / "overhead.json"
    md = tmp_path / "overhead.md"
    cmd = [
        sys.executable,
        "-m",
        "disagg_tools.overhead",
        "--targets",
        targets,
        "--concurrency",
        "1,4",
        "--rounds",
        "1",
        "--requests",
        "2",
        "--requests-c1",
        "2",
        "--tokens",
        str(TOKENS),
        "--interval-ms",
        "2",
        "--prefill-ms",
        "1",
        "--sat-concurrency",
        "4",
        "--sat-tokens",
        "16",
        "--sat-interval-ms",
        "1",
        "--no-pin",
        "--json",
        str(out),
        "--markdown",
        str(md),
        "--log-dir",
        str(tmp_path / "logs"),
        *extra,
    ]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=100)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    result["_markdown"] = md.read_text()
    result["_stderr"] = proc.stderr
    return result


def _check_run(r: dict[str, Any], tokens: int) -> None:
    assert r["requests"] > 0 and r["complete"] == r["requests"], r["errors"]
    assert r["tokens_measured"] == r["requests"] * tokens
    assert r["ttft_ms"]["p50"] > 0 and r["ttft_ms"]["p50"] <= r["ttft_ms"]["p99"]
    assert r["itl_samples"] == r["requests"] * (tokens - 1)
    assert r["itl_ms"]["p50"] >= 0
    if r["target"] != "baseline":
        assert r["router_cpu_s"] is not None and r["router_cpu_s"] >= 0
        assert r["cpu_s_per_1k_tokens"] is not None
        # every answer took one prefill and one decode call upstream
        assert r["upstream"]["decode_requests"] == r["requests"] + r["warmup_requests"]
        assert r["upstream"]["prefill_requests"] == r["requests"] + r["warmup_requests"]
    else:
        assert r["router_cpu_s"] is None


def test_smoke_baseline_and_our_router(tmp_path: Path) -> None:
    result = _run_bench(tmp_path, "baseline,ours")
    runs = result["runs"]
    assert [(r["target"], r["concurrency"]) for r in runs] == [
        ("baseline", 1),
        ("baseline", 4),
        ("ours", 1),
        ("ours", 4),
    ]
    for r in runs:
        _check_run(r, TOKENS)
    ours = [r for r in runs if r["target"] == "ours"]
    assert all("added_ttft_ms" in r and "added_itl_ms" in r for r in ours)
    sat = result["saturation"]
    assert [r["target"] for r in sat] == ["baseline", "ours"]
    for r in sat:
        _check_run(r, 16)
        assert r["tokens_per_s"] and r["tokens_per_s"] > 0
    assert result["machine"]["cpus"] >= 1
    md = result["_markdown"]
    assert "<!-- overhead:begin -->" in md and "#### 4 concurrent streams" in md
    assert "| ours |" in md and "#### Saturation" in md
    # Into a pipe: every rung's line, and no progress bar (disagg_tools/progress.py draws on
    # a TTY only).
    lines = result["_stderr"].splitlines()
    assert sum(line.startswith("[ladder round 1]") for line in lines) == 4
    assert "\r" not in result["_stderr"] and "rung/s" not in result["_stderr"]


def _is_positive_finite(x: Any) -> bool:
    return isinstance(x, int | float) and math.isfinite(x) and x > 0


def test_smoke_the_dropin_target_with_redis_over_two_answer_lengths(tmp_path: Path) -> None:
    """`ours_dropin`: our router started as users deploy it (no file, the drop-in flags, Redis),
    against the stand-in workers, over a ladder of two answer lengths; every row carries its
    answer length, TTFT p99.9 and the router's CPU per request."""
    import tests.conftest as conftest

    result = _run_bench(
        tmp_path, "baseline,ours_dropin", "--tokens", "4,8", "--redis-url", conftest.REDIS_URL
    )
    runs = result["runs"]
    assert [(r["target"], r["max_tokens"], r["concurrency"]) for r in runs] == [
        (target, tokens, c)
        for target in ("baseline", "ours_dropin")
        for tokens in (4, 8)
        for c in (1, 4)
    ]
    for r in runs:
        _check_run(r, r["max_tokens"])
        ttft = r["ttft_ms"]
        assert _is_positive_finite(ttft["p99.9"]) and ttft["p99"] <= ttft["p99.9"]
    ours = [r for r in runs if r["target"] == "ours_dropin"]
    for r in ours:
        assert _is_positive_finite(r["cpu_ms_per_request"]), r
        assert _is_positive_finite(r["cpu_s_per_1k_tokens"]), r
        assert math.isfinite(r["added_ttft_ms"]["p99.9"])
    # The kernel's share of the router's CPU (from 10 ms ticks: a rung too short for one tick
    # has none), a fraction wherever there is one.
    shares = [r["router_kernel_share"] for r in ours if r["router_kernel_share"] is not None]
    assert shares and all(0.0 <= x <= 1.0 for x in shares), ours
    (sat_dropin,) = [r for r in result["saturation"] if r["target"] == "ours_dropin"]
    assert _is_positive_finite(sat_dropin["cpu_ms_per_request"])

    command = result["router_commands"]["ours_dropin@ladder"]
    assert "--config" not in command and not list((tmp_path / "logs").glob("*.yaml"))
    assert f"--redis-url {conftest.REDIS_URL}" in command
    assert " serve " in command and "--prefill http://" in command and "--decode http://" in command
    assert "DISAGG_ROUTER_STORE_KEY_PREFIX=" in command

    md = result["_markdown"]
    for column in ("answer tokens", "TTFT p99.9", "added TTFT p99.9", "router CPU-ms / request"):
        assert column in md, column
    assert "#### 1 concurrent stream, 4-token answers" in md
    assert "#### 4 concurrent streams, 8-token answers" in md
    assert "| ours_dropin | 8 | " in md
    lines = result["_stderr"].splitlines()
    assert sum(line.startswith("[ladder round 1]") for line in lines) == 8


def test_the_dropin_command_line_is_the_deployed_one(tmp_path: Path) -> None:
    """`ours_dropin` is `disagg-router serve --prefill URL --decode URL --redis-url URL`: the
    real command line parses it, no file is written, and each start has a key prefix of its
    own (in the environment: `serve` has no flag for it)."""
    import argparse

    from disagg_tools.launcher.main import build_parser
    from disagg_tools.overhead.targets import router_command

    ns = argparse.Namespace(adapter="vllm", redis_url="redis://127.0.0.1:6379/3")
    prefill, decode = ["http://127.0.0.1:1", "http://127.0.0.1:2"], ["http://127.0.0.1:3"]
    cmd, env = router_command("ours_dropin", ns, prefill, decode, port=4, log_dir=tmp_path)
    _, env_again = router_command("ours_dropin", ns, prefill, decode, port=4, log_dir=tmp_path)
    assert "--config" not in cmd and not list(tmp_path.iterdir())
    assert Path(cmd[0]).name == "disagg-router" or cmd[1:3] == ["-m", "disagg_tools.launcher.main"]
    first_flag = next(i for i, a in enumerate(cmd) if a.startswith("--"))
    parsed = build_parser().parse_args(cmd[first_flag:])
    assert parsed.command == "serve" and parsed.config is None
    assert parsed.redis_url == "redis://127.0.0.1:6379/3" and parsed.port == 4
    assert [p[0] for p in parsed.prefill] == prefill and parsed.decode == decode
    assert parsed.adapter is None  # vllm: the drop-in's own default, not said
    prefix = env["DISAGG_ROUTER_STORE_KEY_PREFIX"]
    assert prefix.endswith(":") and prefix != env_again["DISAGG_ROUTER_STORE_KEY_PREFIX"]


def test_the_stand_in_worker_tells_what_the_dropin_reads() -> None:
    """The fixed worker's `/metrics` carries vLLM's `vllm:cache_config_info`: the router's own
    parser reads the KV capacity a drop-in start needs from it."""
    from disagg_tools.overhead.fixed_worker import DEFAULT_KV_BLOCKS, FixedWorker
    from router.workers.discovery import worker_facts_vllm

    worker = FixedWorker("decode", "m", 0.02, 0.01, None, "127.0.0.1", 1)
    models = {"data": [{"id": "m", "max_model_len": 32768}]}
    facts = worker_facts_vllm(models, worker.metrics_text())
    assert (facts.models, facts.kv_blocks, facts.block_size) == (("m",), DEFAULT_KV_BLOCKS, 16)
    small = FixedWorker("decode", "m", 0.02, 0.01, None, "127.0.0.1", 1, kv_blocks=7)
    assert worker_facts_vllm(models, small.metrics_text()).kv_blocks == 7


def test_the_stand_in_worker_answers_metrics_by_name_as_vllm_does() -> None:
    """vLLM's prometheus_client answers `/metrics?name[]=...` with the named families only; the
    stand-in does too, so that the benchmark's load polls cost what they cost against vLLM."""
    from prometheus_client.parser import text_string_to_metric_families

    from disagg_tools.overhead.fixed_worker import FixedWorker, other_families, restricted
    from router.workers.discovery import LOAD_METRICS_PATH, parse_vllm_metrics

    real = (REPO / "tests/router/workers/texts/vllm-0.32-metrics.txt").read_text()
    worker = FixedWorker(
        "decode", "m", 0.02, 0.01, None, "127.0.0.1", 1, metrics_extra=other_families(real)
    )
    worker.running = 3
    whole = worker.metrics_text()
    names = {q.removeprefix("name[]=") for q in LOAD_METRICS_PATH.partition("?")[2].split("&")}
    text = restricted(whole, names)
    assert len(text) * 20 < len(whole)
    assert {s.name for f in text_string_to_metric_families(text) for s in f.samples} == {
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:cache_config_info",
    }
    assert parse_vllm_metrics(text, 1.0) == parse_vllm_metrics(whole, 1.0)
    assert parse_vllm_metrics(text, 1.0).running == 3


@pytest.mark.peers
@pytest.mark.parametrize("peer,module", [("sglang", "sglang_router"), ("vllm", "vllm_router")])
def test_smoke_peer_router(tmp_path: Path, peer: str, module: str) -> None:
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} is not installed (scripts/install_peers.sh)")
    result = _run_bench(tmp_path, peer, "--concurrency", "2", "--no-saturation")
    (r,) = result["runs"]
    assert r["target"] == peer
    _check_run(r, TOKENS)


# --- the pieces ---------------------------------------------------------------------------------


def test_percentile_interpolates() -> None:
    assert percentile([], 50) is None
    assert percentile([3.0], 99) == 3.0
    assert percentile([4.0, 1.0, 2.0, 3.0], 50) == 2.5
    assert percentile([1.0, 2.0], 100) == 2.0


def test_gaps_count_tokens_sharing_a_read_as_zero() -> None:
    rec = StreamRecord(0, 0, warmup=False)
    for t, n in ((1.0, 1), (1.02, 3), (1.05, 1)):
        rec.reads.append(t)
        rec.counts.append(n)
    assert rec.gaps() == pytest.approx([0.02, 0.0, 0.0, 0.03])


def _fake_run(target: str, tokens: int, c: int, ttft_p50: float) -> dict[str, Any]:
    ttft = {"p50": ttft_p50, "p90": ttft_p50, "p99": ttft_p50, "p99.9": ttft_p50 + 1.0}
    router = target != "baseline"
    return {
        "target": target,
        "max_tokens": tokens,
        "concurrency": c,
        "complete": 1,
        "requests": 1,
        "ttft_ms": ttft,
        "itl_ms": {"p50": 20.0, "p90": 20.0, "p99": 21.0},
        "tokens_per_s": 100.0,
        "router_cpu_util": 0.1 if router else None,
        "cpu_s_per_1k_tokens": 0.03 if router else None,
        "cpu_ms_per_request": 2.5 if router else None,
        "router_kernel_share": 0.3 if router else None,
    }


def test_deltas_and_tables_are_per_answer_length() -> None:
    """Each router run is compared with the baseline of its own answer length and concurrency;
    one table per (length, concurrency), each row labelled with its length; the targets are
    judged at their own 128 tokens."""
    from disagg_tools.overhead.overhead_report import add_deltas, markdown

    runs = [
        _fake_run("baseline", 16, 256, 10.0),
        _fake_run("baseline", 128, 256, 30.0),
        _fake_run("ours_dropin", 16, 256, 12.0),
        _fake_run("ours_dropin", 128, 256, 31.0),
    ]
    add_deltas(runs)
    assert runs[2]["added_ttft_ms"] == {"p50": 2.0, "p90": 2.0, "p99": 2.0, "p99.9": 2.0}
    assert runs[3]["added_ttft_ms"]["p50"] == 1.0
    md = markdown({"runs": runs, "params": {}})
    short = md.index("#### 256 concurrent streams, 16-token answers")
    assert short < md.index("#### 256 concurrent streams, 128-token answers")
    assert "| ours_dropin | 16 | 1 / 1 | 12.00 | 12.00 | 13.00 | +2.00 | +2.00 | +2.00 |" in md
    # CPU per 1k tokens, CPU per request, then the kernel's share of it
    assert "| 0.0300 | 2.500 | 30 % |" in md
    assert "#### Against the targets (256 streams, 128-token answers)" in md
    verdict = md[md.index("#### Against the targets") :]
    assert "+1.00 ms" in verdict and "+2.00 ms" not in verdict


def test_tokens_takes_a_comma_list() -> None:
    from disagg_tools.overhead.overhead_cli import _parse

    assert _parse(["--tokens", "16,128", "--no-pin"]).tokens == [16, 128]
    assert _parse(["--no-pin"]).tokens == [128]
    with pytest.raises(SystemExit):
        _parse(["--tokens", "16,0"])


def test_markers_replace_only_the_generated_block() -> None:
    doc = replace_between_markers(None, "one")
    doc = doc.replace("# Router overhead", "# Router overhead\n\nhand-written reading")
    doc2 = replace_between_markers(doc, "two")
    assert "hand-written reading" in doc2 and "two" in doc2 and "one" not in doc2


def _stream_bytes(tokens: int) -> bytes:
    head = (
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
    )
    body = b""
    for i in range(tokens):
        fin = b'"length"' if i == tokens - 1 else b"null"
        ev = b'data: {"choices":[{"index":0,"text":" t","finish_reason":%s}]}\n\n' % fin
        body += b"%x\r\n%s\r\n" % (len(ev), ev)
    done = b"data: [DONE]\n\n"
    body += b"%x\r\n%s\r\n0\r\n\r\n" % (len(done), done)
    return head + body


async def test_client_parser_survives_any_split() -> None:
    """Responses split at every byte offset (and byte by byte) parse to the same record."""
    data = _stream_bytes(3)

    class _Transport:
        def write(self, data: bytes) -> None:
            pass

        def is_closing(self) -> bool:
            return False

        def get_extra_info(self, name: str) -> None:
            return None

    for pieces in [[data[:i], data[i:]] for i in range(1, len(data))] + [
        [bytes([b]) for b in data]
    ]:
        conn = _Conn(chat=False)
        conn.connection_made(_Transport())  # type: ignore[arg-type]
        rec = StreamRecord(0, 0, warmup=False)
        fut = conn.request(b"POST / HTTP/1.1\r\n\r\n", rec)
        for piece in pieces:
            conn.data_received(piece)
        assert fut.done() and fut.result() == b""
        assert (rec.status, rec.tokens, rec.done, rec.error) == (200, 3, True, None)
        assert sum(rec.counts) == 3
    await asyncio.sleep(0)


def test_idle_phase_measures_our_router_against_four_workers(tmp_path: Path) -> None:
    """`disagg_tools.overhead.idle` starts four workers and our router in front of all four,
    and
    reports a CPU figure read from /proc (no bound on it: that is the benchmark's to show)."""
    cmd = [
        sys.executable,
        "-m",
        "disagg_tools.overhead.idle",
        "--targets",
        "ours",
        "--no-pin",
    ]
    cmd += ["--idle-s", "1", "--settle-s", "0.5", "--log-dir", str(tmp_path)]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    config = (tmp_path / "idle-ours.yaml").read_text()
    assert config.count("role: prefill") == 2 and config.count("role: decode") == 2
    row = next(line for line in out.stdout.splitlines() if line.startswith("| ours |"))
    cpu_ms_per_s = float(row.split("|")[3].strip().strip("*"))
    assert cpu_ms_per_s >= 0.0


def test_idle_phase_measures_the_dropin_target(tmp_path: Path) -> None:
    """The idle phase starts `ours_dropin` against its four workers from the command line
    alone (two --prefill, two --decode, --redis-url): no configuration file is written."""
    import tests.conftest as conftest

    cmd = [sys.executable, "-m", "disagg_tools.overhead.idle", "--targets", "ours_dropin"]
    cmd += ["--no-pin", "--idle-s", "1", "--settle-s", "0.5", "--log-dir", str(tmp_path)]
    cmd += ["--redis-url", conftest.REDIS_URL]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert not list(tmp_path.glob("*.yaml"))
    row = next(line for line in out.stdout.splitlines() if line.startswith("| ours_dropin |"))
    assert float(row.split("|")[3].strip().strip("*")) >= 0.0


def test_the_ladder_draws_a_progress_bar_on_a_terminal(tmp_path: Path) -> None:
    """On a terminal (a pseudo-terminal's slave as stderr) the ladder's rungs tick a bar."""
    import fcntl
    import os
    import struct
    import termios

    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))
    cmd = [
        sys.executable, "-m", "disagg_tools.overhead",
        "--targets", "baseline", "--concurrency", "1",
        "--rounds", "1", "--requests-c1", "2", "--tokens", str(TOKENS), "--interval-ms", "2",
        "--prefill-ms", "1", "--no-saturation", "--no-pin", "--json", str(tmp_path / "o.json"),
        "--log-dir", str(tmp_path / "logs"),
    ]  # fmt: skip
    try:
        done = subprocess.run(cmd, cwd=ROOT, stderr=slave, stdout=subprocess.DEVNULL, timeout=100)
        os.close(slave)
        out = b""
        while True:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO once the slave side is closed and drained
                break
            if not chunk:
                break
            out += chunk
    finally:
        os.close(master)
    assert done.returncode == 0
    text = out.decode("utf-8", "replace")
    assert "ladder" in text and "1/1" in text and "rung" in text, text[-2000:]


@pytest.mark.parametrize(
    ("flag", "exact"),
    [("tokenizer", {"ours", "ours_redis"}), ("alt_tokenizer", {"ours_alt"})],
)
def test_a_tokenizer_puts_exact_counts_into_the_measured_router(
    tmp_path: Path, flag: str, exact: set[str]
) -> None:
    """`--tokenizer` (ours, ours_redis) and `--alt-tokenizer` (ours_alt): the router measured is
    configured to count prompts with that tokenizer, each of the others with the estimate."""
    import argparse

    from disagg_tools.overhead.targets import router_command
    from router.config import load_settings

    tok = ROOT / "examples" / "aiperf" / "tokenizer"
    ns = argparse.Namespace(
        model="llama-3-8b",
        adapter="vllm",
        redis_url="redis://127.0.0.1:6379/0",
        alt_redis=False,
        tokenizer=None,
        alt_tokenizer=None,
    )
    setattr(ns, flag, str(tok))
    workers = (["http://127.0.0.1:1"], ["http://127.0.0.1:2"])
    for name in ("ours", "ours_redis", "ours_alt"):
        cmd, _ = router_command(name, ns, *workers, port=3, log_dir=tmp_path)
        settings = load_settings(cmd[cmd.index("--config") + 1])
        want = {"llama-3-8b": str(tok.resolve())} if name in exact else {}
        assert dict(settings.estimates.tokenizers) == want, name


def test_smoke_the_tenants_target_beside_the_same_router_without(tmp_path: Path) -> None:
    """`ours_tenants` (issue 33): ours_redis with tenants configured (vtc, one fair share for
    the cluster), its streams spread over the tenants' keys; the report puts the two side by
    side with their ratio."""
    import tests.conftest as conftest

    result = _run_bench(
        tmp_path,
        "baseline,ours_redis,ours_tenants",
        "--tenants",
        "3",
        "--no-saturation",
        "--redis-url",
        conftest.REDIS_URL,
    )
    runs = result["runs"]
    assert {r["target"] for r in runs} == {"baseline", "ours_redis", "ours_tenants"}
    for r in runs:
        # Every answer complete: the router wants a key once tenants are configured, so the
        # tenants target's answers came with the tenants' keys.
        _check_run(r, TOKENS)
    config = (tmp_path / "logs" / "ours_tenants.yaml").read_text()
    assert '"fairness": "vtc"' in config and '"fair_cluster": true' in config
    assert config.count('"key": "sk-overhead-tenant-') == 3
    assert "tenants" not in (tmp_path / "logs" / "ours_redis.yaml").read_text()
    md = result["_markdown"]
    assert "#### Tenants configured (ours_redis without, ours_tenants with)" in md
    rows = [line for line in md.splitlines() if line.startswith(("| 1 | 6 |", "| 4 | 6 |"))]
    assert len(rows) == 2


def test_the_load_spreads_its_slots_over_the_keys() -> None:
    from disagg_tools.overhead.overhead_client import LoadSpec, _post, _Slot

    spec = LoadSpec(5, 1, target=("127.0.0.1", 1), api_keys=("a", "b"))
    keys = [_Slot(spec, i, lambda r: None).api_key for i in range(5)]
    assert keys == ["a", "b", "a", "b", "a"]
    assert _Slot(LoadSpec(1, 1, target=("h", 1)), 0, lambda r: None).api_key is None
    assert b"Authorization: Bearer a\r\n" in _post("h", "/v1/completions", b"{}", api_key="a")
    assert b"Authorization" not in _post("h", "/v1/completions", b"{}")
