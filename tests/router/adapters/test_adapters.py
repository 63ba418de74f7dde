"""Worker adapters, field by field against docs/design.md §3, and the error/SSE helpers.

The SGLang legs are also sent to real simulated workers, both at once, to show that the bodies
the adapter shapes are the ones the protocol's workers act on.
"""

from __future__ import annotations

import asyncio
import random
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web

from disagg_tools.sim.textgen import expected_answer
from disagg_tools.sim.worker import WorkerConfig, running_worker
from router.adapters.base import ConcurrentAdapter, PrefillTarget, ProtocolViolation, prefill_target
from router.adapters.errors import (
    WorkerError,
    is_sse_comment,
    parse_error_body,
    sse_data,
    stream_error,
)
from router.adapters.mooncake import MooncakeAdapter, parse_query, query_engine_ids
from router.adapters.sglang import SglangAdapter, batch_size
from router.adapters.vllm import VllmNixlAdapter
from router.relay.aiohttp_relay import split_at_error

CHAT_BODY: dict[str, Any] = {
    "model": "llama-3-8b",
    "messages": [{"role": "user", "content": [{"type": "text", "text": "hi there"}]}],
    "max_completion_tokens": 7,
    "min_tokens": 2,
    "stream": True,
    "stream_options": {"include_usage": True},
}


# --- vLLM NIXL ------------------------------------------------------------------------------


def test_nixl_prefill_body_field_by_field() -> None:
    body = VllmNixlAdapter().prefill_body(dict(CHAT_BODY))
    assert body == {
        "model": "llama-3-8b",
        "messages": CHAT_BODY["messages"],
        "max_completion_tokens": 1,
        "max_tokens": 1,
        "stream": False,
        "kv_transfer_params": {
            "do_remote_decode": True,
            "do_remote_prefill": False,
            "remote_engine_id": None,
            "remote_block_ids": None,
            "remote_host": None,
            "remote_port": None,
        },
    }


def test_nixl_decode_body_copies_params_verbatim() -> None:
    params = {"do_remote_prefill": True, "remote_engine_id": "e", "future_field": [1, 2]}
    body = VllmNixlAdapter().decode_body(dict(CHAT_BODY), params)
    assert body == {**CHAT_BODY, "kv_transfer_params": params}


# --- SGLang ---------------------------------------------------------------------------------


def test_sglang_legs_field_by_field() -> None:
    adapter = SglangAdapter(random.Random(7))
    expected_room = random.Random(7).getrandbits(63)
    p, d = adapter.legs(dict(CHAT_BODY), PrefillTarget("10.0.0.5", 8998))
    assert (
        p
        == d
        == {
            **CHAT_BODY,
            "bootstrap_host": "10.0.0.5",
            "bootstrap_port": 8998,
            "bootstrap_room": expected_room,
        }
    )
    assert p is not d
    assert isinstance(adapter, ConcurrentAdapter) and adapter.concurrent_legs is True


def test_sglang_room_is_63_bits_and_fresh_per_request() -> None:
    adapter = SglangAdapter(random.Random(1))
    rooms = {
        adapter.legs({"text": "x"}, PrefillTarget("h", None))[0]["bootstrap_room"]
        for _ in range(200)
    }
    assert len(rooms) == 200
    assert all(0 <= r < 2**63 for r in rooms)


def test_sglang_null_bootstrap_port_stays_null() -> None:
    p, _ = SglangAdapter(random.Random(1)).legs({"text": "x"}, PrefillTarget("h", None))
    assert "bootstrap_port" in p and p["bootstrap_port"] is None


@pytest.mark.parametrize(
    ("body", "n"),
    [
        ({"text": ["a", "b", "c"]}, 3),
        ({"input_ids": [[1, 2], [3]]}, 2),
        ({"prompt": ["a", "b"]}, 2),
        ({"prompt": [[1, 2], [3, 4]]}, 2),
        ({"prompt": [1, 2, 3]}, None),  # one prompt of token ids
        ({"prompt": ["only"]}, None),
        ({"text": "one"}, None),
        ({"input_ids": [1, 2]}, None),
        ({"messages": []}, None),
    ],
)
def test_sglang_batch_size(body: dict[str, Any], n: int | None) -> None:
    assert batch_size(body) == n


def test_sglang_batch_gets_arrays() -> None:
    rng = random.Random(3)
    ref = random.Random(3)
    rooms = [ref.getrandbits(63) for _ in range(3)]
    p, d = SglangAdapter(rng).legs({"text": ["a", "b", "c"]}, PrefillTarget("h", 9))
    assert p["bootstrap_host"] == ["h", "h", "h"]
    assert p["bootstrap_port"] == [9, 9, 9]
    assert p["bootstrap_room"] == rooms == d["bootstrap_room"]


def test_prefill_target_from_url() -> None:
    assert prefill_target("http://10.1.2.3:8000", 8998) == PrefillTarget("10.1.2.3", 8998)
    assert prefill_target("http://[::1]:8000/", None).host == "::1"
    with pytest.raises(ValueError):
        prefill_target("not a url", 1)


@pytest.mark.parametrize("path", ["/generate", "/v1/chat/completions", "/v1/completions"])
async def test_sglang_legs_drive_simulated_workers(path: str) -> None:
    """Both legs at once, as the adapter shapes them: the decode stream is the exact answer."""
    common: dict[str, Any] = {"model": "llama-3-8b", "kv_blocks": 512, "time_scale": 500.0}
    p_cfg = WorkerConfig(role="prefill", bootstrap_port=0, **common)
    d_cfg = WorkerConfig(role="decode", **common)
    bodies: dict[str, dict[str, Any]] = {
        "/generate": {"text": "tell me", "sampling_params": {"max_new_tokens": 9}},
        "/v1/chat/completions": {
            "model": "llama-3-8b",
            "max_tokens": 9,
            "messages": [{"role": "user", "content": "tell me"}],
        },
        "/v1/completions": {"model": "llama-3-8b", "prompt": "tell me", "max_tokens": 9},
    }
    client = {**bodies[path], "stream": False}
    async with running_worker(p_cfg) as p_url, running_worker(d_cfg) as d_url:
        async with aiohttp.ClientSession() as s:
            async with s.get(p_url + "/server_info") as r:
                info = await r.json()
            assert info["disaggregation_mode"] == "prefill"
            target = prefill_target(p_url, info["disaggregation_bootstrap_port"])
            p_body, d_body = SglangAdapter(random.Random(5)).legs(client, target)

            async def post(url: str, body: dict[str, Any]) -> tuple[int, Any]:
                async with s.post(url + path, json=body) as r:
                    return r.status, await r.json()

            (p_status, _), (d_status, answer) = await asyncio.gather(
                post(p_url, p_body), post(d_url, d_body)
            )
            assert (p_status, d_status) == (200, 200), answer
            want, n, _ = expected_answer(path, client)
            if path == "/generate":
                assert answer["text"] == want
                assert answer["meta_info"]["completion_tokens"] == n
            elif path == "/v1/chat/completions":
                assert answer["choices"][0]["message"]["content"] == want
            else:
                assert answer["choices"][0]["text"] == want
            async with s.get(d_url + "/sim/state") as r:
                assert (await r.json())["counters"]["kv_pulled"] == 1


async def test_sglang_crossed_rooms_are_refused_and_counted() -> None:
    common: dict[str, Any] = {
        "model": "llama-3-8b",
        "kv_blocks": 512,
        "time_scale": 500.0,
        "kv_lease_s": 50.0,
    }
    async with (
        running_worker(WorkerConfig(role="prefill", bootstrap_port=0, **common)) as p_url,
        running_worker(WorkerConfig(role="decode", **common)) as d_url,
        aiohttp.ClientSession() as s,
    ):
        async with s.get(p_url + "/server_info") as r:
            port = (await r.json())["disaggregation_bootstrap_port"]
        target = prefill_target(p_url, port)
        p_body, d_body = SglangAdapter(random.Random(9)).legs({"text": "one prompt"}, target)
        d_body["text"] = "another prompt"  # same room, different prompt: crossed
        prefill = asyncio.ensure_future(s.post(p_url + "/generate", json=p_body))
        async with s.post(d_url + "/generate", json=d_body) as r:
            assert r.status == 400
            assert "crossed rooms" in (await r.json())["error"]["message"]
        async with s.get(d_url + "/sim/state") as r:
            assert (await r.json())["counters"]["kv_params_mismatch"] == 1
        prefill.cancel()
        with pytest.raises(asyncio.CancelledError):
            await prefill


# --- vLLM Mooncake --------------------------------------------------------------------------


def test_mooncake_legs_field_by_field() -> None:
    target = PrefillTarget("10.0.0.5", None, engine_id="eng-0")
    p, d = MooncakeAdapter().legs(dict(CHAT_BODY), target, "req-1")
    assert p == {
        "model": "llama-3-8b",
        "messages": CHAT_BODY["messages"],
        "max_completion_tokens": 1,
        "max_tokens": 1,
        "stream": False,
        "kv_transfer_params": {
            "do_remote_decode": True,
            "do_remote_prefill": False,
            "transfer_id": "xfer-req-1",
        },
    }
    assert d == {
        **CHAT_BODY,
        "kv_transfer_params": {
            "do_remote_decode": False,
            "do_remote_prefill": True,
            "remote_bootstrap_addr": "http://10.0.0.5:8998",
            "remote_engine_id": "eng-0",
            "transfer_id": "xfer-req-1",
        },
    }


def test_mooncake_needs_engine_id() -> None:
    with pytest.raises(ProtocolViolation):
        MooncakeAdapter().legs({"prompt": "x"}, PrefillTarget("h", 1), "r")


def test_mooncake_parse_query() -> None:
    assert parse_query({"0": {"engine_id": "a"}, "1": {"engine_id": "b"}}) == {0: "a", 1: "b"}
    bad: object
    for bad in ({}, [], {"0": {}}, {"x": {"engine_id": "a"}}):
        with pytest.raises(ProtocolViolation):
            parse_query(bad)


async def test_mooncake_query_engine_ids_over_http() -> None:
    async def query(request: web.Request) -> web.Response:
        return web.json_response({"0": {"engine_id": "engine-abc"}})

    app = web.Application()
    app.router.add_get("/query", query)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    try:
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        port = runner.addresses[0][1]
        async with aiohttp.ClientSession() as s:
            ids = await query_engine_ids(s, PrefillTarget("127.0.0.1", port))
        assert ids == {0: "engine-abc"}
    finally:
        await runner.cleanup()


# --- errors and SSE -------------------------------------------------------------------------


def test_parse_error_current_vllm_shape() -> None:
    raw = orjson.dumps(
        {
            "error": {
                "message": "too long",
                "type": "BadRequestError",
                "param": "max_tokens",
                "code": 400,
            }
        }
    )
    assert parse_error_body(raw, 400) == WorkerError(
        400, "too long", "BadRequestError", "max_tokens"
    )


def test_parse_error_old_flat_shape() -> None:
    raw = orjson.dumps(
        {
            "object": "error",
            "message": "no model",
            "type": "NotFoundError",
            "param": None,
            "code": 404,
        }
    )
    assert parse_error_body(raw) == WorkerError(404, "no model", "NotFoundError", None)


def test_parse_error_other_shapes() -> None:
    assert parse_error_body(b'{"detail": "Not Found"}', 404).message == "Not Found"
    assert parse_error_body(b'{"error": "boom"}', 500).message == "boom"
    assert parse_error_body(b"Internal Server Error", 500).message == "Internal Server Error"
    assert parse_error_body(b"", 502).message == "worker answered 502 with an empty body"


def test_sse_comment_and_data_lines() -> None:
    assert is_sse_comment(b": keep-alive")
    assert is_sse_comment(b":")
    assert not is_sse_comment(b"data: {}")
    assert sse_data(b"data: [DONE]") == b"[DONE]"
    assert sse_data(b"data:{}") == b"{}"
    assert sse_data(b": keep-alive") is None
    assert sse_data(b"event: x") is None


def test_stream_error_frames() -> None:
    err = stream_error(
        b'{"error": {"message": "engine dead", "type": "InternalServerError", "code": 500}}'
    )
    assert err == WorkerError(500, "engine dead", "InternalServerError", None)
    assert stream_error(b'{"choices": [{"text": "error"}]}') is None
    assert stream_error(b"[DONE]") is None
    assert stream_error(b'{"error": ') is None


def test_split_at_error_stops_before_a_server_error_event() -> None:
    good = b'data: {"choices": [{"index": 0, "text": "a"}]}\n\n'
    error = b'data: {"error": {"message": "Internal server error", "type": "x", "code": 500}}\n\n'
    done = b"data: [DONE]\n\n"
    assert split_at_error(good + good) == (good + good, None)
    head, err = split_at_error(good + error + done)
    assert head == good and err is not None and err.message == "Internal server error"
    head, err = split_at_error(error + done)
    assert head == b"" and err is not None and err.status == 500
    # Older vLLM's flat shape, and an error without a code: retryable too.
    head, err = split_at_error(b'data: {"object": "error", "message": "boom"}\n\n')
    assert head == b"" and err is not None and err.message == "boom"
    # A 4xx in the stream is the worker's verdict on the request: passed through, not retried.
    client_error = (
        b'data: {"error": {"message": "bad", "type": "BadRequestError", "code": 400}}\n\n'
    )
    assert split_at_error(client_error + done) == (client_error + done, None)
    # A token whose text is the word "error" (quoted in the text or not) is just a token.
    token = b'data: {"choices": [{"text": "\\"error\\": error"}]}\n\n'
    assert split_at_error(token) == (token, None)
    finish = b'data: {"choices": [{"text": "", "finish_reason": "error"}]}\n\n'
    assert split_at_error(finish) == (finish, None)
