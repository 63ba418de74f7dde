"""Replay, report and the bench CLI against tiny in-test OpenAI-style servers on 127.0.0.1:0.

The scripted server picks its behaviour from the prompt length (characters / 4 = tokens), so
one open-loop run exercises every outcome at once.
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import orjson
import pytest
from aiohttp import web

from disagg_tools.goodput import GoodputSearch, goodput_search, goodput_search_sync
from disagg_tools.replay.replay_cli import add_bench_arguments, run_bench
from disagg_tools.replay.replay_report import (
    meets_slo,
    percentile,
    plot_attainment_vs_rate,
    summarize,
    tbt_worst_mean,
    to_markdown,
    to_text,
    write_report,
)
from disagg_tools.replay.replayer import ORACLE_HEADER, OUTCOMES, ReplayResult, endpoint_url, replay
from disagg_tools.traces import TraceRequest

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

OK, REJECT, CUT, ERROR_FRAME, HTTP_500, ABORT = 10, 11, 12, 13, 14, 15


@asynccontextmanager
async def serve(handler: Handler) -> AsyncIterator[str]:
    app = web.Application()
    app.router.add_post("/v1/chat/completions", handler)
    app.router.add_post("/v1/completions", handler)
    runner = web.AppRunner(app, shutdown_timeout=1.0, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    try:
        yield f"http://{host}:{port}"
    finally:
        await runner.cleanup()


def _chunk(text: str | None, chat: bool) -> bytes:
    if chat:
        delta: dict[str, Any] = {"content": text} if text is not None else {"role": "assistant"}
        choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": None}
    else:
        choice = {"index": 0, "text": text or "", "finish_reason": None}
    body = {"id": "x", "object": "chunk", "model": "m", "choices": [choice]}
    return b"data: " + orjson.dumps(body) + b"\n\n"


class Scripted:
    """An OpenAI-ish streaming server; behaviour chosen by the prompt's token count."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, dict[str, str], dict[str, Any]]] = []

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.seen.append((request.path, dict(request.headers), body))
        chat = request.path.endswith("/chat/completions")
        text = body["messages"][0]["content"] if chat else body["prompt"]
        kind = len(text) // 4
        if kind == REJECT:
            return web.json_response(
                {"error": {"message": "busy", "type": "overloaded", "param": None, "code": 429}},
                status=429,
                headers={"Retry-After": "3"},
            )
        if kind == HTTP_500:
            return web.json_response({"error": {"message": "boom"}}, status=500)
        n = min(int(request.headers.get(ORACLE_HEADER, "3")), body["max_tokens"])
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b": keep-alive\n\n" + _chunk(None, chat))
        for i in range(n):
            if kind == CUT and i == 2:
                return resp  # a clean end of body, but no [DONE]
            if kind == ABORT and i == 2:
                assert request.transport is not None
                request.transport.close()
                return resp
            if kind == ERROR_FRAME and i == 1:
                await resp.write(b'data: {"error": {"message": "decode died", "code": 500}}\n\n')
                await resp.write(b"data: [DONE]\n\n")
                return resp
            await resp.write(b": keep-alive\r\n\r\n" if i == 1 else b"")
            await resp.write(_chunk("tok ", chat))
        usage = {"prompt_tokens": kind, "completion_tokens": n, "total_tokens": kind + n}
        await resp.write(b"data: " + orjson.dumps({"choices": [], "usage": usage}) + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        return resp


def _req(i: int, kind: int, out: int, arrival: float = 0.0) -> TraceRequest:
    return TraceRequest(arrival_s=arrival, prompt_tokens=kind, output_tokens=out, index=i)


async def _mixed_run() -> tuple[ReplayResult, Scripted]:
    server = Scripted()
    kinds = [OK, REJECT, CUT, ERROR_FRAME, HTTP_500, ABORT]
    reqs = [_req(i, k, 4 + i, arrival=i * 0.001) for i, k in enumerate(kinds)]
    async with serve(server.handle) as url:
        result = await replay(url, reqs, model="m", max_tokens_cap=50, timeout_s=30)
    return result, server


async def test_mixed_outcomes_are_recorded() -> None:
    result, server = await _mixed_run()
    by = {r.index: r for r in result.records}
    ok = by[0]
    assert (ok.outcome, ok.status, ok.tokens, ok.usage_tokens) == ("ok", 200, 4, 4)
    assert len(ok.itl_s) == 3 and ok.ttft_s is not None and ok.tpot_s is not None
    rej = by[1]
    assert (rej.outcome, rej.status, rej.retry_after_s, rej.error) == ("rejected", 429, 3.0, "busy")
    assert (by[2].outcome, by[2].tokens, by[2].status) == ("cut", 2, 200)
    assert (by[3].outcome, by[3].tokens, by[3].error) == ("error", 1, "decode died")
    assert (by[4].outcome, by[4].status, by[4].error) == ("error", 500, "boom")
    assert (by[5].outcome, by[5].tokens) == ("cut", 2)
    assert sum(result.counts().values()) == len(result.records) == 6

    assert len(server.seen) == 6
    for path, headers, body in server.seen:
        assert path == "/v1/chat/completions"
        kind = len(body["messages"][0]["content"]) // 4
        i = [OK, REJECT, CUT, ERROR_FRAME, HTTP_500, ABORT].index(kind)
        assert headers[ORACLE_HEADER] == str(4 + i)  # the true length, only as the header
        assert body["max_tokens"] == 50
        assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
        assert body["model"] == "m"
        assert len(body["messages"][0]["content"]) == 4 * kind


async def test_report_accounts_for_every_request(tmp_path: Path) -> None:
    result, _ = await _mixed_run()
    s = summarize(result, slo_ttft_s=1e6, slo_tpot_s=1e6)
    req = s["requests"]
    assert req["sent"] == 6 and req["accounted"]
    assert sum(req[o] for o in OUTCOMES) == req["sent"]
    assert (req["ok"], req["rejected"], req["error"], req["timeout"], req["cut"]) == (1, 1, 2, 0, 2)
    assert s["slo"]["met"] == 1 and s["slo"]["attainment"] == pytest.approx(1 / 6)
    assert s["ttft_s"]["count"] == 1 and s["itl_s"]["count"] == 3
    assert s["throughput"]["output_tokens"] == 4 + 2 + 1 + 2
    assert s["usage_mismatch"] == 0 and s["retry_after_s"] == {"count": 1, "mean": 3.0}
    assert summarize(result, slo_ttft_s=0.0, slo_tpot_s=1e6)["slo"]["met"] == 0
    orjson.dumps(s)  # JSON-able
    assert to_markdown(s).startswith("| metric | value |")
    assert "rejected 1" in to_text(s)

    written = write_report(result, tmp_path, slo_ttft_s=1.0, slo_tpot_s=0.1)
    assert (tmp_path / "report.md").is_file()
    full = orjson.loads((tmp_path / "summary.json").read_bytes())
    assert len(full["run"]["records"]) == 6
    assert written["plots"] == ["ttft_cdf.png", "itl_cdf.png"]
    assert (tmp_path / "ttft_cdf.png").stat().st_size > 0
    assert plot_attainment_vs_rate([(1, 1.0), (2, 0.95), (4, 0.5)], tmp_path / "att.png")
    assert (tmp_path / "att.png").is_file()


async def test_completions_endpoint_and_v1_base_url() -> None:
    server = Scripted()
    async with serve(server.handle) as url:
        result = await replay(
            url + "/v1/",
            [_req(0, OK, 3)],
            model="m",
            endpoint="completions",
            max_tokens_cap=8,
            oracle_header=False,
            api_key="sekrit",
            extra_headers={"X-Extra": "1"},
        )
    rec = result.records[0]
    assert (rec.outcome, rec.tokens) == ("ok", 3)  # the server's default of 3
    path, headers, body = server.seen[0]
    assert path == "/v1/completions" and len(body["prompt"]) == 4 * OK
    assert ORACLE_HEADER not in headers
    assert headers["Authorization"] == "Bearer sekrit" and headers["X-Extra"] == "1"
    assert endpoint_url("http://h:1", "chat") == "http://h:1/v1/chat/completions"


async def test_open_loop_sends_without_waiting_for_earlier_answers() -> None:
    second_arrived = asyncio.Event()
    inner = Scripted()

    async def handler(request: web.Request) -> web.StreamResponse:
        if request.headers[ORACLE_HEADER] == "2":
            second_arrived.set()
        else:
            await second_arrived.wait()  # a closed-loop client would deadlock here
        return await inner.handle(request)

    reqs = [_req(0, OK, 1, arrival=0.0), _req(1, OK, 2, arrival=0.01)]
    async with serve(handler) as url:
        result = await replay(url, reqs, model="m", max_tokens_cap=4, timeout_s=60)
    assert [r.outcome for r in result.records] == ["ok", "ok"]
    assert [r.tokens for r in result.records] == [1, 2]


async def test_timeout_is_recorded_and_does_not_hang() -> None:
    release = asyncio.Event()

    async def hang(request: web.Request) -> web.StreamResponse:
        await release.wait()
        return web.Response(status=204)

    async with serve(hang) as url:
        try:
            result = await replay(url, [_req(0, OK, 3)], model="m", max_tokens_cap=4, timeout_s=0.2)
        finally:
            release.set()
    rec = result.records[0]
    assert rec.outcome == "timeout" and rec.status is None
    assert summarize(result)["requests"]["timeout"] == 1


async def test_time_and_rate_scaling_read_as_cluster_seconds() -> None:
    inner = Scripted()

    async def slow_first_token(request: web.Request) -> web.StreamResponse:
        await asyncio.sleep(0.02)
        return await inner.handle(request)

    reqs = [_req(0, OK, 2, arrival=0.0), _req(1, OK, 2, arrival=2.0)]
    async with serve(slow_first_token) as url:
        result = await replay(
            url, reqs, model="m", max_tokens_cap=4, time_scale=10.0, rate_scale=4.0
        )
    a, b = result.records
    assert (a.arrival_s, b.arrival_s) == (0.0, 0.5)  # 2.0 s at 4x the rate
    assert b.send_s is not None and b.send_s >= 0.5 - 1e-3  # slept 0.05 s wall = 0.5 s cluster
    # A 20 ms server delay reads as at least 200 ms of real-cluster time at time scale 10.
    assert a.ttft_s is not None and a.ttft_s >= 0.2
    assert result.duration_s >= 0.5


def test_percentiles_and_tbt() -> None:
    assert percentile([4, 1, 3, 2], 50) == 2.5
    assert percentile([], 50) is None
    assert percentile([1, 2, 3], 100) == 3
    assert tbt_worst_mean([float(x) for x in range(1, 21)]) == 19.5
    assert tbt_worst_mean([1.0, 5.0]) == 5.0
    assert tbt_worst_mean([]) is None


async def test_meets_slo_one_token_answer_has_no_tpot() -> None:
    result, _ = await _mixed_run()
    ok = result.records[0]
    assert meets_slo(ok, None, None)
    assert not meets_slo(result.records[1], None, None)  # rejected never meets


def test_goodput_search_brackets_then_bisects() -> None:
    found = goodput_search_sync(lambda r: 1.0 if r <= 3.3 else 0.5, start=1.0, max_steps=20)
    assert found.rate_scale is not None and 3.3 / 1.05 <= found.rate_scale <= 3.3
    assert found.attainment == 1.0
    assert [p[0] for p in found.points[:3]] == [1.0, 2.0, 4.0]


async def test_goodput_search_async_and_nothing_passes() -> None:
    async def never(rate: float) -> float:
        return 0.1

    found = await goodput_search(never, start=1.0, min_rate=0.2)
    assert found.rate_scale is None and found.attainment is None
    assert [p[0] for p in found.points] == [1.0, 0.5, 0.25]
    assert (await goodput_search(lambda r: 0.95, start=1.0, max_rate=4.0)).rate_scale == 4.0
    with pytest.raises(ValueError):
        GoodputSearch(factor=1.0)


async def test_cli_run_bench_writes_reports(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "t.csv"
    trace.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:15:46.0000000,10,3\n"
        "2023-11-16 18:15:46.0100000,10,5\n"
        "2023-11-16 18:15:46.0200000,11,2\n"
    )
    server = Scripted()
    async with serve(server.handle) as url:
        parser = add_bench_arguments(argparse.ArgumentParser())
        ns = parser.parse_args(
            ["--url", url, "--trace", str(trace), "--out", str(tmp_path / "out"), "--model", "m"]
        )
        assert await run_bench(ns) == 0
    out = capsys.readouterr().out
    assert "ok 2" in out and "rejected 1" in out
    assert {p.name for p in (tmp_path / "out").iterdir()} >= {"summary.json", "report.md"}
    assert all(body["max_tokens"] == 5 for _, _, body in server.seen)  # the trace's max output

    bad = parser.parse_args(["--url", "http://127.0.0.1:9", "--trace", str(tmp_path / "no.csv")])
    assert await run_bench(bad) == 2
