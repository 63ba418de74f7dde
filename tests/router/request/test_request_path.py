"""The request path driven without the router's HTTP server (router/request/lifecycle.py): a fake
client
side (router/request/respond.py `ClientSide`) in front of `RequestFlow`, the gateway of a sim
cluster
(simulated workers on loopback, real Redis). A streamed request, a resumed one, a whole one and
a client that leaves mid-stream each go through the orchestrator, and leave nothing held."""

from __future__ import annotations

from typing import Any

import orjson

from disagg_tools.sim.textgen import expected_answer
from router.edge.app import served_models
from router.openai.api import CHAT, parse_request
from router.request.lifecycle import ClientSide, RequestFlow
from tests.conftest import SimCluster, sim_cluster
from tests.router.request.test_faults import (
    FAST_RETRY,
    assert_quiet,
    body_for,
    set_faults,
    sse_text,
)


class FakeStream:
    """The client's stream: keeps what it is written; once `leave_after` writes, the client
    has gone (a write raises ConnectionResetError, as aiohttp's does)."""

    def __init__(self, leave_after: int | None = None) -> None:
        self.headers: dict[str, str] = {}
        self.writes: list[bytes] = []
        self.ended = False
        self.leave_after = leave_after

    async def start(self, headers: dict[str, str]) -> FakeStream:
        self.headers = headers
        return self

    async def write(self, data: bytes) -> None:
        if self.leave_after is not None and len(self.writes) >= self.leave_after:
            raise ConnectionResetError("the client went away")
        self.writes.append(data)

    async def write_eof(self) -> None:
        self.ended = True


async def serve(
    c: SimCluster, body: dict[str, Any], stream: FakeStream, request_id: str
) -> tuple[RequestFlow, bytes | None]:
    gw = c.parts
    s = gw.settings
    parsed = parse_request(
        CHAT,
        orjson.dumps(body),
        models=served_models(gw.settings, gw.pools),
        max_model_len=s.max_model_len,
        chars_per_token=s.estimates.chars_per_token,
    )
    client = ClientSide(parsed, {"X-Request-Id": request_id}, stream.start)
    flow = RequestFlow(gw.requests, client, request_id)
    try:
        answer = await flow.run()
    finally:
        await flow.cleanup()
    return flow, answer


# The fake stream is no aiohttp response, so the decode legs go through aiohttp's client and
# router/relay/aiohttp_relay.py (the splice relay writes to aiohttp's transport).
CLUSTER: dict[str, Any] = {"retry": FAST_RETRY, "upstream": {"relay": "aiohttp"}}


async def test_streamed_request_runs_through_the_orchestrator(redis_prefix: str) -> None:
    async with sim_cluster(redis_prefix=redis_prefix, **CLUSTER) as c:
        body = {**body_for(11, max_tokens=20), "stream": True}
        stream = FakeStream()
        flow, answer = await serve(c, body, stream, "path-stream-1")
        assert answer is None and flow.status == 200 and stream.ended
        assert stream.headers["X-Request-Id"] == "path-stream-1"
        assert stream.headers["Content-Type"] == "text/event-stream"
        text, pieces, errors = sse_text(b"".join(stream.writes))
        want, n, _ = expected_answer(CHAT, body)
        assert errors == [] and text == want and len(pieces) == n
        assert flow.output_tokens == n and flow.attempts == 1
        await assert_quiet(c)


async def test_resumed_stream_runs_through_the_orchestrator(redis_prefix: str) -> None:
    async with sim_cluster(redis_prefix=redis_prefix, decode=2, **CLUSTER) as c:
        for wid in ("d0", "d1"):
            await set_faults(c, wid, decode_die_after_tokens=7, count=1)
        body = {**body_for(12, max_tokens=30), "stream": True}
        stream = FakeStream()
        flow, answer = await serve(c, body, stream, "path-resume-1")
        assert answer is None and flow.status == 200 and stream.ended
        text, pieces, errors = sse_text(b"".join(stream.writes))
        want, n, _ = expected_answer(CHAT, body)
        assert errors == [] and text == want and len(pieces) == n  # each token once, in order
        resumes = c.parts.metrics.resumes._value.get()
        assert resumes >= 1 and flow.attempts == resumes + 1  # each break resumed once
        # Each resumed leg carried the answer so far (a prefix of the whole) to continue.
        decode_bodies = [r for wid in ("d0", "d1") for r in await c.worker_requests(wid)]
        resumed = [r["body"] for r in decode_bodies if r["body"].get("continue_final_message")]
        assert len(resumed) == resumes
        for leg in resumed:
            last = leg["messages"][-1]
            assert last["role"] == "assistant" and last["content"]
            assert want.startswith(last["content"])
        await assert_quiet(c)


async def test_whole_answer_is_returned_not_streamed(redis_prefix: str) -> None:
    async with sim_cluster(redis_prefix=redis_prefix, **CLUSTER) as c:
        body = body_for(13, max_tokens=15)
        stream = FakeStream()
        flow, answer = await serve(c, body, stream, "path-whole-1")
        assert answer is not None and stream.writes == [] and not stream.ended
        want, n, _ = expected_answer(CHAT, body)
        whole = orjson.loads(answer)
        assert whole["choices"][0]["message"]["content"] == want
        assert whole["usage"]["completion_tokens"] == flow.output_tokens == n
        await assert_quiet(c)


async def test_client_that_leaves_mid_stream_ends_the_request(redis_prefix: str) -> None:
    async with sim_cluster(redis_prefix=redis_prefix, **CLUSTER) as c:
        body = {**body_for(14, max_tokens=200), "stream": True}
        stream = FakeStream(leave_after=3)
        flow, answer = await serve(c, body, stream, "path-gone-1")
        assert answer is None and flow.status == 499 and not stream.ended
        assert len(stream.writes) == 3
        assert c.parts.metrics.client_disconnects._value.get() == 1
        await assert_quiet(c)
