"""The fault matrix: every failure mode of the split, streaming and not, on real sockets with a
real Redis. For each: the client's outcome (exact text through retry or resume, or a clean
error — never a hang), and nothing left reserved or stranded once the cluster is quiet."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import orjson
import pytest

from disagg_tools.sim.textgen import expected_answer
from tests.conftest import MODEL, SimCluster, sim_cluster

CHAT = "/v1/chat/completions"
FAST_RETRY = {"backoff_base_s": 0.005, "backoff_max_s": 0.02}


async def set_faults(c: SimCluster, wid: str, **faults: Any) -> None:
    async with (
        aiohttp.ClientSession() as s,
        s.post(c.workers[wid] + "/sim/faults", json=faults) as r,
    ):
        assert r.status == 200, await r.text()


def sse_text(raw: bytes) -> tuple[str, list[str], list[dict[str, Any]]]:
    """(text, token pieces, error frames) of a chat SSE body; every event must be valid JSON."""
    pieces, errors = [], []
    assert raw.endswith(b"data: [DONE]\n\n"), raw[-200:]
    for event in raw.split(b"\n\n"):
        if not event or event == b"data: [DONE]":
            continue
        assert event.startswith(b"data: "), event
        obj = orjson.loads(event[6:])  # a cut or spliced event would fail here
        if "error" in obj:
            errors.append(obj["error"])
            continue
        for choice in obj["choices"]:
            content = choice["delta"].get("content")
            if content:
                pieces.append(content)
    return "".join(pieces), pieces, errors


async def call(c: SimCluster, body: dict[str, Any], stream: bool) -> tuple[int, Any]:
    body = {**body, "stream": stream}
    async with aiohttp.ClientSession() as s, s.post(c.router_url + CHAT, json=body) as r:
        raw = await r.read()
        if r.status != 200:
            return r.status, orjson.loads(raw)
        return 200, sse_text(raw) if stream else orjson.loads(raw)


async def assert_quiet(c: SimCluster) -> None:
    for _ in range(100):
        if (
            sum((await c.reserved_blocks()).values()) == 0
            and sum((await c.stranded()).values()) == 0
        ):
            break
        await asyncio.sleep(0.05)
    assert set((await c.reserved_blocks()).values()) == {0}
    assert set((await c.stranded()).values()) == {0}
    assert c.parts.leases.live == {}


def body_for(i: int, max_tokens: int = 40) -> dict[str, Any]:
    return {
        "model": MODEL,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "messages": [{"role": "user", "content": f"fault case {i}: tell me a long story"}],
    }


def check_exact(status: int, result: Any, body: dict[str, Any], stream: bool) -> None:
    want, n, _ = expected_answer(CHAT, body)
    assert status == 200, result
    if stream:
        text, pieces, errors = result
        assert errors == []
        assert text == want and len(pieces) == n  # no token lost, repeated or reordered
    else:
        assert result["choices"][0]["message"]["content"] == want


# Faults on the only prefill (or decode) worker that fire once: the retry lands on the same
# worker (nowhere else to go) after the fault is spent. `side` is where the fault is set.
RETRIED = [
    ("prefill", {"prefill_fail": True}),
    ("prefill", {"prefill_die_after_kv": True}),
    ("prefill", {"error_rate": 1.0, "error_status": 503}),
    ("prefill", {"error_rate": 1.0, "error_status": 429}),
    ("prefill", {"error_rate": 1.0, "error_status": "malformed"}),
    ("prefill", {"hang": True}),
    ("decode", {"decode_fail_before_first": True}),
    ("decode", {"error_rate": 1.0, "error_status": 500}),
    # A 200 whose first SSE event does not parse (or, whole, a body that does not): nothing
    # has reached the client, so it is retried, never forwarded (found by the soak).
    ("decode", {"error_rate": 1.0, "error_status": "malformed"}),
    ("decode", {"hang": True}),
]


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
@pytest.mark.parametrize(
    ("side", "fault"), RETRIED, ids=[f"{s}-{'-'.join(map(str, f.values()))}" for s, f in RETRIED]
)
async def test_leg_failure_is_retried_to_an_exact_answer(
    redis_prefix: str, side: str, fault: dict[str, Any], stream: bool
) -> None:
    async with sim_cluster(
        redis_prefix=redis_prefix, retry=FAST_RETRY, timeouts={"prefill_s": 1.0, "idle_s": 1.0}
    ) as c:
        await set_faults(c, "p0" if side == "prefill" else "d0", count=1, **fault)
        body = body_for(1)
        status, result = await call(c, body, stream)
        check_exact(status, result, body, stream)
        assert c.parts.metrics.retries.labels(side=side)._value.get() == 1
        await assert_quiet(c)


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
async def test_decode_dies_mid_stream(redis_prefix: str, stream: bool) -> None:
    """Streaming: resumed on the other decode worker, the client sees every token once.
    Whole answers: nothing was sent yet, so the request is simply retried."""
    async with sim_cluster(redis_prefix=redis_prefix, decode=2, retry=FAST_RETRY) as c:
        for wid in ("d0", "d1"):
            await set_faults(c, wid, decode_die_after_tokens=7, count=1)
        body = body_for(2, max_tokens=30)
        status, result = await call(c, body, stream)
        check_exact(status, result, body, stream)
        if stream:
            assert c.parts.metrics.resumes._value.get() >= 1
            # The resumed leg carried the answer so far and said how many tokens it holds.
            decode_bodies = [r for wid in ("d0", "d1") for r in await c.worker_requests(wid)]
            resumed = [r for r in decode_bodies if r["body"].get("continue_final_message")]
            assert resumed and resumed[0]["body"]["messages"][-1]["role"] == "assistant"
        await assert_quiet(c)


async def test_a_stream_cut_after_its_last_token_ends_as_a_finished_answer(
    redis_prefix: str,
) -> None:
    """The decode worker sent every token max_tokens allows, then its connection dropped before
    the stream's end (a preemption can cut there too: under load vLLM sends many tokens a chunk,
    and tests/real_vllm/test_preemption.py once met it so, which ended in an error frame).
    The client gets the finished answer's end (finish_reason length, the usage it asked for,
    [DONE]) on the stream it has, never an error frame, and nothing is asked again."""
    content = "a story that fills its whole cap"
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 12,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    async with sim_cluster(redis_prefix=redis_prefix, decode=2, retry=FAST_RETRY) as c:
        whole = {k: v for k, v in body.items() if k != "stream_options"}
        status, want = await call(c, whole, False)
        assert status == 200
        for wid in ("d0", "d1"):
            await set_faults(c, wid, decode_die_after_last_token=True, count=1)
        async with aiohttp.ClientSession() as s:
            async with s.post(c.router_url + "/v1/chat/completions", json=body) as resp:
                assert resp.status == 200
                raw = await resp.read()
        events = [e[6:] for e in raw.decode().split("\n\n") if e.startswith("data: ")]
        assert events[-1] == "[DONE]"
        chunks = [orjson.loads(e) for e in events[:-1]]
        assert not any("error" in ch for ch in chunks), chunks[-3:]
        text = "".join(
            ch["choices"][0]["delta"].get("content") or "" for ch in chunks if ch["choices"]
        )
        assert text == want["choices"][0]["message"]["content"]
        reasons = [ch["choices"][0].get("finish_reason") for ch in chunks if ch["choices"]]
        assert reasons[-1] == "length"
        assert len({ch["id"] for ch in chunks}) == 1
        usage = chunks[-1]["usage"]
        assert usage["completion_tokens"] == 12
        # The prompt as a vLLM worker's /tokenize counts it (exact on vLLM); the sim's /tokenize
        # counts the messages' text only roughly, so here it is only a count of that prompt.
        assert usage["prompt_tokens"] > 0
        assert usage["total_tokens"] == usage["prompt_tokens"] + 12
        assert c.parts.metrics.resumes._value.get() == 0  # nothing was asked again
        await assert_quiet(c)


def decode_errors(c: SimCluster, kind: str) -> float:
    return c.parts.metrics.upstream_errors.labels(side="decode", kind=kind)._value.get()


async def test_error_event_before_any_token_is_retried(redis_prefix: str) -> None:
    """vLLM answers 200 and reports a failed KV pull as an SSE error event: retried, not
    forwarded, so the client gets the whole answer and never sees the failure."""
    async with sim_cluster(redis_prefix=redis_prefix, retry=FAST_RETRY) as c:
        await set_faults(c, "d0", decode_error_event_after_tokens=0, count=1)
        body = body_for(7)
        status, result = await call(c, body, True)
        check_exact(status, result, body, True)
        assert c.parts.metrics.retries.labels(side="decode")._value.get() == 1
        assert decode_errors(c, "error_event") == 1
        await assert_quiet(c)


async def test_error_event_mid_stream_is_resumed(redis_prefix: str) -> None:
    async with sim_cluster(redis_prefix=redis_prefix, decode=2, retry=FAST_RETRY) as c:
        for wid in ("d0", "d1"):
            await set_faults(c, wid, decode_error_event_after_tokens=6, count=1)
        body = body_for(8, max_tokens=30)
        status, result = await call(c, body, True)
        check_exact(status, result, body, True)  # the 6 tokens before the error, once each
        assert c.parts.metrics.resumes._value.get() >= 1
        assert decode_errors(c, "error_event") >= 1
        await assert_quiet(c)


async def test_decode_that_never_takes_the_kv_is_retried(redis_prefix: str) -> None:
    """Headers, then silence (vLLM waiting on a KV pull that will never finish): once the KV
    lease is over the attempt is given up and retried with a fresh prefill, long before the
    TTFT deadline."""
    async with sim_cluster(
        redis_prefix=redis_prefix, retry=FAST_RETRY, leases={"kv_s": 0.5}, timeouts={"ttft_s": 60}
    ) as c:
        await set_faults(c, "d0", decode_stall_after_headers=True, count=1)
        body = body_for(9)
        status, result = await call(c, body, True)
        check_exact(status, result, body, True)
        assert decode_errors(c, "kv_handoff_timeout") == 1
        assert len(await c.worker_requests("p0")) == 2  # the KV was built again
        await assert_quiet(c)


async def test_slow_worker_still_answers_exactly(redis_prefix: str) -> None:
    async with sim_cluster(redis_prefix=redis_prefix) as c:
        await set_faults(c, "d0", slow_factor=5.0)
        body = body_for(3, 10)
        status, result = await call(c, body, True)
        check_exact(status, result, body, True)
        await assert_quiet(c)


async def test_worker_4xx_passes_through_without_retry(redis_prefix: str) -> None:
    # The simulated decode worker refuses a prompt + max_tokens beyond its max_model_len with
    # vLLM's 400; the router (configured with a larger limit) must pass that verdict through.
    async with sim_cluster(
        redis_prefix=redis_prefix,
        max_model_len=100_000,
        worker_overrides={"d0": {"max_model_len": 512}, "p0": {"max_model_len": 100_000}},
    ) as c:
        body = body_for(4, max_tokens=2000)
        status, result = await call(c, body, False)
        assert status == 400 and result["error"]["message"]
        assert c.parts.metrics.retries.labels(side="decode")._value.get() == 0
        await assert_quiet(c)


async def test_retries_stay_within_the_budget_when_every_prefill_fails(redis_prefix: str) -> None:
    n = 40
    retry = {**FAST_RETRY, "budget_ratio": 0.2, "budget_min_per_s": 0.5, "budget_window_s": 10}
    async with sim_cluster(redis_prefix=redis_prefix, prefill=2, retry=retry) as c:
        for wid in ("p0", "p1"):
            await set_faults(c, wid, prefill_fail=True)
        results = await asyncio.gather(*(call(c, body_for(i, 5), i % 2 == 0) for i in range(n)))
        for status, result in results:
            assert status == 503, result
            assert set(result["error"]) == {"message", "type", "param", "code"}
        sent = len(await c.worker_requests("p0")) + len(await c.worker_requests("p1"))
        # First attempts plus at most ratio * requests + min_per_s * window retries.
        assert n <= sent <= n + int(0.2 * n + 0.5 * 10)
        assert c.parts.metrics.retry_budget_exhausted._value.get() > 0
        await assert_quiet(c)


async def test_total_deadline_mid_stream_ends_with_an_error_frame(redis_prefix: str) -> None:
    async with sim_cluster(
        redis_prefix=redis_prefix, time_scale=5.0, timeouts={"total_s": 1.0}
    ) as c:
        status, (text, pieces, errors) = await call(c, body_for(5, 2000), True)
        assert status == 200 and pieces  # some tokens arrived, then the deadline hit
        assert len(errors) == 1 and errors[0]["type"] == "timeout"
        await assert_quiet(c)


async def test_client_gone_during_prefill_releases_everything(redis_prefix: str) -> None:
    async with sim_cluster(redis_prefix=redis_prefix) as c:
        await set_faults(c, "p0", hang=True)
        async with aiohttp.ClientSession() as s:
            with pytest.raises(asyncio.TimeoutError):
                async with asyncio.timeout(0.5):
                    async with s.post(c.router_url + CHAT, json={**body_for(6), "stream": True}):
                        pass
        await assert_quiet(c)
        for _ in range(100):  # the router closed the prefill leg: the worker sees it go
            state = await c.worker_state("p0")
            if state["inflight_requests"] == 0:
                break
            await asyncio.sleep(0.05)
        assert state["inflight_requests"] == 0 and state["waiting_prefills"] == 0, state
        assert c.parts.admission.inflight == 0


async def test_expired_kv_handle_is_re_prefilled(redis_prefix: str) -> None:
    """The KV lease ran out on the prefill worker before the decode pulled it: the decode's 400
    about kv_transfer_params is the router's problem, not the client's — re-prefill and retry."""
    async with sim_cluster(
        redis_prefix=redis_prefix, retry=FAST_RETRY, worker_overrides={"p0": {"kv_lease_s": 1e-6}}
    ) as c:
        body = body_for(7, 8)
        status, result = await call(c, body, True)
        # Every attempt's KV expires at once, so the request runs out of attempts cleanly.
        assert status == 503 and "KV handle" in result["error"]["message"], result
        assert c.parts.metrics.retries.labels(side="decode")._value.get() == 2
        await assert_quiet(c)


@pytest.mark.parametrize("assembled", [True, False], ids=["assembled", "whole"])
async def test_long_non_streamed_answer(redis_prefix: str, assembled: bool) -> None:
    """A non-streamed answer that takes longer than the idle timeout and the KV lease (the
    `whole` case is the proof: answered whole, `assemble_non_streaming: false`, the same answer
    is one silence longer than the idle timeout). Streamed from the decode worker and assembled
    (the default), the first token clears the stranded KV and every token resets the idle
    timer: an exact answer, nothing expired, nothing retried."""
    async with sim_cluster(
        redis_prefix=redis_prefix,
        retry={**FAST_RETRY, "max_attempts": 1},
        leases={"kv_s": 1.0},
        upstream={"assemble_non_streaming": assembled},
        timeouts={"idle_s": 1.0},
    ) as c:
        await set_faults(c, "d0", slow_factor=1500.0)  # ~20 ms a token at time scale 500
        body = body_for(10, max_tokens=150)
        status, result = await call(c, body, False)
        decode_bodies = [r["body"] for r in await c.worker_requests("d0")]
        assert [b.get("stream") for b in decode_bodies] == [assembled]
        if assembled:
            check_exact(status, result, body, False)
            assert result["object"] == "chat.completion"
            assert result["usage"]["completion_tokens"] == 150
            expired = c.parts.metrics.stranded_expired.collect()[0].samples
            assert sum(x.value for x in expired if x.name.endswith("_total")) == 0
            assert c.parts.metrics.retries.labels(side="decode")._value.get() == 0
        else:
            assert status in (502, 503), result
        await assert_quiet(c)


def test_garbage_faults_fire_on_their_leg_and_endpoint_only() -> None:
    """disagg_tools/sim/faults.py's garbage: a shape of GARBAGE_SHAPES, on the legs and endpoint
    named,
    `count` times; a shape with no meaning on a leg (a decode has no KV handle) never fires."""
    from disagg_tools.sim.faults import FaultConfig, FaultState

    for bad in ({"garbage": "nope"}, {"garbage_leg": "both"}, {"hang_after_tokens": -1}):
        with pytest.raises(ValueError):
            FaultConfig.from_mapping(bad)
    state = FaultState(FaultConfig(garbage="wrong_shape", garbage_leg="decode", garbage_path=CHAT))
    assert state.garbage_for("prefill", CHAT) is None
    assert state.garbage_for("decode", "/v1/completions") is None
    assert state.garbage_for("decode", CHAT) == "wrong_shape"
    state = FaultState(FaultConfig(garbage="no_kv_params", count=1))
    assert state.garbage_for("decode", CHAT) is None
    assert state.garbage_for("prefill", CHAT) == "no_kv_params"
    assert state.garbage_for("prefill", CHAT) is None  # its one time is spent
    assert FaultState(FaultConfig(hang_after_tokens=2, count=1)).hang_after() == 2
