"""The simulated GPU worker over real sockets: the NIXL pull flow, capacity, aborts, faults."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web

from disagg_tools.sim.faults import FaultConfig
from disagg_tools.sim.textgen import expected_answer
from disagg_tools.sim.worker import (
    WorkerConfig,
    add_worker_arguments,
    config_from_args,
    create_worker_app,
    running_worker,
)

CHAT = "/v1/chat/completions"
COMPL = "/v1/completions"
FAST = 1000.0


def cfg(role: str = "both", **kw: Any) -> WorkerConfig:
    kw.setdefault("time_scale", FAST)
    kw.setdefault("mean_output_tokens", 16)
    # The KV lease is in simulated seconds: keep vLLM's 30 s as 30 s of real time, or a loaded
    # machine sees KV expire between the legs (the lease test sets its own short one).
    kw.setdefault("kv_lease_s", 30.0 * kw["time_scale"])
    return WorkerConfig(role=role, **kw)


def client_body(path: str, stream: bool, **extra: Any) -> dict[str, Any]:
    if path == CHAT:
        body: dict[str, Any] = {
            "model": "llama-3-8b",
            "messages": [
                {"role": "system", "content": "You are terse."},
                {"role": "user", "content": [{"type": "text", "text": "Explain KV caches."}]},
            ],
            "max_completion_tokens": 40,
        }
    else:
        body = {"model": "llama-3-8b", "prompt": "Once upon a time " * 5, "max_tokens": 40}
    body["stream"] = stream
    body.update(extra)
    return body


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The router's first leg (docs/design.md §3)."""
    out = {k: v for k, v in body.items() if k not in ("stream_options", "min_tokens")}
    out.update(stream=False, max_tokens=1)
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    out["kv_transfer_params"] = {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    }
    return out


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as s:
        yield s


async def read_sse(resp: aiohttp.ClientResponse) -> list[Any]:
    events: list[Any] = []
    async for line in resp.content:
        text = line.decode().strip()
        if text.startswith("data: "):
            payload = text[len("data: ") :]
            events.append(payload if payload == "[DONE]" else orjson.loads(payload))
    return events


def answer_of(path: str, events: list[Any]) -> tuple[str, str | None, list[str]]:
    """(text, finish_reason, per-chunk texts) of a streamed answer."""
    pieces, finish = [], None
    for ev in events:
        if ev == "[DONE]" or not ev["choices"]:
            continue
        choice = ev["choices"][0]
        piece = choice["delta"].get("content", "") if path == CHAT else choice["text"]
        if piece:
            pieces.append(piece)
        finish = choice["finish_reason"] or finish
    return "".join(pieces), finish, pieces


async def post(
    session: aiohttp.ClientSession, url: str, body: Any, headers: dict[str, str] | None = None
) -> tuple[int, Any]:
    async with session.post(url, json=body, headers=headers) as resp:
        raw = await resp.read()
        return resp.status, orjson.loads(raw) if raw else None


async def state(session: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    async with session.get(url + "/sim/state") as resp:
        return await resp.json()


async def metrics(session: aiohttp.ClientSession, url: str) -> str:
    async with session.get(url + "/metrics") as resp:
        return await resp.text()


async def eventually(check: Callable[[], Awaitable[bool]], tries: int = 300) -> None:
    """Wait (bounded) for a condition that follows an asynchronous event, e.g. a disconnect."""
    for _ in range(tries):
        if await check():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition never became true")


async def idle(session: aiohttp.ClientSession, url: str) -> bool:
    st = await state(session, url)
    return st["blocks_in_use"] == 0 and st["resident_sequences"] == 0 and not st["pending_kv"]


def assert_error_body(body: Any, status: int) -> None:
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["code"] == status and body["error"]["message"]


@contextlib.asynccontextmanager
async def pd_pair(**kw: Any) -> AsyncIterator[tuple[str, str]]:
    async with running_worker(cfg("prefill", **kw)) as p, running_worker(cfg("decode", **kw)) as d:
        yield p, d


# --- the three-call NIXL flow ------------------------------------------------------------------


@pytest.mark.parametrize("path", [CHAT, COMPL])
@pytest.mark.parametrize("stream", [True, False])
async def test_nixl_pull_flow_streams_the_expected_answer(
    session: aiohttp.ClientSession, path: str, stream: bool
) -> None:
    body = client_body(path, stream, stream_options={"include_usage": True} if stream else None)
    headers = {"X-Request-Id": f"req-{path[-5:]}-{stream}"}
    want_text, want_n, want_finish = expected_answer(path, body, headers, mean_tokens=16)
    async with pd_pair() as (p, d):
        status, first = await post(session, p + path, prefill_body(body), headers)
        assert status == 200
        params = first["kv_transfer_params"]
        p_state = await state(session, p)
        assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
        assert params["remote_engine_id"] == p_state["engine_id"]
        assert params["remote_request_id"] == headers["X-Request-Id"]
        assert params["remote_host"] == "127.0.0.1"
        assert params["remote_port"] == int(p.rsplit(":", 1)[1])
        assert params["tp_size"] == 1
        n_blocks = -(-first["usage"]["prompt_tokens"] // 16)
        assert len(params["remote_block_ids"]) == n_blocks == p_state["blocks_in_use"]
        assert [e["request_id"] for e in p_state["pending_kv"]] == [headers["X-Request-Id"]]
        choice = first["choices"][0]
        first_text = choice["message"]["content"] if path == CHAT else choice["text"]
        assert first_text.count(" ") == 1 and want_text.startswith(first_text)
        assert first["usage"]["completion_tokens"] == 1

        async with session.post(
            d + path, json={**body, "kv_transfer_params": params}, headers=headers
        ) as resp:
            assert resp.status == 200
            if stream:
                assert resp.headers["Content-Type"].startswith("text/event-stream")
                events = await read_sse(resp)
                text, finish, pieces = answer_of(path, events)
                assert len(pieces) == want_n  # one token per chunk
                assert events[-1] == "[DONE]"
                usage = events[-2]
                assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == want_n
                if path == CHAT:
                    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
                    assert events[-3]["choices"][0]["delta"] == {}
                    assert events[1]["object"] == "chat.completion.chunk"
                    assert events[1]["id"] == f"chatcmpl-{headers['X-Request-Id']}"
                else:
                    assert events[0]["object"] == "text_completion"
            else:
                full = await resp.json()
                choice = full["choices"][0]
                text = choice["message"]["content"] if path == CHAT else choice["text"]
                finish = choice["finish_reason"]
                assert full["usage"]["completion_tokens"] == want_n
        assert (text, finish) == (want_text, want_finish)
        assert await idle(session, p) and await idle(session, d)
        m = await metrics(session, d)
        prompt = first["usage"]["prompt_tokens"]
        assert (
            'vllm:prompt_tokens_by_source_total{model_name="llama-3-8b",'
            f'source="external_kv_transfer"}} {prompt}.0'
        ) in m
        assert "sim:kv_pulled_total" in m


async def test_local_prefill_then_decode(session: aiohttp.ClientSession) -> None:
    for role in ("both", "decode"):
        async with running_worker(cfg(role)) as url:
            body = client_body(COMPL, True, max_tokens=500)
            async with session.post(url + COMPL, json=body) as resp:
                text, finish, _ = answer_of(COMPL, await read_sse(resp))
            assert (text, finish) == expected_answer(COMPL, body, mean_tokens=16)[::2]
            assert 'source="local_compute"} ' in await metrics(session, url)
            assert await idle(session, url)


async def test_roles_refuse_the_other_side_s_work(session: aiohttp.ClientSession) -> None:
    body = client_body(COMPL, False)
    async with pd_pair() as (p, d):
        status, err = await post(session, p + COMPL, body)
        assert status == 400
        assert_error_body(err, 400)
        status, err = await post(session, d + COMPL, prefill_body(body))
        assert status == 400
        assert_error_body(err, 400)


async def test_concurrent_requests_batch_and_all_arrive_exactly(
    session: aiohttp.ClientSession,
) -> None:
    async with running_worker(cfg(time_scale=100.0)) as url:

        async def one(i: int) -> tuple[str, str | None]:
            body = {"prompt": f"request {i} says hello", "max_tokens": 30, "stream": True}
            async with session.post(url + COMPL, json=body) as resp:
                text, finish, _ = answer_of(COMPL, await read_sse(resp))
            assert (text, finish) == expected_answer(COMPL, body, mean_tokens=16)[::2]
            return text, finish

        await asyncio.gather(*(one(i) for i in range(8)))
        assert await idle(session, url)


async def test_resume_after_a_dropped_stream_continues_exactly(
    session: aiohttp.ClientSession,
) -> None:
    """The replay header fixes the natural length; a resume sends prompt + tokens so far."""
    original = {"prompt": "tell me about disaggregation", "max_tokens": 100, "stream": True}
    headers = {"X-Sim-Output-Tokens": "20"}
    want, n, finish = expected_answer(COMPL, original, headers)
    assert (n, finish) == (20, "stop")
    async with running_worker(cfg()) as url:
        await post(session, url + "/sim/faults", {"decode_die_after_tokens": 8, "count": 1})
        got: list[str] = []
        with pytest.raises(aiohttp.ClientPayloadError):
            async with session.post(url + COMPL, json=original, headers=headers) as resp:
                async for line in resp.content:
                    if line.startswith(b"data: {"):
                        got.append(orjson.loads(line[6:])["choices"][0]["text"])
        assert len(got) == 8
        resumed = {**original, "prompt": original["prompt"] + "".join(got), "max_tokens": 92}
        resume_headers = {**headers, "X-Resumed-Output-Tokens": "8"}
        async with session.post(url + COMPL, json=resumed, headers=resume_headers) as resp:
            rest, rest_finish, pieces = answer_of(COMPL, await read_sse(resp))
        assert "".join(got) + rest == want and rest_finish == "stop" and len(pieces) == 12
        await eventually(lambda: idle(session, url))


# --- handoff mistakes and capacity -------------------------------------------------------------


async def test_crossed_kv_params_are_refused_loudly(session: aiohttp.ClientSession) -> None:
    body_a = client_body(CHAT, False)
    body_b = {**client_body(CHAT, False), "messages": [{"role": "user", "content": "other"}]}
    async with pd_pair() as (p, d):
        _, first_a = await post(session, p + CHAT, prefill_body(body_a), {"X-Request-Id": "a"})
        _, first_b = await post(session, p + CHAT, prefill_body(body_b), {"X-Request-Id": "b"})
        crossed = {**body_a, "kv_transfer_params": first_b["kv_transfer_params"]}
        status, err = await post(session, d + CHAT, crossed, {"X-Request-Id": "a"})
        assert status == 400
        assert_error_body(err, 400)
        assert "prompt_state" in err["error"]["message"]
        assert 'sim:kv_params_mismatch_total{model_name="llama-3-8b"} 1.0' in await metrics(
            session, d
        )
        assert (await state(session, d))["blocks_in_use"] == 0
        # The wrongly named entry is not consumed: its rightful decode still gets it.
        assert len((await state(session, p))["pending_kv"]) == 2
        for body, first in ((body_a, first_a), (body_b, first_b)):
            ok = {**body, "kv_transfer_params": first["kv_transfer_params"]}
            status, full = await post(session, d + CHAT, ok)
            assert status == 200
            assert (
                full["choices"][0]["message"]["content"]
                == expected_answer(CHAT, body, mean_tokens=16)[0]
            )
        assert await idle(session, p)
        # A second pull of the same KV finds nothing.
        again = {**body_a, "kv_transfer_params": first_a["kv_transfer_params"]}
        status, err = await post(session, d + CHAT, again)
        assert status == 400 and "not held" in err["error"]["message"]
        # Another engine's id is a mismatch too.
        _, first_c = await post(session, p + CHAT, prefill_body(body_a))
        wrong = {**first_c["kv_transfer_params"], "remote_engine_id": "not-this-engine"}
        status, err = await post(session, d + CHAT, {**body_a, "kv_transfer_params": wrong})
        assert status == 400 and "engine_id" in err["error"]["message"]


async def test_unreachable_prefill_is_a_500_not_a_hang(session: aiohttp.ClientSession) -> None:
    async with pd_pair() as (p, d):
        _, first = await post(session, p + COMPL, prefill_body(client_body(COMPL, False)))
    params = first["kv_transfer_params"]  # P is gone now
    async with running_worker(cfg("decode")) as d2:
        status, err = await post(
            session, d2 + COMPL, {**client_body(COMPL, True), "kv_transfer_params": params}
        )
        assert status == 500
        assert_error_body(err, 500)
        assert await idle(session, d2)


async def test_capacity_refusal_is_a_503(session: aiohttp.ClientSession) -> None:
    async with running_worker(cfg(kv_blocks=4)) as url:
        body = {"prompt": "x" * (4 * 64), "max_tokens": 4}  # 64 tokens: needs 5 blocks with +1
        status, err = await post(session, url + COMPL, body)
        assert status == 503
        assert_error_body(err, 503)
        assert "cannot hold" in err["error"]["message"]
        status, _ = await post(session, url + COMPL, {"prompt": "x" * 200, "max_tokens": 4})
        assert status == 200
        assert "sim:capacity_refusals_total" in await metrics(session, url)


async def test_full_cache_preempts_and_still_answers_exactly(
    session: aiohttp.ClientSession,
) -> None:
    async with running_worker(cfg(kv_blocks=4)) as url:
        bodies = [
            {"prompt": f"p{i} " * 5, "max_tokens": 40, "ignore_eos": True, "stream": True}
            for i in range(3)
        ]

        async def one(body: dict[str, Any]) -> None:
            async with session.post(url + COMPL, json=body) as resp:
                assert resp.status == 200
                text, finish, _ = answer_of(COMPL, await read_sse(resp))
            assert (text, finish) == expected_answer(COMPL, body)[::2]

        await asyncio.gather(*(one(b) for b in bodies))
        m = await metrics(session, url)
        preemptions = [ln for ln in m.splitlines() if ln.startswith("vllm:num_preemptions_total")]
        assert float(preemptions[0].rsplit(" ", 1)[1]) >= 1
        assert await idle(session, url)


async def test_kv_lease_expiry_frees_stranded_blocks(session: aiohttp.ClientSession) -> None:
    async with pd_pair(kv_lease_s=5.0) as (p, d):  # 5 ms of real time at 1000x
        _, first = await post(session, p + COMPL, prefill_body(client_body(COMPL, False)))
        await eventually(lambda: idle(session, p))
        st = await state(session, p)
        assert st["counters"]["kv_expired"] == 1
        assert 'sim:kv_expired_total{model_name="llama-3-8b"} 1.0' in await metrics(session, p)
        late = {**client_body(COMPL, False), "kv_transfer_params": first["kv_transfer_params"]}
        status, err = await post(session, d + COMPL, late)
        assert status == 400 and "expired" in err["error"]["message"]


# --- aborts ------------------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def bare_runner(config: WorkerConfig) -> AsyncIterator[str]:
    """A runner without handler_cancellation, as another team's harness might build it."""
    runner = web.AppRunner(create_worker_app(config), shutdown_timeout=1.0)
    await runner.setup()
    try:
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        host, port = runner.addresses[0][:2]
        yield f"http://{host}:{port}"
    finally:
        await runner.cleanup()


@pytest.mark.parametrize("serve", [running_worker, bare_runner])
async def test_client_disconnect_mid_stream_frees_the_sequence(
    session: aiohttp.ClientSession, serve: Any
) -> None:
    async with serve(cfg(time_scale=10.0)) as url:
        body = {"prompt": "long answer please", "max_tokens": 100_000, "ignore_eos": True}
        resp = await session.post(url + COMPL, json={**body, "stream": True})
        chunks = 0
        async for line in resp.content:
            chunks += line.startswith(b"data: {")
            if chunks == 3:
                break
        st = await state(session, url)
        assert st["resident_sequences"] == 1 and st["blocks_in_use"] >= 1
        resp.close()  # drops the connection: vLLM's abort signal
        await eventually(lambda: idle(session, url))
        assert (await state(session, url))["counters"]["aborted"] == 1


@pytest.mark.parametrize("serve", [running_worker, bare_runner])
async def test_client_gone_while_queued_or_non_streaming_frees_everything(
    session: aiohttp.ClientSession, serve: Any
) -> None:
    async with serve(cfg(time_scale=10.0)) as url:
        body = {"prompt": "no stream", "max_tokens": 100_000, "ignore_eos": True}
        task = asyncio.create_task(post(session, url + COMPL, body))

        async def resident() -> bool:
            return (await state(session, url))["resident_sequences"] == 1

        await eventually(resident)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await eventually(lambda: idle(session, url))


# --- faults ------------------------------------------------------------------------------------


async def set_faults(session: aiohttp.ClientSession, url: str, **faults: Any) -> None:
    status, _ = await post(session, url + "/sim/faults", faults)
    assert status == 200


async def test_prefill_fail_exactly_once(session: aiohttp.ClientSession) -> None:
    async with running_worker(cfg("prefill", faults=FaultConfig(prefill_fail=True, count=1))) as p:
        body = prefill_body(client_body(COMPL, False))
        status, err = await post(session, p + COMPL, body)
        assert status == 500
        assert_error_body(err, 500)
        assert (await state(session, p))["blocks_in_use"] == 0
        status, _ = await post(session, p + COMPL, body)
        assert status == 200


async def test_prefill_dies_after_kv_leaving_it_stranded(session: aiohttp.ClientSession) -> None:
    async with running_worker(cfg("prefill")) as p:
        await set_faults(session, p, prefill_die_after_kv=True, count=1)
        with pytest.raises(aiohttp.ClientConnectionError):
            await post(session, p + COMPL, prefill_body(client_body(COMPL, False)))
        st = await state(session, p)
        assert len(st["pending_kv"]) == 1 and st["blocks_in_use"] > 0
        assert st["faults"]["remaining"]["prefill_die_after_kv"] == 0


async def test_decode_fail_before_first_token(session: aiohttp.ClientSession) -> None:
    async with running_worker(cfg()) as url:
        await set_faults(session, url, decode_fail_before_first=True, count=1)
        status, err = await post(session, url + CHAT, client_body(CHAT, True))
        assert status == 500
        assert_error_body(err, 500)
        assert await idle(session, url)
        status, _ = await post(session, url + CHAT, client_body(CHAT, False))
        assert status == 200


@pytest.mark.parametrize("stream", [True, False])
async def test_decode_dies_after_n_tokens(session: aiohttp.ClientSession, stream: bool) -> None:
    async with running_worker(cfg()) as url:
        await set_faults(session, url, decode_die_after_tokens=3)
        body = client_body(CHAT, stream, ignore_eos=True)
        pieces: list[str] = []
        with pytest.raises(aiohttp.ClientError):
            async with session.post(url + CHAT, json=body) as resp:
                async for line in resp.content:
                    if line.startswith(b"data: {"):
                        delta = orjson.loads(line[6:])["choices"][0]["delta"]
                        if delta.get("content"):
                            pieces.append(delta["content"])
                if not stream:
                    await resp.read()
        if stream:
            assert "".join(pieces) == expected_answer(CHAT, {**body, "max_completion_tokens": 3})[0]
        await eventually(lambda: idle(session, url))


async def test_hang_holds_until_the_client_leaves(session: aiohttp.ClientSession) -> None:
    async with running_worker(cfg()) as url:
        await set_faults(session, url, hang=True, count=1)
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(post(session, url + COMPL, client_body(COMPL, True)), 0.2)

        async def nothing_in_flight() -> bool:
            return (await state(session, url))["inflight_requests"] == 0

        await eventually(nothing_in_flight)
        status, _ = await post(session, url + COMPL, client_body(COMPL, False))
        assert status == 200


async def test_slow_factor_applies_to_the_engine(session: aiohttp.ClientSession) -> None:
    async with running_worker(cfg()) as url:
        await set_faults(session, url, slow_factor=1e9)  # a prefill now never finishes
        task = asyncio.create_task(post(session, url + COMPL, client_body(COMPL, False)))

        async def prefilling() -> bool:
            return (await state(session, url))["running_prefills"] == 1

        await eventually(prefilling)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await eventually(lambda: idle(session, url))


@pytest.mark.parametrize("status", [500, 503, 429])
async def test_error_rate_statuses(session: aiohttp.ClientSession, status: int) -> None:
    async with running_worker(cfg()) as url:
        await set_faults(session, url, error_rate=1.0, error_status=status)
        got, err = await post(session, url + COMPL, client_body(COMPL, True))
        assert got == status
        assert_error_body(err, status)


async def test_malformed_and_seeded_error_rate(session: aiohttp.ClientSession) -> None:
    async with running_worker(cfg()) as url:
        await set_faults(session, url, error_rate=1.0, error_status="malformed")
        for stream in (False, True):
            async with session.post(url + COMPL, json=client_body(COMPL, stream)) as resp:
                assert resp.status == 200
                raw = await resp.read()
            with pytest.raises(orjson.JSONDecodeError):
                orjson.loads(raw.removeprefix(b"data: ").split(b"\n\n")[0])

        async def pattern() -> list[int]:
            await set_faults(session, url, error_rate=0.5, error_status=503, seed=42)
            out = []
            for _ in range(12):
                status, _ = await post(session, url + COMPL, client_body(COMPL, False))
                out.append(status)
            return out

        first = await pattern()
        assert set(first) == {200, 503}
        assert await pattern() == first


async def test_fault_config_round_trip_and_validation(session: aiohttp.ClientSession) -> None:
    async with running_worker(cfg()) as url:
        await set_faults(session, url, decode_die_after_tokens=5, count=2)
        async with session.get(url + "/sim/faults") as resp:
            snap = await resp.json()
        assert snap["config"]["decode_die_after_tokens"] == 5
        assert snap["remaining"]["decode_die_after_tokens"] == 2
        for bad in ({"nope": True}, {"error_status": 418}, {"hang": "yes"}, [1]):
            status, err = await post(session, url + "/sim/faults", bad)
            assert status == 400
            assert_error_body(err, 400)


# --- bad input, plain endpoints, hooks ---------------------------------------------------------


async def test_bad_input_is_a_400_never_a_500(session: aiohttp.ClientSession) -> None:
    async with running_worker(cfg()) as url:
        async with session.post(url + COMPL, data=b"{not json") as resp:
            assert resp.status == 400
            assert_error_body(await resp.json(), 400)
        for path, body in [
            (COMPL, [1, 2]),
            (COMPL, {"prompt": 5}),
            (COMPL, {"prompt": "x", "max_tokens": 0}),
            (COMPL, {"prompt": "x", "max_tokens": "ten"}),
            (COMPL, {"prompt": "x", "max_tokens": 200_000}),
            (COMPL, {"prompt": "x", "kv_transfer_params": "yes"}),
            (COMPL, {"prompt": "x", "kv_transfer_params": {"do_remote_prefill": True}}),
            (CHAT, {"messages": "hi"}),
            (CHAT, {"messages": [{"role": "user", "content": 3}]}),
        ]:
            status, err = await post(session, url + path, body)
            assert status == 400, body
            assert_error_body(err, 400)
        status, err = await post(session, url + COMPL, {"model": "gpt-9", "prompt": "x"})
        assert status == 404
        assert_error_body(err, 404)
        assert await idle(session, url)


async def test_plain_endpoints_and_metric_names(session: aiohttp.ClientSession) -> None:
    async with running_worker(cfg(served_model_name="sim-8b", max_model_len=4096)) as url:
        async with session.get(url + "/health") as resp:
            assert resp.status == 200 and await resp.read() == b""
        async with session.get(url + "/v1/models") as resp:
            models = await resp.json()
        assert models["object"] == "list"
        assert models["data"][0]["id"] == "sim-8b" and models["data"][0]["max_model_len"] == 4096
        async with session.get(url + "/version") as resp:
            assert await resp.json() == {"version": "0.0.0-sim"}
        body = {"model": "sim-8b", "prompt": "hi", "max_tokens": 3, "ignore_eos": True}
        assert (await post(session, url + COMPL, body))[0] == 200
        text = await metrics(session, url)
        for name in (
            "vllm:num_requests_running",
            "vllm:num_requests_waiting",
            "vllm:kv_cache_usage_perc",
            "vllm:prompt_tokens_total",
            "vllm:generation_tokens_total",
            "vllm:num_preemptions_total",
            'vllm:prompt_tokens_by_source_total{model_name="sim-8b",source="external_kv_transfer"}',
            'vllm:prompt_tokens_by_source_total{model_name="sim-8b",source="local_compute"}',
            "sim:kv_params_mismatch_total",
        ):
            assert name in text, name
        assert 'vllm:generation_tokens_total{model_name="sim-8b"} 3.0' in text


async def test_recent_requests_hook(session: aiohttp.ClientSession) -> None:
    async with running_worker(cfg()) as url:
        body = client_body(COMPL, False)
        await post(session, url + COMPL, body, {"X-Request-Id": "r1"})
        async with session.get(url + "/sim/requests") as resp:
            recent = await resp.json()
        assert len(recent) == 1
        assert recent[0]["path"] == COMPL and recent[0]["body"] == body
        seen = {k.lower(): v for k, v in recent[0]["headers"].items()}
        assert seen["x-request-id"] == "r1"
        async with session.delete(url + "/sim/requests") as resp:
            assert resp.status == 204
        async with session.get(url + "/sim/requests") as resp:
            assert await resp.json() == []


def test_cli_arguments_build_a_config() -> None:
    parser = argparse.ArgumentParser()
    add_worker_arguments(parser)
    ns = parser.parse_args(
        ["--role", "decode", "--port", "0", "--time-scale", "100", "--kv-blocks", "64",
         "--fault-error-rate", "0.25", "--fault-error-status", "malformed", "--fault-count", "2"]
    )  # fmt: skip
    config = config_from_args(ns)
    assert config.role == "decode" and config.time_scale == 100 and config.kv_blocks == 64
    assert config.faults.error_rate == 0.25 and config.faults.error_status == "malformed"
    assert config.faults.count == 2
    assert len(config.engine_id) == 32
    with pytest.raises(ValueError):
        WorkerConfig(role="gpu")
