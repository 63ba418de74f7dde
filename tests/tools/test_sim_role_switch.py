"""The simulated worker's `POST /pd_role_switch` (SGLang 0.5.23's runtime role switch), over real
sockets: each refusal with its status, message and safe_to_restore; a flip that then serves the
other leg of SGLang's bootstrap protocol; requests refused while it runs; an injected failed
rebuild that leaves the instance unhealthy."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from disagg_tools.sim.textgen import expected_answer
from disagg_tools.sim.worker import (
    WorkerConfig,
    add_worker_arguments,
    config_from_args,
    running_worker,
)
from tests.ports import free_port

FAST = 1000.0
GEN = "/generate"
SWITCH = "/pd_role_switch"
MEAN = 8


def cfg(role: str, **kw: Any) -> WorkerConfig:
    kw.setdefault("time_scale", FAST)
    kw.setdefault("mean_output_tokens", MEAN)
    kw.setdefault("kv_blocks", 512)
    # Leases in simulated seconds: 30 s of real time, so a loaded machine never expires a room.
    kw.setdefault("kv_lease_s", 30.0 * kw["time_scale"])
    return WorkerConfig(role=role, model="llama-3-8b", **kw)


@contextlib.asynccontextmanager
async def workers(*configs: WorkerConfig) -> AsyncIterator[tuple[aiohttp.ClientSession, list[str]]]:
    async with contextlib.AsyncExitStack() as stack:
        urls = [await stack.enter_async_context(running_worker(c)) for c in configs]
        session = await stack.enter_async_context(aiohttp.ClientSession())
        yield session, urls


async def switch(s: aiohttp.ClientSession, url: str, **body: Any) -> tuple[int, dict[str, Any]]:
    async with s.post(url + SWITCH, json=body) as r:
        return r.status, await r.json()


async def get(s: aiohttp.ClientSession, url: str, path: str) -> Any:
    async with s.get(url + path) as r:
        assert r.status == 200, path
        return await r.json()


def serving(server_info: dict[str, Any]) -> str:
    """The role the scheduler serves now (SGLang's `internal_states`)."""
    mode: str = server_info["internal_states"][0]["disaggregation_mode"]
    return mode


def answer(success: bool, message: str, old: str, new: str, safe: bool) -> dict[str, str | bool]:
    return {
        "success": success,
        "message": message,
        "old_role": old,
        "new_role": new,
        "safe_to_restore": safe,
    }


def pd_bodies(text: str, bootstrap_port: int, room: int) -> dict[str, Any]:
    """SGLang's PD body: the same to both legs (sglang-router sends one body twice)."""
    return {
        "text": text,
        "sampling_params": {"max_new_tokens": 9},
        "bootstrap_host": "127.0.0.1",
        "bootstrap_port": bootstrap_port,
        "bootstrap_room": room,
    }


async def pd_request(
    s: aiohttp.ClientSession, p_url: str, d_url: str, body: dict[str, Any]
) -> dict[str, Any]:
    """Both legs at once; the decode's answer, checked against the text the sim must produce."""

    async def post(url: str) -> tuple[int, Any]:
        async with s.post(url + GEN, json=body) as r:
            return r.status, await r.json()

    (p_status, p_ans), (d_status, d_ans) = await asyncio.gather(post(p_url), post(d_url))
    assert (p_status, d_status) == (200, 200), (p_ans, d_ans)
    plain = {"text": body["text"], "sampling_params": body["sampling_params"]}
    assert d_ans["text"] == expected_answer(GEN, plain, mean_tokens=MEAN)[0]
    return dict(d_ans)


# --- refusals --------------------------------------------------------------------------------


async def test_refused_when_not_enabled_and_outside_pd() -> None:
    async with workers(cfg("prefill"), cfg("both", role_switch=True)) as (s, (p, both)):
        assert await switch(s, p, new_role="decode") == (
            400,
            answer(
                False,
                "--enable-pd-role-switch is not set on this server",
                "prefill",
                "decode",
                True,
            ),
        )
        assert await switch(s, both, new_role="prefill") == (
            400,
            answer(
                False,
                "instance is not running in PD disaggregation mode",
                "null",
                "prefill",
                True,
            ),
        )
        state = await get(s, both, "/sim/state")
        assert state["counters"] == {"role_switches:rejected": 1}


@pytest.mark.parametrize("role", ["both", "", "gpu"])
async def test_invalid_roles_are_refused(role: str) -> None:
    async with workers(cfg("decode", role_switch=True)) as (s, (d,)):
        status, body = await switch(s, d, new_role=role)
        assert status == 400
        assert body == answer(False, f"invalid new_role={role!r}", "decode", role, True)
        assert (await get(s, d, "/server_info"))["disaggregation_mode"] == "decode"


async def test_same_role_and_prepare_only_change_nothing() -> None:
    async with workers(cfg("prefill", role_switch=True)) as (s, (p,)):
        # SGLang's scheduler says "already in target role"; its tokenizer manager answers "ok"
        # for every success that is not a preflight, with the scheduler's default safe false.
        assert await switch(s, p, new_role="prefill") == (
            200,
            answer(True, "ok", "prefill", "prefill", False),
        )
        assert await switch(s, p, new_role="decode", prepare_only=True) == (
            200,
            answer(True, "ready", "prefill", "decode", True),
        )
        state = await get(s, p, "/sim/state")
        assert state["role"] == "prefill"
        assert state["counters"] == {"role_switches:already": 1, "role_switches:ready": 1}


async def test_not_idle_while_a_stream_runs_then_switches_after_it() -> None:
    # Slow enough that the stream (120 tokens) lasts some 150 ms; the switch itself is short.
    d_cfg = cfg("decode", role_switch=True, time_scale=4.0, role_switch_s=0.04)
    body = {"prompt": "go on", "max_tokens": 120, "ignore_eos": True, "stream": True}
    async with workers(d_cfg) as (s, (d,)):
        async with s.post(d + "/v1/completions", json=body) as r:
            assert r.status == 200
            await r.content.readuntil(b"\n\n")  # the first token is out: it is running
            status, refused = await switch(s, d, new_role="prefill")
            assert (status, refused) == (
                400,
                answer(
                    False,
                    "instance is not idle; drain all requests before switching",
                    "decode",
                    "prefill",
                    True,
                ),
            )
            assert refused == (await switch(s, d, new_role="prefill", prepare_only=True))[1]
            rest = await r.read()
        assert rest.endswith(b"data: [DONE]\n\n")
        for _ in range(100):  # the handler's bookkeeping ends just after the last byte
            if (await get(s, d, "/sim/state"))["inflight_requests"] == 0:
                break
            await asyncio.sleep(0.01)
        assert await switch(s, d, new_role="prefill") == (
            200,
            answer(True, "ok", "decode", "prefill", False),
        )


async def test_requests_during_the_reconfiguration_are_refused_503() -> None:
    # 300 simulated seconds at 1000x: the flip takes 0.3 s of real time.
    async with workers(cfg("prefill", role_switch=True, role_switch_s=300.0)) as (s, (p,)):
        flip = asyncio.ensure_future(switch(s, p, new_role="decode"))
        for _ in range(100):
            if (await get(s, p, "/sim/state"))["role_switching"]:
                break
            await asyncio.sleep(0.005)
        async with s.post(p + GEN, json={"text": "now?"}) as r:
            assert r.status == 503
            error = (await r.json())["error"]
            assert error["code"] == 503 and "role switch is in progress" in error["message"]
        assert await switch(s, p, new_role="decode") == (
            400,
            answer(False, "another role switch is already in progress", "prefill", "decode", False),
        )
        # The info endpoints keep answering, with the role still served until the flip is done.
        assert serving(await get(s, p, "/server_info")) == "prefill"
        assert (await get(s, p, "/get_load"))[0]["num_reqs"] == 0
        async with s.get(p + "/metrics") as r:
            assert r.status == 200
        assert await flip == (200, answer(True, "ok", "prefill", "decode", False))
        info = await get(s, p, "/server_info")
        # As SGLang's: the top-level server args keep the start-up role, the scheduler's is new.
        assert (info["disaggregation_mode"], serving(info)) == ("prefill", "decode")
        state = await get(s, p, "/sim/state")
        assert (state["role"], state["role_switching"]) == ("decode", False)
        async with s.get(p + "/metrics") as r:
            text = await r.text()
        assert 'sim:role_switches_total{model_name="llama-3-8b",outcome="ok"} 1.0' in text


# --- flips that then serve the other leg -----------------------------------------------------


async def test_prefill_switched_to_decode_serves_a_decode_leg() -> None:
    p_cfg = cfg("prefill", bootstrap_port=0)
    w_cfg = cfg("prefill", role_switch=True, worker_id="w")
    async with workers(p_cfg, w_cfg) as (s, (p, w)):
        p_port = (await get(s, p, "/server_info"))["disaggregation_bootstrap_port"]
        assert await switch(s, w, new_role="decode") == (
            200,
            answer(True, "ok", "prefill", "decode", False),
        )
        info = await get(s, w, "/server_info")
        assert (serving(info), info["enable_pd_role_switch"]) == ("decode", True)
        # A decode now: a plain OpenAI request is served locally, not refused as a prefill's.
        async with s.post(w + "/v1/completions", json={"prompt": "hi", "max_tokens": 3}) as r:
            assert r.status == 200
        await pd_request(s, p, w, pd_bodies("a decode leg", p_port, 12345))
        state = await get(s, w, "/sim/state")
        assert (state["worker_id"], state["role"]) == ("w", "decode")
        assert state["counters"]["kv_pulled"] == 1
        assert state["counters"]["requests:remote_decode"] == 1
        assert (await get(s, p, "/sim/state"))["bootstrap_rooms"] == 0


async def test_decode_switched_to_prefill_serves_with_its_bootstrap_port() -> None:
    w_cfg = cfg("decode", role_switch=True, bootstrap_port=0)
    async with workers(w_cfg, cfg("decode")) as (s, (w, d)):
        # With role switch on, SGLang starts the bootstrap server on a decode too.
        before = (await get(s, w, "/server_info"))["disaggregation_bootstrap_port"]
        assert isinstance(before, int) and before > 0
        _, writer = await asyncio.open_connection("127.0.0.1", before)
        writer.close()
        await writer.wait_closed()
        assert (await switch(s, w, new_role="prefill"))[0] == 200
        info = await get(s, w, "/server_info")
        assert serving(info) == "prefill"
        assert info["disaggregation_bootstrap_port"] == before  # not rebuilt on the flip
        await pd_request(s, w, d, pd_bodies("a prefill leg", before, 777))
        assert (await get(s, d, "/sim/state"))["counters"]["kv_pulled"] == 1
        state = await get(s, w, "/sim/state")
        assert state["counters"]["requests:prefill"] == 1
        assert (state["bootstrap_rooms"], state["blocks_in_use"]) == (0, 0)
        # And back: a decode again, its KV pulled from another prefill's bootstrap server.
        assert (await switch(s, w, new_role="decode"))[0] == 200
        async with s.post(w + "/v1/completions", json={"prompt": "hi", "max_tokens": 3}) as r:
            assert r.status == 200


async def test_without_role_switch_a_decode_has_no_bootstrap_listener() -> None:
    async with workers(cfg("decode", bootstrap_port=0)) as (s, (d,)):
        # The configured 0 is reported as before: nothing was bound.
        assert (await get(s, d, "/server_info"))["disaggregation_bootstrap_port"] == 0


async def test_the_flip_clears_the_prefix_cache() -> None:
    w_cfg = cfg("decode", role_switch=True, kv_events_endpoint=f"tcp://127.0.0.1:{free_port()}")
    prompt = " ".join(f"word{i}" for i in range(80))  # several full blocks
    async with workers(w_cfg) as (s, (w,)):
        async with s.post(w + "/v1/completions", json={"prompt": prompt, "max_tokens": 2}) as r:
            assert r.status == 200
        assert (await get(s, w, "/sim/kv_events"))["blocks"]
        assert (await switch(s, w, new_role="prefill"))[0] == 200
        assert (await get(s, w, "/sim/kv_events"))["blocks"] == []


# --- a failed rebuild ------------------------------------------------------------------------


async def test_an_injected_failure_leaves_the_instance_unhealthy() -> None:
    unhealthy = "instance is unhealthy after a failed role switch; restart required"
    async with workers(cfg("decode", role_switch=True)) as (s, (d,)):
        async with s.post(d + "/sim/faults", json={"role_switch_fail": 1.0}) as r:
            assert r.status == 200
        assert await switch(s, d, new_role="prefill") == (
            400,
            answer(
                False,
                "role switch failed; instance unhealthy, restart required: injected fault",
                "decode",
                "prefill",
                False,
            ),
        )
        # No rollback and no flip: the role it had, marked unhealthy.
        state = await get(s, d, "/sim/state")
        assert (state["role"], state["role_switch_unhealthy"]) == ("decode", True)
        assert (await get(s, d, "/server_info"))["disaggregation_mode"] == "decode"
        async with s.post(d + GEN, json={"text": "still there?"}) as r:
            assert r.status == 503
            assert unhealthy in (await r.json())["error"]["message"]
        for role in ("prefill", "decode", "both"):
            assert await switch(s, d, new_role=role) == (
                400,
                answer(False, unhealthy, "decode", role, False),
            )
        async with s.get(d + "/health") as r:
            assert r.status == 200  # SGLang's health check does not look at the flag
        counters = (await get(s, d, "/sim/state"))["counters"]
        assert counters["role_switches:failed"] == 1
        assert counters["role_switches:rejected"] == 3
        assert counters["faults:role_switch_fail"] == 1


async def test_the_failure_fault_obeys_count_and_its_range() -> None:
    async with workers(cfg("prefill", role_switch=True)) as (s, (p,)):
        faults = {"role_switch_fail": 1.0, "count": 0}  # the fault fires zero times
        async with s.post(p + "/sim/faults", json=faults) as r:
            assert r.status == 200
        assert (await switch(s, p, new_role="decode"))[0] == 200
        async with s.post(p + "/sim/faults", json={"role_switch_fail": 2.0}) as r:
            assert r.status == 400


# --- configuration ---------------------------------------------------------------------------


def test_flags_and_defaults() -> None:
    parser = argparse.ArgumentParser()
    add_worker_arguments(parser)
    plain = config_from_args(parser.parse_args(["--role", "decode"]))
    assert (plain.role_switch, plain.role_switch_s, plain.faults.role_switch_fail) == (
        False,
        1.0,
        0.0,
    )
    argv = ["--role", "decode", "--enable-pd-role-switch", "--role-switch-s", "2.5"]
    c = config_from_args(parser.parse_args([*argv, "--fault-role-switch-fail", "0.25"]))
    assert (c.role_switch, c.role_switch_s, c.faults.role_switch_fail) == (True, 2.5, 0.25)
    with pytest.raises(ValueError, match="role_switch_s"):
        WorkerConfig(role="decode", role_switch_s=-1.0)
