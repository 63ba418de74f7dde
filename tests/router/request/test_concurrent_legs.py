"""SGLang-style PD through our router (both legs at once) and KV-layout pairing.

- the first decode token reaches the client while the prefill leg is still open;
- a failing leg cancels its partner, and the request is retried to an exact answer;
- mixed-version pools are never paired across versions.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web

from disagg_tools.sim.textgen import expected_answer
from disagg_tools.sim.worker import WorkerConfig, running_worker
from router.config import settings_from_mapping
from tests.app_parts import parts
from tests.conftest import MODEL, REDIS_URL, running_router
from tests.router.request.test_faults import sse_text

CHAT = "/v1/chat/completions"


async def _json(url: str) -> Any:
    async with aiohttp.ClientSession() as s, s.get(url) as r:
        return await r.json()


@contextlib.asynccontextmanager
async def held_prefill_proxy(target: str, release: asyncio.Event) -> AsyncIterator[str]:
    """A proxy in front of a prefill worker that holds each answer until `release` is set."""

    async def forward(request: web.Request) -> web.Response:
        body = await request.read()
        headers = {k: v for k, v in request.headers.items() if k.lower() != "host"}
        async with (
            aiohttp.ClientSession() as s,
            s.post(target + request.path, data=body, headers=headers) as r,
        ):
            answer, status = await r.read(), r.status
        await release.wait()
        return web.Response(body=answer, status=status, content_type="application/json")

    async def passthrough(request: web.Request) -> web.Response:
        async with aiohttp.ClientSession() as s, s.get(target + request.path) as r:
            return web.Response(body=await r.read(), status=r.status)

    app = web.Application()
    app.router.add_post("/v1/chat/completions", forward)
    app.router.add_get("/health", passthrough)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        release.set()
        await runner.cleanup()


@contextlib.asynccontextmanager
async def sglang_cluster(
    redis_prefix: str,
    prefill_url_override: Any = None,
    configure_bootstrap: bool = True,
    **settings: Any,
) -> AsyncIterator[tuple[str, web.Application, dict[str, str]]]:
    async with contextlib.AsyncExitStack() as stack:
        p_url = await stack.enter_async_context(
            running_worker(
                WorkerConfig(
                    role="prefill",
                    worker_id="p0",
                    model=MODEL,
                    time_scale=500.0,
                    kv_blocks=4096,
                    bootstrap_port=0,
                    kv_lease_s=30.0 * 500,
                )
            )
        )
        d_url = await stack.enter_async_context(
            running_worker(
                WorkerConfig(
                    role="decode", worker_id="d0", model=MODEL, time_scale=500.0, kv_blocks=4096
                )
            )
        )
        info = await _json(p_url + "/server_info")
        router_p_url = p_url
        if prefill_url_override is not None:
            router_p_url = await stack.enter_async_context(prefill_url_override(p_url))
        raw = {
            "model": MODEL,
            "perf": {"model": MODEL, "gpu": "h100"},
            "store": {"url": REDIS_URL, "key_prefix": redis_prefix},
            "loops": {"health_interval_s": 0.5},
            "workers": [
                {
                    "id": "p0",
                    "url": router_p_url,
                    "role": "prefill",
                    "adapter": "sglang",
                    **(
                        {"bootstrap_port": info["disaggregation_bootstrap_port"]}
                        if configure_bootstrap
                        else {}
                    ),
                },
                {
                    "id": "d0",
                    "url": d_url,
                    "role": "decode",
                    "adapter": "sglang",
                    "kv_blocks": 4096,
                },
            ],
            **settings,
        }
        url, app = await stack.enter_async_context(running_router(settings_from_mapping(raw)))
        yield url, app, {"p0": p_url, "d0": d_url}


async def test_an_unconfigured_bootstrap_port_is_read_from_server_info(redis_prefix: str) -> None:
    """An operator's entry gives the prefill's URL only: the router reads the bootstrap port
    from its `/server_info` before placing anything on it, and the pair works."""
    async with sglang_cluster(redis_prefix, configure_bootstrap=False) as (url, app, workers):
        info = await _json(workers["p0"] + "/server_info")
        spec = parts(app).pools.workers["p0"].spec
        assert spec.bootstrap_port == info["disaggregation_bootstrap_port"] > 0
        assert spec.reads_bootstrap_port
        body = _body("a port nobody wrote down")
        async with aiohttp.ClientSession() as s, s.post(url + CHAT, json=body) as r:
            assert r.status == 200
            text, _, errors = sse_text(await r.read())
        assert not errors and text == expected_answer(CHAT, body)[0]


@pytest.mark.parametrize("stream", [True, False])
async def test_n_above_one_is_refused_in_front_of_sglang(redis_prefix: str, stream: bool) -> None:
    """SGLang's PD pairs hang on n > 1 (the samples share one bootstrap room: seen on real
    SGLang 0.5.23, tests/real_sglang): a clear 400 on `n`, nothing sent, nothing held."""
    async with sglang_cluster(redis_prefix) as (url, app, workers):
        body = {**_body("several choices"), "n": 2, "stream": stream}
        async with aiohttp.ClientSession() as s, s.post(url + CHAT, json=body) as r:
            assert r.status == 400
            error = (await r.json())["error"]
        assert error["param"] == "n" and "bootstrap room" in error["message"]
        gw = parts(app)
        usage = await gw.store.decode_usage(["d0"])
        assert usage["d0"].reserved_blocks == 0
        assert gw.leases.live == {}


def _body(text: str, n: int = 24) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": n,
        "ignore_eos": True,
        "stream": True,
    }


async def test_sglang_legs_go_out_together_and_answer_exactly(redis_prefix: str) -> None:
    async with sglang_cluster(redis_prefix) as (url, app, workers):
        body = _body("rooms and bootstraps")
        async with aiohttp.ClientSession() as s, s.post(url + CHAT, json=body) as r:
            assert r.status == 200
            text, pieces, errors = sse_text(await r.read())
        want, n, _ = expected_answer(CHAT, body)
        assert text == want and len(pieces) == n and not errors
        async with aiohttp.ClientSession() as s:
            (pre,) = await (await s.get(workers["p0"] + "/sim/requests")).json()
            (dec,) = await (await s.get(workers["d0"] + "/sim/requests")).json()
        room = pre["body"]["bootstrap_room"]
        assert isinstance(room, int) and 0 <= room < 2**63
        assert dec["body"]["bootstrap_room"] == room
        assert pre["body"]["bootstrap_host"] == dec["body"]["bootstrap_host"] == "127.0.0.1"
        # The client's body is otherwise unchanged on both legs; no NIXL params.
        for leg in (pre, dec):
            assert leg["body"]["messages"] == body["messages"]
            assert "kv_transfer_params" not in leg["body"]


async def test_first_decode_token_reaches_the_client_while_prefill_is_open(
    redis_prefix: str,
) -> None:
    release = asyncio.Event()
    async with sglang_cluster(
        redis_prefix, prefill_url_override=lambda t: held_prefill_proxy(t, release)
    ) as (url, app, _):
        async with aiohttp.ClientSession() as s, s.post(url + CHAT, json=_body("now")) as r:
            assert r.status == 200
            # The proxy still holds the prefill's answer: a router that waited for it (as
            # SGLang's own does) would deadlock here instead of streaming.
            async with asyncio.timeout(20):
                first = await r.content.readuntil(b"\n\n")
                while b'"content":"' not in first or b'"content":""' in first:
                    first = await r.content.readuntil(b"\n\n")
            assert not release.is_set()
            release.set()
            rest = await r.read()
        text, _, errors = sse_text(first + rest)
        assert text == expected_answer(CHAT, _body("now"))[0] and not errors


async def test_a_failing_leg_cancels_its_partner_and_is_retried(redis_prefix: str) -> None:
    retry = {"backoff_base_s": 0.005, "backoff_max_s": 0.02}
    async with sglang_cluster(redis_prefix, retry=retry, timeouts={"idle_s": 2.0}) as (
        url,
        app,
        workers,
    ):
        # The decode leg fails first: the prefill leg (waiting for its room to be taken) must be
        # cancelled at once, not left to time out.
        async with aiohttp.ClientSession() as s:
            await s.post(
                workers["d0"] + "/sim/faults", json={"decode_fail_before_first": True, "count": 1}
            )
            body = _body("cancel my partner", 12)
            async with s.post(url + CHAT, json=body) as r:
                text, _, errors = sse_text(await r.read())
        assert text == expected_answer(CHAT, body)[0] and not errors
        for _ in range(100):
            state = await _json(workers["p0"] + "/sim/state")
            if state["bootstrap_rooms"] == 0 and state["inflight_requests"] == 0:
                break
            await asyncio.sleep(0.05)
        # The cancelled prefill leg's connection closed: no room, no request, no blocks left.
        assert state["bootstrap_rooms"] == 0 and state["inflight_requests"] == 0, state
        assert state["blocks_in_use"] == 0, state
        gw = parts(app)
        assert (await gw.store.decode_usage(["d0"]))["d0"].reserved_blocks == 0


async def test_mixed_version_pools_are_never_paired_across_versions(redis_prefix: str) -> None:
    v1 = {"engine": "vllm", "engine_version": "0.31.0"}
    v2 = {"engine": "vllm", "engine_version": "0.32.0"}
    async with contextlib.AsyncExitStack() as stack:
        entries, urls = [], {}
        for wid, role, layout in [
            ("p0", "prefill", v1),
            ("p1", "prefill", v2),
            ("d0", "decode", v1),
            ("d1", "decode", v2),
        ]:
            u = await stack.enter_async_context(
                running_worker(
                    WorkerConfig(
                        role=role,
                        worker_id=wid,
                        model=MODEL,
                        time_scale=500.0,
                        kv_blocks=4096,
                        kv_lease_s=30.0 * 500,
                    )
                )
            )
            urls[wid] = u
            entry = {"id": wid, "url": u, "role": role, "adapter": "sim", "layout": layout}
            if role == "decode":
                entry["kv_blocks"] = 4096
            entries.append(entry)
        settings = settings_from_mapping(
            {
                "model": MODEL,
                "perf": {"model": MODEL, "gpu": "h100"},
                "store": {"url": REDIS_URL, "key_prefix": redis_prefix},
                "workers": entries,
                "policy": "random",
            }
        )
        url, app = await stack.enter_async_context(running_router(settings))
        async with aiohttp.ClientSession() as s:

            async def one(i: int) -> None:
                body = {**_body(f"rolling upgrade {i}", 4), "stream": False}
                async with s.post(url + CHAT, json=body, headers={"X-Request-Id": f"mix-{i}"}) as r:
                    assert r.status == 200, await r.text()

            await asyncio.gather(*(one(i) for i in range(24)))
            logs = {wid: await (await s.get(u + "/sim/requests")).json() for wid, u in urls.items()}
        served = {
            wid: {r["headers"].get("X-Request-Id") or r["headers"].get("X-Request-ID") for r in log}
            for wid, log in logs.items()
        }
        assert served["p0"] | served["p1"] == {f"mix-{i}" for i in range(24)}
        assert served["p0"] == served["d0"] and served["p1"] == served["d1"]
        assert served["p0"] and served["p1"]  # both versions did serve (random policy)
        state = orjson.loads(orjson.dumps(await _json(url + "/admin/state")))
        assert {w["layout"].split("|")[1] for w in state["workers"]} == {"0.31.0", "0.32.0"}


async def test_mooncake_prefill_engine_id_is_read_at_start_up(redis_prefix: str) -> None:
    """The router asks a Mooncake prefill's bootstrap server for its engine id, then both legs
    carry the vLLM Mooncake connector's fields."""
    seen: list[dict[str, Any]] = []

    async def query(request: web.Request) -> web.Response:
        return web.json_response({"0": {"engine_id": "engine-7"}})

    async def record(request: web.Request) -> web.Response:
        seen.append(await request.json())
        return web.json_response(
            {"error": {"message": "stub", "type": "x", "param": None, "code": 500}}, status=500
        )

    app_ = web.Application()
    app_.router.add_get("/query", query)
    app_.router.add_post(CHAT, record)

    async def health(request: web.Request) -> web.Response:
        return web.Response()

    app_.router.add_get("/health", health)
    runner = web.AppRunner(app_)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    port = runner.addresses[0][1]
    try:
        stub = f"http://127.0.0.1:{port}"
        settings = settings_from_mapping(
            {
                "model": MODEL,
                "store": {"url": REDIS_URL, "key_prefix": redis_prefix},
                "retry": {"max_attempts": 1},
                "workers": [
                    {
                        "id": "p0",
                        "url": stub,
                        "role": "prefill",
                        "adapter": "mooncake",
                        "bootstrap_port": port,
                    },
                    {
                        "id": "d0",
                        "url": stub,
                        "role": "decode",
                        "adapter": "mooncake",
                        "kv_blocks": 1024,
                    },
                ],
            }
        )
        async with running_router(settings) as (url, app), aiohttp.ClientSession() as s:
            assert parts(app).pools.workers["p0"].spec.engine_id == "engine-7"
            async with s.post(url + CHAT, json={**_body("mooncake"), "stream": False}) as r:
                assert r.status in (502, 503)  # the stub fails both legs; the point is the wire
        prefill = next(b for b in seen if b["kv_transfer_params"].get("do_remote_decode"))
        decode = next(b for b in seen if b["kv_transfer_params"].get("do_remote_prefill"))
        assert prefill["max_tokens"] == 1 and prefill["stream"] is False
        kv = decode["kv_transfer_params"]
        assert kv["remote_engine_id"] == "engine-7"
        assert kv["remote_bootstrap_addr"] == f"http://127.0.0.1:{port}"
        assert kv["transfer_id"] == prefill["kv_transfer_params"]["transfer_id"]
    finally:
        await runner.cleanup()


def test_prefix_hashes_share_exactly_the_shared_prefix() -> None:
    from router.openai.prompt_text import BLOCK_CHARS, prefix_hashes
    from router.workers.prefixes import RecentPrefixes

    common = "x" * (2 * BLOCK_CHARS)
    a = prefix_hashes("/v1/completions", {"prompt": common + "a" * BLOCK_CHARS})
    b = prefix_hashes("/v1/completions", {"prompt": common + "b" * BLOCK_CHARS})
    assert len(a) == len(b) == 3 and a[:2] == b[:2] and a[2] != b[2]
    assert prefix_hashes("/v1/completions", {"prompt": "short"}) == ()
    recent = RecentPrefixes(limit=4)
    recent.add(a)
    recent.add(b)
    assert recent.frozen == {a[1], a[2], b[2]} | {a[0]} and len(recent.frozen) == 4


async def test_prompts_sharing_a_prefix_go_to_the_prefill_worker_that_has_it(
    redis_prefix: str,
) -> None:
    from tests.conftest import sim_cluster

    shared = "system prompt of a long agent session. " * 200  # ~8,000 characters: 3 blocks
    async with sim_cluster(redis_prefix=redis_prefix, prefill=2) as c, aiohttp.ClientSession() as s:
        for i in range(6):
            body = {
                "model": MODEL,
                "max_tokens": 4,
                "messages": [
                    {"role": "system", "content": shared},
                    {"role": "user", "content": f"question {i}"},
                ],
            }
            async with s.post(c.router_url + CHAT, json=body) as r:
                assert r.status == 200
        served = {wid: len(await c.worker_requests(wid)) for wid in ("p0", "p1")}
        assert sorted(served.values()) == [0, 6], served  # affinity, not a spread
