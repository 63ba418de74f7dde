"""CI versions of `python -m disagg_tools.loadgen.load`: a 500-stream burst and a 500-request
non-streaming
burst through one router subprocess (the shared Redis under this test's own key prefix), every
answer checked token for token against the simulated workers' text.

Select them with `pytest tests/tools/test_load_ci.py` (marked `slow`). No timing is asserted: the
invariants are "every request ok or a clean 429" and "nothing left in the store once quiet".
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import orjson
import pytest
from aiohttp import web

from disagg_tools.loadgen.load import LoadSpec, format_report, run
from disagg_tools.loadgen.load_cluster import ClusterSpec
from disagg_tools.loadgen.loadclient import make_request, new_session, send
from tests.conftest import REDIS_URL


def _spec(redis_prefix: str, *, stream: bool) -> LoadSpec:
    cluster = ClusterSpec(redis="shared", shared_redis_url=REDIS_URL, key_prefix=redis_prefix)
    # Generous per-request deadline: a hang is a failure, a slow CI machine is not.
    return LoadSpec(
        mode="burst",
        n=500,
        stream=stream,
        output_tokens=16,
        deadline_s=150.0,
        quiet_timeout_s=40.0,
        cluster=cluster,
    )


@pytest.mark.slow
@pytest.mark.timeout(300)
async def test_burst_of_500_streams_all_exact_and_nothing_left(redis_prefix: str) -> None:
    report = await run(_spec(redis_prefix, stream=True))
    print(format_report(report))
    assert report["violations"] == [], format_report(report)
    assert report["outcomes"].get("ok", 0) + report["outcomes"].get("shed", 0) == 500


@pytest.mark.slow
@pytest.mark.timeout(300)
async def test_burst_of_500_whole_answers_all_exact_and_nothing_left(redis_prefix: str) -> None:
    report = await run(_spec(redis_prefix, stream=False))
    print(format_report(report))
    assert report["violations"] == [], format_report(report)
    assert report["outcomes"].get("ok", 0) + report["outcomes"].get("shed", 0) == 500


# --- the checking client's verdicts, against a scripted server (no router, no workers) -------


@contextlib.asynccontextmanager
async def _server(handler: object) -> AsyncIterator[str]:
    app = web.Application()
    app.router.add_post("/v1/chat/completions", handler)  # type: ignore[arg-type]
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


def _sse(*events: bytes) -> bytes:
    return b"".join(b"data: " + e + b"\n\n" for e in events)


def _chunk(text: str, finish: str | None = None) -> bytes:
    return orjson.dumps(
        {"choices": [{"index": 0, "delta": {"content": text}, "finish_reason": finish}]}
    )


REQ = make_request(7, model="llama-3-8b", prompt_tokens=8, output_tokens=5)
WORDS = [" " + w for w in REQ.expected_text.split()]


async def _verdict(handler: object) -> str:
    async with _server(handler) as url, new_session(4) as session:
        return (await send(session, url, REQ, deadline_s=10)).outcome


@pytest.mark.parametrize(
    ("body", "outcome"),
    [
        (
            _sse(
                *(_chunk(w) for w in WORDS[:-1]), _chunk(WORDS[-1], REQ.expected_finish), b"[DONE]"
            ),
            "ok",
        ),
        (
            _sse(*(_chunk(w) for w in WORDS[:-1]), _chunk(" zz", REQ.expected_finish), b"[DONE]"),
            "wrong_text",
        ),
        (_sse(*(_chunk(w) for w in WORDS[:2])), "cut"),
        (
            _sse(_chunk(WORDS[0]), b'{"error": {"message": "gone", "code": 500}}', b"[DONE]"),
            "stream_error",
        ),
        (_sse(b'{"id": "x", "choices": [{"text": '), "cut"),
    ],
)
async def test_client_verdict_on_streams(body: bytes, outcome: str) -> None:
    async def handler(request: web.Request) -> web.Response:
        return web.Response(body=body, content_type="text/event-stream")

    assert await _verdict(handler) == outcome


@pytest.mark.parametrize(
    ("status", "headers", "body", "outcome"),
    [
        (429, {"Retry-After": "1"}, b'{"error": {"message": "full"}}', "shed"),
        (429, {}, b'{"error": {"message": "full"}}', "bad_refusal"),
        (429, {"Retry-After": "1"}, b"busy", "bad_refusal"),
        (503, {"Retry-After": "2"}, b'{"error": {"message": "store"}}', "unavailable"),
        (503, {}, b'{"error": {"message": "store"}}', "http_5xx"),
        (500, {}, b'{"error": {"message": "boom"}}', "http_5xx"),
        (400, {}, b'{"error": {"message": "bad"}}', "http_4xx"),
    ],
)
async def test_client_verdict_on_refusals(
    status: int, headers: dict[str, str], body: bytes, outcome: str
) -> None:
    async def handler(request: web.Request) -> web.Response:
        return web.Response(
            status=status, headers=headers, body=body, content_type="application/json"
        )

    assert await _verdict(handler) == outcome


WHOLE = make_request(8, model="llama-3-8b", prompt_tokens=8, output_tokens=5, stream=False)


@pytest.mark.parametrize(
    ("answer", "outcome"),
    [
        (
            {
                "choices": [
                    {
                        "message": {"content": WHOLE.expected_text},
                        "finish_reason": WHOLE.expected_finish,
                    }
                ]
            },
            "ok",
        ),
        (
            {
                "choices": [
                    {
                        "message": {"content": WHOLE.expected_text[:-3]},
                        "finish_reason": WHOLE.expected_finish,
                    }
                ]
            },
            "wrong_text",
        ),
        ({"object": "chat.completion", "choices": [], "usage": None}, "wrong_text"),
        (b'{"id": "cmpl-broken", "choices": [', "cut"),
    ],
)
async def test_client_verdict_on_whole_answers(answer: object, outcome: str) -> None:
    body = answer if isinstance(answer, bytes) else orjson.dumps(answer)

    async def handler(request: web.Request) -> web.Response:
        return web.Response(body=body, content_type="application/json")

    async with _server(handler) as url, new_session(4) as session:
        assert (await send(session, url, WHOLE, deadline_s=10)).outcome == outcome
