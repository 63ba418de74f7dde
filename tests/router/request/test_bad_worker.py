"""A worker whose `/health` is fine but whose real answers are garbage or never come (issue 20).

Two prefill and two decode simulated workers, one of them bad (disagg_tools/sim/faults.py
`garbage`, `hang`,
`hang_after_tokens`); requests through the `openai` client. For each fault: every request gets
its exact answer (retried, or resumed on the good decode worker), the bad worker's breaker is
open after at most a few requests on it, and nothing is reserved or stranded once quiet. The
half-open breaker is closed again by a real request that works, never by `/health` alone.
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import orjson
import pytest
from openai import AsyncOpenAI

from disagg_tools.sim.textgen import expected_answer
from tests.conftest import MODEL, SimCluster, sim_cluster

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
FAST_RETRY = {"backoff_base_s": 0.005, "backoff_max_s": 0.02}
# Short legs, so a hung worker costs a fraction of a second per request on it; the TTFT
# deadline covers a hung prefill and a hung decode in one request, with room to spare.
SHORT_LEGS = {"prefill_s": 0.5, "idle_s": 0.5, "ttft_s": 20.0}
REQUESTS = 16
CONCURRENCY = 4
FAILURES_TO_OPEN = 3  # BreakerSettings' default, which these clusters keep
# Requests the bad worker may see before its breaker keeps it out: the failures that open it,
# plus the requests already sent to it when the last of those failures is judged. A hung worker
# holds every request placed on it until its leg times out, so with four in flight the other
# three were dispatched before the breaker could know (a CI run saw six, p1 hang stream).
MAX_ON_BAD = FAILURES_TO_OPEN + CONCURRENCY - 1


def _client(c: SimCluster) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=c.router_url + "/v1", api_key="unused", max_retries=0, timeout=30)


async def set_faults(c: SimCluster, wid: str, **faults: Any) -> None:
    async with (
        aiohttp.ClientSession() as s,
        s.post(c.workers[wid] + "/sim/faults", json=faults) as r,
    ):
        assert r.status == 200, await r.text()


def _body(path: str, i: int) -> dict[str, Any]:
    body: dict[str, Any] = {"model": MODEL, "max_tokens": 24, "ignore_eos": True}
    prompt = f"bad worker case {i}: tell me a long story"
    if path == CHAT:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    return body


async def _ask(client: AsyncOpenAI, path: str, body: dict[str, Any], stream: bool) -> str:
    """The answer's text as the client read it (an error, or a stream that breaks, raises)."""
    args = {k: v for k, v in body.items() if k not in ("model", "ignore_eos")}
    extra = {"ignore_eos": True}
    if path == CHAT:
        if not stream:
            answer = await client.chat.completions.create(model=MODEL, extra_body=extra, **args)
            return answer.choices[0].message.content or ""
        chat_parts = []
        chat_stream = await client.chat.completions.create(
            model=MODEL, extra_body=extra, stream=True, **args
        )
        async for chunk in chat_stream:
            for choice in chunk.choices:
                chat_parts.append(choice.delta.content or "")
        return "".join(chat_parts)
    if not stream:
        whole = await client.completions.create(model=MODEL, extra_body=extra, **args)
        return whole.choices[0].text
    parts = []
    text_stream = await client.completions.create(
        model=MODEL, extra_body=extra, stream=True, **args
    )
    async for piece in text_stream:
        parts.extend(choice.text for choice in piece.choices)
    return "".join(parts)


async def _run(c: SimCluster, path: str, stream: bool, n: int = REQUESTS, start: int = 0) -> None:
    """`n` requests, `CONCURRENCY` at a time (so placement spreads them over both pairs); every
    one must come back whole and exact."""
    gate = asyncio.Semaphore(CONCURRENCY)

    async def one(i: int) -> tuple[str, str]:
        body = _body(path, i)
        async with gate:
            got = await _ask(client, path, body, stream)
        return got, expected_answer(path, body)[0]

    async with _client(c) as client:
        results = await asyncio.gather(*(one(start + i) for i in range(n)))
    for got, want in results:
        assert got == want


async def _generation_requests(c: SimCluster, wid: str) -> int:
    paths = (CHAT, COMPLETIONS)
    return sum(1 for r in await c.worker_requests(wid) if r["path"] in paths)


async def assert_quiet(c: SimCluster) -> None:
    for _ in range(100):
        if not any((await c.reserved_blocks()).values()) and not any((await c.stranded()).values()):
            break
        await asyncio.sleep(0.05)
    assert set((await c.reserved_blocks()).values()) == {0}
    assert set((await c.stranded()).values()) == {0}
    assert c.parts.leases.live == {}


async def _admin_breaker(c: SimCluster, wid: str) -> str:
    async with aiohttp.ClientSession() as s, s.get(c.router_url + "/admin/workers") as r:
        assert r.status == 200
        workers = (await r.json())["workers"]
    return str(next(w for w in workers if w["id"] == wid)["breaker"])


# (bad worker, its faults): the shapes of disagg_tools/sim/garbage.py on the leg they break, and
# the hangs.
CASES = [
    ("p1", {"garbage": "not_json"}),
    ("p1", {"garbage": "wrong_shape"}),
    ("p1", {"garbage": "no_kv_params"}),
    ("p1", {"garbage": "truncated"}),
    ("p1", {"hang": True}),
    ("d1", {"garbage": "not_json"}),
    ("d1", {"garbage": "wrong_shape"}),
    ("d1", {"garbage": "no_framing"}),
    ("d1", {"garbage": "truncated"}),
    ("d1", {"garbage": "junk_after_tokens"}),
    ("d1", {"hang": True}),
    ("d1", {"hang_after_tokens": 3}),
]


def _case_id(case: tuple[str, dict[str, Any]]) -> str:
    wid, faults = case
    return f"{wid}-" + "-".join(str(v) for v in faults.values())


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
@pytest.mark.parametrize(("bad", "faults"), CASES, ids=[_case_id(c) for c in CASES])
async def test_bad_worker_is_taken_out_and_no_client_sees_it(
    redis_prefix: str, bad: str, faults: dict[str, Any], stream: bool
) -> None:
    async with sim_cluster(
        prefill=2,
        decode=2,
        redis_prefix=redis_prefix,
        retry=FAST_RETRY,
        timeouts=SHORT_LEGS,
        # A cooldown longer than the test: the bad worker, once out, stays out.
        breaker={"cooldown_s": 60.0},
    ) as c:
        await set_faults(c, bad, **faults)
        breaker = c.parts.pools.workers[bad].breaker
        assert breaker.settings.failures_to_open == FAILURES_TO_OPEN
        # Rounds until the breaker opens: a hung worker holds its first requests while the
        # rest of a round goes to the good pair, so one round may not reach it often enough.
        for rounds in range(4):
            await _run(c, CHAT, stream, start=rounds * REQUESTS)
            if breaker.state != "closed":
                break
        on_bad = await _generation_requests(c, bad)
        assert breaker.state == "open", (breaker, on_bad)
        assert await _admin_breaker(c, bad) == "open"
        assert on_bad <= MAX_ON_BAD, on_bad
        await assert_quiet(c)


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS], ids=["chat", "completions"])
async def test_garbage_only_on_one_endpoint(redis_prefix: str, path: str) -> None:
    """A worker broken on one endpoint only (`garbage_path`): out once that endpoint shows it;
    the other endpoint's requests are served by it as usual until then."""
    async with sim_cluster(
        prefill=2, decode=2, redis_prefix=redis_prefix, retry=FAST_RETRY, timeouts=SHORT_LEGS
    ) as c:
        await set_faults(c, "d1", garbage="wrong_shape", garbage_path=CHAT)
        await _run(c, path, True)
        breaker = c.parts.pools.workers["d1"].breaker
        assert breaker.state == ("open" if path == CHAT else "closed"), breaker
        await assert_quiet(c)


async def test_half_open_is_decided_by_a_real_request_not_by_health(redis_prefix: str) -> None:
    """The bad decode worker passes every `/health`: half-open lets one real request through,
    whose failure opens the breaker again for twice as long. (A passing health probe used to
    close it, so every cooldown let the worker back in whole: three more failed requests a
    cooldown.) Once the worker is fixed, a real request closes the breaker."""
    async with sim_cluster(
        prefill=2,
        decode=2,
        redis_prefix=redis_prefix,
        retry=FAST_RETRY,
        timeouts=SHORT_LEGS,
        breaker={"cooldown_s": 0.2, "max_cooldown_s": 60.0},
        loops={"health_interval_s": 0.05},
    ) as c:
        await set_faults(c, "d1", garbage="not_json")
        breaker = c.parts.pools.workers["d1"].breaker
        loop = asyncio.get_running_loop()
        until, rounds = loop.time() + 2.5, 0
        while loop.time() < until:
            await _run(c, CHAT, True, n=4, start=rounds * 4)
            rounds += 1
            await asyncio.sleep(0.05)
        on_bad = await _generation_requests(c, "d1")
        assert breaker.state != "closed" and breaker.trips >= 2, (breaker, on_bad)
        # 3 to open, then one probe per cooldown (0.2, 0.4, 0.8, 1.6 s: at most 4 in 2.5 s);
        # closed by each health probe, it would be 3 per 0.2 s.
        assert on_bad <= 3 + 5, (breaker, on_bad)

        await set_faults(c, "d1")  # fixed
        for later in range(rounds, rounds + 200):
            if breaker.state == "closed":
                break
            await _run(c, CHAT, True, n=4, start=later * 4)
            await asyncio.sleep(0.05)
        assert breaker.state == "closed", breaker
        await assert_quiet(c)


async def _raw_stream(c: SimCluster, i: int) -> bytes:
    body = {**_body(CHAT, i), "stream": True}
    async with aiohttp.ClientSession() as s, s.post(c.router_url + CHAT, json=body) as r:
        assert r.status == 200
        return await r.read()


def _check_events(raw: bytes, want: str) -> None:
    """Every byte the client got is a `data:` event that parses (or [DONE]); the text exact."""
    assert raw.endswith(b"data: [DONE]\n\n"), raw[-200:]
    text = []
    for event in raw.split(b"\n\n")[:-2]:
        assert event.startswith(b"data: {"), event
        for choice in orjson.loads(event[6:])["choices"]:
            text.append(choice["delta"].get("content") or "")
    assert "".join(text) == want


STREAM_GARBAGE = ["not_json", "wrong_shape", "no_framing", "truncated", "junk_after_tokens"]


@pytest.mark.parametrize("shape", STREAM_GARBAGE)
async def test_no_garbage_byte_reaches_the_client(redis_prefix: str, shape: str) -> None:
    """Read raw: an SSE parser skips lines it does not know, so the openai client alone would
    not notice a body without framing passed through; nothing of the bad stream may arrive."""
    async with sim_cluster(
        prefill=1,
        decode=2,
        redis_prefix=redis_prefix,
        retry=FAST_RETRY,
        breaker={"cooldown_s": 60.0},
    ) as c:
        await set_faults(c, "d1", garbage=shape)
        breaker = c.parts.pools.workers["d1"].breaker
        for i in range(40):
            raw = await _raw_stream(c, i)
            _check_events(raw, expected_answer(CHAT, _body(CHAT, i))[0])
            if breaker.state == "open":
                break
        assert breaker.state == "open" and await _generation_requests(c, "d1") <= MAX_ON_BAD
        await assert_quiet(c)


@pytest.mark.parametrize("shape", ["not_json", "wrong_shape", "truncated", "junk_after_tokens"])
async def test_whole_answers_of_garbage_are_retried(redis_prefix: str, shape: str) -> None:
    """Answers asked whole from the decode worker (`assemble_non_streaming: false`): a 200 that
    is not an answer (or of the wrong shape) is retried and charged, never passed on."""
    async with sim_cluster(
        prefill=2,
        decode=2,
        redis_prefix=redis_prefix,
        retry=FAST_RETRY,
        breaker={"cooldown_s": 60.0},
        upstream={"assemble_non_streaming": False},
    ) as c:
        await set_faults(c, "d1", garbage=shape)
        breaker = c.parts.pools.workers["d1"].breaker
        for rounds in range(4):
            await _run(c, COMPLETIONS, False, start=rounds * REQUESTS)
            if breaker.state != "closed":
                break
        assert breaker.state == "open" and await _generation_requests(c, "d1") <= MAX_ON_BAD
        await assert_quiet(c)


async def test_a_probe_whose_client_leaves_gives_its_place_back(redis_prefix: str) -> None:
    """A half-open probe whose client goes away mid-stream says nothing of the worker: its place
    is given back (else the breaker stays half-open with its one probe "in flight" forever and
    the worker, fixed or not, never gets a request again)."""
    async with sim_cluster(
        decode=1, redis_prefix=redis_prefix, retry=FAST_RETRY, breaker={"cooldown_s": 0.2}
    ) as c:
        breaker = c.parts.pools.workers["d0"].breaker
        for _ in range(3):
            breaker.on_failure()
        await asyncio.sleep(0.25)
        assert breaker.state == "half_open"
        await set_faults(c, "d0", slow_factor=200.0)  # a long stream: time to leave mid-way
        body = {**_body(CHAT, 1), "stream": True}
        async with aiohttp.ClientSession() as s, s.post(c.router_url + CHAT, json=body) as r:
            assert r.status == 200
            await r.content.readline()  # the first event: the probe is streaming
            assert breaker.probes_in_flight == 1
        for _ in range(100):  # the router sees the client gone and releases the attempt
            if breaker.probes_in_flight == 0:
                break
            await asyncio.sleep(0.02)
        assert breaker.probes_in_flight == 0 and breaker.state == "half_open"
        await set_faults(c, "d0")
        await _run(c, CHAT, True, n=1, start=2)  # the next probe closes it
        assert breaker.state == "closed"
        await assert_quiet(c)
