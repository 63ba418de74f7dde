"""Placement decisions through the live router, on simulated workers over real sockets.

Each test crafts a cluster state (a deep prefill queue, a nearly full decode worker, a worker
that can prefill locally, a learned output-length distribution) and asserts on WHICH worker
served WHAT: the simulated workers' request logs (`GET /sim/requests`, keyed by the
X-Request-Id the router forwards), the router's `/admin/state` and its
`disagg_router_placements_total{prefill,decode}` counter. Never on timings: the machine may be
slow, so waits are polls with generous deadlines, and nothing asserts how long anything took.

Every test ends with no decode blocks reserved and no stranded KV bytes (`_drained`).
"""

from __future__ import annotations

import asyncio
import contextlib
import csv
import importlib.util
import math
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import pytest

from disagg_tools.sim.textgen import expected_answer
from policies.base import Candidate, ClusterView, Placement, RequestInfo
from policies.estimators import asked_bucket, bucket_of, histogram_quantiles
from policies.registry import PolicyLoadError
from router.config import settings_from_mapping
from router.edge.app import create_app
from tests.conftest import MODEL, SimCluster, sim_cluster
from tests.paths import REPO

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"

TRACE = REPO.parent / "shared" / "traces" / "AzureLLMInferenceTrace_conv.csv"
PLUGIN = "examples.custom_policy:TightestFitPolicy"

# Deadline for every "wait until the router / a worker shows X" poll. Generous: the machine
# is shared with real engines; a poll returns as soon as the condition holds.
WAIT_S = 30.0


# -- helpers ------------------------------------------------------------------------------------


def _body(text: str, max_tokens: int, **extra: Any) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": max_tokens,
        **extra,
    }


def _prompt(tokens: int, tag: str) -> str:
    """A chat prompt of about `tokens` tokens (router and sim both count 4 characters a token)."""
    text = f"[{tag}] " + "lorem ipsum dolor sit amet " * (tokens // 6 + 1)
    return text[: tokens * 4]


async def _until(
    check: Callable[[], Awaitable[bool]], what: str, timeout_s: float = WAIT_S
) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not await check():
        if loop.time() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        await asyncio.sleep(0.02)


async def _post(
    session: aiohttp.ClientSession,
    c: SimCluster,
    body: dict[str, Any],
    rid: str,
    headers: dict[str, str] | None = None,
    path: str = CHAT,
) -> dict[str, Any]:
    async with session.post(
        c.router_url + path, json=body, headers={"X-Request-Id": rid, **(headers or {})}
    ) as resp:
        data = await resp.json()
        assert resp.status == 200, (rid, resp.status, data)
        return dict(data)


def _rid(entry: dict[str, Any]) -> str | None:
    for k, v in entry["headers"].items():
        if k.lower() == "x-request-id":
            return str(v)
    return None


async def _legs(c: SimCluster, wid: str, rid: str) -> list[dict[str, Any]]:
    """The requests worker `wid` received for router request `rid` (its log, by X-Request-Id)."""
    return [e for e in await c.worker_requests(wid) if _rid(e) == rid]


async def _served_by(c: SimCluster, rid: str) -> set[str]:
    """Every worker whose log shows request `rid`."""
    return {wid for wid in c.workers if await _legs(c, wid, rid)}


async def _admin(c: SimCluster) -> dict[str, dict[str, Any]]:
    async with aiohttp.ClientSession() as s, s.get(c.router_url + "/admin/state") as r:
        assert r.status == 200
        state = await r.json()
    return {w["id"]: w for w in state["workers"]} | {"_": state}


_SAMPLE = re.compile(r"^(\w+)\{([^}]*)\} (\S+)$")


async def _metric(c: SimCluster, name: str) -> dict[frozenset[tuple[str, str]], float]:
    """Samples of one metric from the router's /metrics: {frozenset(labels): value}."""
    async with aiohttp.ClientSession() as s, s.get(c.router_url + "/metrics") as r:
        text = await r.text()
    out: dict[frozenset[tuple[str, str]], float] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m and m.group(1) == name:
            labels = frozenset(re.findall(r'(\w+)="([^"]*)"', m.group(2)))
            out[labels] = float(m.group(3))
    return out


async def _placements(c: SimCluster) -> dict[tuple[str, str], int]:
    samples = await _metric(c, "disagg_router_placements_total")
    return {(dict(k)["prefill"], dict(k)["decode"]): int(v) for k, v in samples.items()}


async def _drained(c: SimCluster) -> None:
    """Nothing left reserved on any decode worker, nothing stranded on any prefill worker."""

    async def clean() -> bool:
        reserved, stranded = await c.reserved_blocks(), await c.stranded()
        return not any(reserved.values()) and not any(stranded.values())

    with contextlib.suppress(AssertionError):
        await _until(clean, "reservations and stranded KV to drain")
    assert all(v == 0 for v in (await c.reserved_blocks()).values()), await c.reserved_blocks()
    assert all(v == 0 for v in (await c.stranded()).values()), await c.stranded()
    assert c.parts.leases.live == {}


@contextlib.asynccontextmanager
async def _held(c: SimCluster, worker: str, blocks: int) -> AsyncIterator[None]:
    """Another router replica holds `blocks` on `worker`; this router sees it after a refresh."""
    store = c.parts.store
    assert await store.reserve(worker, "other-replica", blocks, 60.0)
    try:

        async def visible() -> bool:
            return c.parts.pools.workers[worker].reserved_blocks >= blocks

        await _until(visible, f"the router to see {blocks} blocks held on {worker}")
        yield
    finally:
        assert await store.release(worker, "other-replica") == blocks


def _cluster(
    *, prefill: int = 1, time_scale: float = 500.0, **kw: Any
) -> contextlib.AbstractAsyncContextManager[SimCluster]:
    """`sim_cluster` whose prefill workers hold a prefilled KV for 30 REAL seconds.

    A sim worker's KV lease is in simulated seconds (30 by default), so at time_scale 500 it
    lasts 60 ms of real time: on a loaded machine the router's hop from the prefill answer to the
    decode pull can take longer, and the decode then finds the KV gone. These tests are about
    placement, not about lease expiry, so the lease is scaled to real time.
    """
    overrides = {f"p{i}": {"kv_lease_s": 30.0 * time_scale} for i in range(prefill)}
    for wid, extra in kw.pop("worker_overrides", {}).items():
        overrides[wid] = {**overrides.get(wid, {}), **extra}
    return sim_cluster(prefill=prefill, time_scale=time_scale, worker_overrides=overrides, **kw)


# -- a long prompt avoids the deepest prefill queue ---------------------------------------------


async def test_long_prompt_avoids_the_prefill_worker_with_the_deepest_queue(
    redis_prefix: str,
) -> None:
    """Two prefill workers, both made very slow so prompts stay queued. A 6,000-token prompt
    lands on one of them (idle twins: the tie is hashed); a 1,000-token prompt then goes to the
    other; a 4,000-token prompt then avoids the deeper queue although neither is idle."""
    async with _cluster(prefill=2, decode=1, redis_prefix=redis_prefix) as c:
        async with aiohttp.ClientSession() as s:
            for wid in ("p0", "p1"):
                async with s.post(c.workers[wid] + "/sim/faults", json={"slow_factor": 1e6}) as r:
                    assert r.status == 200

        queued: dict[str, int] = {}

        async def queue_shows(total: int) -> bool:
            state = await _admin(c)
            queued.clear()
            queued.update({w: state[w]["queued_prompt_tokens"] for w in ("p0", "p1")})
            return sum(queued.values()) >= total

        session = aiohttp.ClientSession()
        tasks: list[asyncio.Task[Any]] = []

        def send(tokens: int, rid: str) -> None:
            body = _body(_prompt(tokens, rid), 16)
            tasks.append(asyncio.create_task(_post(session, c, body, rid)))

        try:
            send(6000, "q-deep")
            await _until(lambda: queue_shows(6000), "the 6,000-token prompt to be queued")
            deep = max(queued, key=lambda w: queued[w])
            other = "p1" if deep == "p0" else "p0"
            deep_tokens = queued[deep]
            assert queued[other] == 0

            send(1000, "q-mid")
            await _until(lambda: queue_shows(deep_tokens + 1000), "the 1,000-token prompt")
            assert queued[deep] == deep_tokens  # not the deeper queue
            mid_tokens = queued[other]
            assert 0 < mid_tokens < deep_tokens

            send(4000, "q-long")
            await _until(lambda: queue_shows(deep_tokens + 5000), "the 4,000-token prompt")
            assert queued[deep] == deep_tokens  # neither worker is idle; the shallower one won
            assert queued[other] >= mid_tokens + 4000

            # The workers' own logs agree with the router's accounting.
            await _until(
                lambda: _has(c, other, "q-long"), f"{other} to receive the 4,000-token prompt"
            )
            assert [_rid(e) for e in await c.worker_requests(deep)] == ["q-deep"]
            assert [_rid(e) for e in await c.worker_requests(other)] == ["q-mid", "q-long"]
            assert await _placements(c) == {(deep, "d0"): 1, (other, "d0"): 2}
            assert all(not t.done() for t in tasks)  # all three still in prefill
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await session.close()
        # Clients gone: the router aborted the prefills and gave their decode room back.
        await _drained(c)
        state = await _admin(c)
        assert state["p0"]["queued_prompt_tokens"] == state["p1"]["queued_prompt_tokens"] == 0


async def _has(c: SimCluster, wid: str, rid: str) -> bool:
    return bool(await _legs(c, wid, rid))


# -- a long expected answer avoids the nearly full decode worker ---------------------------------


@pytest.mark.parametrize("estimator", ["hint", "max_tokens"])
async def test_long_expected_answer_avoids_the_nearly_full_decode_worker(
    redis_prefix: str, estimator: str
) -> None:
    """d0 and d1: 1,000 blocks each; another replica holds 900 on d0 (room for 1,600 tokens)
    and 500 on d1. A 3,000-token expected answer (the client's hint, or max_tokens) fits only
    d1, every time; a short one fits both and is served too. The real answers are short
    (X-Sim-Output-Tokens): only the estimate, and so the reservation, differs."""
    async with _cluster(
        prefill=1,
        decode=2,
        redis_prefix=redis_prefix,
        kv_blocks=1000,
        estimates={"estimator": estimator, "trust_hints": True},
    ) as c:

        def request(expected: int) -> tuple[dict[str, Any], dict[str, str]]:
            headers = {"X-Sim-Output-Tokens": "8"}
            if estimator == "hint":
                headers["X-Expected-Output-Tokens"] = str(expected)
                return _body("Summarise the design.", 4000), headers
            return _body("Summarise the design.", expected), headers

        async with _held(c, "d0", 900), _held(c, "d1", 500), aiohttp.ClientSession() as s:
            for i in range(3):
                body, headers = request(3000)
                await _post(s, c, body, f"long-{i}", headers)
                assert await _served_by(c, f"long-{i}") == {"p0", "d1"}
            body, headers = request(32)
            await _post(s, c, body, "short", headers)
            assert len(await _served_by(c, "short") & {"d0", "d1"}) == 1
            placements = await _placements(c)
            assert placements[("p0", "d1")] >= 3 and sum(placements.values()) == 4
            assert placements.get(("p0", "d0"), 0) <= 1
        await _drained(c)


# -- a burst does not herd onto one decode worker ------------------------------------------------


async def test_a_burst_spreads_over_the_decode_workers(redis_prefix: str) -> None:
    """Another replica holds a few blocks on d1, so d0 looks a little emptier; then 32 requests
    arrive at once. Each placement is made while the others' reservations are still on their
    way to the store: unless those in-flight reservations count, every one of them sees the
    same view and the whole burst herds onto d0 (seen with real vLLM: 31 of 32)."""
    async with _cluster(prefill=1, decode=2, redis_prefix=redis_prefix) as c:
        async with _held(c, "d1", 2), aiohttp.ClientSession() as s:
            await asyncio.gather(
                *(
                    _post(
                        s,
                        c,
                        _body(f"burst request {i}", 64),
                        f"burst-{i}",
                        {"X-Sim-Output-Tokens": "8"},
                    )
                    for i in range(32)
                )
            )
            placements = await _placements(c)
        assert sum(placements.values()) == 32
        assert min(placements.get(("p0", d), 0) for d in ("d0", "d1")) >= 8, placements
        await _drained(c)


# -- conditional disaggregation -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("threshold", "short_local", "long_local"),
    [
        (None, True, False),  # the cost model's crossover (about 250 tokens on this profile)
        (256, True, False),  # the same, configured
        (0, False, False),  # override: always hand off
        (1_000_000, True, True),  # override: never hand off
    ],
)
async def test_short_prompts_skip_the_handoff_when_the_model_says_so(
    redis_prefix: str, threshold: int | None, short_local: bool, long_local: bool
) -> None:
    """One prefill worker and one `both` worker (decodes, and can prefill locally). A local
    prefill is one request to b0 without kv_transfer_params; a handoff is a prefill on p0 then
    a decode on b0 that pulls the KV (kv_transfer_params.do_remote_prefill)."""
    policy_args = {} if threshold is None else {"disagg_threshold_tokens": threshold}
    async with (
        _cluster(
            prefill=1, decode=0, both=1, redis_prefix=redis_prefix, policy_args=policy_args
        ) as c,
        aiohttp.ClientSession() as s,
    ):
        cases = {
            "short": (_prompt(12, "short"), short_local),
            "long": (_prompt(2000, "long"), long_local),
        }
        for rid, (text, _) in cases.items():
            body = _body(text, 16)
            got = await _post(s, c, body, rid)
            want, _, _ = expected_answer(CHAT, body)
            assert got["choices"][0]["message"]["content"] == want
        for rid, (_, local) in cases.items():
            prefill_legs = await _legs(c, "p0", rid)
            (decode_leg,) = await _legs(c, "b0", rid)
            kv = decode_leg["body"].get("kv_transfer_params")
            if local:
                assert prefill_legs == [], f"{rid}: expected a local prefill on b0"
                assert not kv, f"{rid}: a local prefill carries no kv_transfer_params"
            else:
                (pre,) = prefill_legs
                assert pre["body"]["kv_transfer_params"]["do_remote_decode"] is True
                assert kv and kv["do_remote_prefill"] is True
        want_counts: dict[tuple[str, str], int] = {}
        for _, local in cases.values():
            key = ("local" if local else "p0", "b0")
            want_counts[key] = want_counts.get(key, 0) + 1
        assert await _placements(c) == want_counts
        await _drained(c)


# -- a plugin policy loaded by dotted path --------------------------------------------------------


def test_the_example_plugin_is_importable_from_the_repo_root() -> None:
    # pytest puts the repository root on sys.path (tests/ is a package), so `examples.…` resolves
    # as it would for a router started from the repo root or with it on PYTHONPATH.
    assert importlib.util.find_spec("examples.custom_policy") is not None


async def test_plugin_policy_by_dotted_path_serves_requests_and_decides(redis_prefix: str) -> None:
    """`TightestFitPolicy` packs answers onto the decode worker with the LEAST room that fits:
    short answers go to the half-full d0 (two_sided would pick the idle d1); a long answer that
    does not fit d0 goes to d1. Answers are exact, streamed or not."""
    async with (
        _cluster(
            prefill=1,
            decode=2,
            redis_prefix=redis_prefix,
            kv_blocks=1000,
            policy=PLUGIN,
            policy_args={"max_candidates": 2},
            # the hint sizes the reservation, as a trusted caller's does
            estimates={"estimator": "hint", "trust_hints": True},
        ) as c,
        aiohttp.ClientSession() as s,
    ):
        assert (await _admin(c))["_"]["policy"] == "tightest_fit"
        async with _held(c, "d0", 600):  # d0: 400 blocks free (6,400 tokens), d1: 1,000
            for i in range(3):
                headers = {"X-Sim-Output-Tokens": str(10 + i), "X-Expected-Output-Tokens": "64"}
                body = _body(f"Plugin question {i}: what is a KV cache?", 64)
                got = await _post(s, c, body, f"fit-{i}", headers)
                want, n, finish = expected_answer(CHAT, body, headers)
                assert got["choices"][0]["message"]["content"] == want
                assert got["choices"][0]["finish_reason"] == finish
                assert got["usage"]["completion_tokens"] == n == 10 + i
                assert await _served_by(c, f"fit-{i}") == {"p0", "d0"}

            # A completions request, streamed: still exact, still tightest fit.
            cbody = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 20, "stream": True}
            headers = {"X-Request-Id": "fit-stream", "X-Sim-Output-Tokens": "15"}
            async with s.post(c.router_url + COMPLETIONS, json=cbody, headers=headers) as resp:
                assert resp.status == 200
                raw = (await resp.read()).decode()
            pieces = [
                chunk["choices"][0]["text"]
                for chunk in _sse_json(raw)
                if chunk.get("choices") and chunk["choices"][0].get("text")
            ]
            assert "".join(pieces) == expected_answer(COMPLETIONS, cbody, headers)[0]
            assert await _served_by(c, "fit-stream") == {"p0", "d0"}

            # 7,000 expected tokens need 438+ blocks: only d1 has them.
            headers = {"X-Sim-Output-Tokens": "5", "X-Expected-Output-Tokens": "7000"}
            await _post(s, c, _body("A long essay, please.", 8000), "fit-long", headers)
            assert await _served_by(c, "fit-long") == {"p0", "d1"}
        assert await _placements(c) == {("p0", "d0"): 4, ("p0", "d1"): 1}
        await _drained(c)


def _sse_json(raw: str) -> list[dict[str, Any]]:
    import json

    return [
        json.loads(line[6:])
        for line in raw.splitlines()
        if line.startswith("data: ") and line != "data: [DONE]"
    ]


# -- broken plugins fail at startup ---------------------------------------------------------------


class RaisingPolicy:
    """A plugin whose place() raises: the router must refuse to start, not fail request one."""

    name = "raising"

    def place(self, request: RequestInfo, view: ClusterView) -> Placement:
        raise RuntimeError("this policy is broken")


class StrangerPolicy:
    """A plugin that names a worker the cluster does not have."""

    name = "stranger"

    def place(self, request: RequestInfo, view: ClusterView) -> Placement:
        return Placement((Candidate("p0", "no-such-decode", 1),))


def _settings(**over: Any) -> Any:
    return settings_from_mapping(
        {
            "model": MODEL,
            "perf": {"model": MODEL, "gpu": "h100"},
            "workers": [
                {"id": "p0", "url": "http://127.0.0.1:9", "role": "prefill", "adapter": "sim"},
                {"id": "d0", "url": "http://127.0.0.1:9", "role": "decode", "adapter": "sim"},
            ],
            **over,
        }
    )


@pytest.mark.parametrize(
    ("over", "match"),
    [
        ({"policy": "no_such_package.mod:Policy"}, r"cannot import 'no_such_package\.mod'"),
        ({"policy": "examples.custom_policy:NoSuchPolicy"}, r"has no attribute 'NoSuchPolicy'"),
        ({"policy": "tightest_fit"}, r"unknown policy 'tightest_fit'"),
        (
            {"policy": PLUGIN, "policy_args": {"max_candidates": 0}},
            r"raised ValueError\('max_candidates must be >= 1",
        ),
        ({"policy": PLUGIN, "policy_args": {"nope": 1}}, r"does not accept arguments"),
        ({"policy": f"{__name__}:RaisingPolicy"}, r"raised RuntimeError\('this policy is broken'"),
        ({"policy": f"{__name__}:StrangerPolicy"}, r"naming a worker not in the cluster view"),
        (
            {"estimates": {"estimator": "no_such_package:Estimator"}},
            r"estimator 'no_such_package:Estimator'",
        ),
        (
            {"estimates": {"estimator": "online_quantile", "estimator_args": {"quantile": 2}}},
            r"quantile",
        ),
    ],
)
def test_a_broken_plugin_fails_create_app_with_a_clear_error(
    over: dict[str, Any], match: str
) -> None:
    settings = _settings(**over)  # the configuration itself parses: the plugin is the problem
    with pytest.raises(PolicyLoadError, match=match):
        create_app(settings)


# -- the online estimator learns a trace's distribution through the router ----------------------


def _trace_lengths(n: int, cap: int) -> list[int]:
    with TRACE.open(newline="") as f:
        rows = [row for _, row in zip(range(n), csv.DictReader(f), strict=False)]
    assert len(rows) == n, f"{TRACE} has fewer than {n} requests"
    return [max(1, min(cap, int(row["GeneratedTokens"]))) for row in rows]


def _true_quantile(lengths: list[int], q: float) -> int:
    """The ceil(q·n)-th smallest length: the same rank rule as the histogram quantiles."""
    return sorted(lengths)[max(1, math.ceil(q * len(lengths) - 1e-9)) - 1]


async def _predicted_buckets(c: SimCluster) -> dict[str, float]:
    samples = await _metric(c, "disagg_router_predicted_output_tokens_bucket")
    return {dict(k)["le"]: v for k, v in samples.items()}


@pytest.mark.skipif(not TRACE.exists(), reason=f"trace not available: {TRACE}")
async def test_online_estimator_converges_on_a_trace_distribution(redis_prefix: str) -> None:
    """Replay 300 requests of the Azure conversation trace through the router, each answer
    exactly as long as in the trace (X-Sim-Output-Tokens), max_tokens 1,024. Cold, the router
    reserves max_tokens; after the replay its p90 estimate is the true p90's bucket (buckets are
    ~9 % wide), and a new request reserves for that, far below max_tokens."""
    n, cap, concurrency = 300, 1024, 8
    lengths = _trace_lengths(n, cap)
    async with _cluster(
        prefill=1,
        decode=1,
        redis_prefix=redis_prefix,
        time_scale=5000.0,
        estimates={
            "estimator": "online_quantile",
            "estimator_args": {"quantile": 0.9, "min_samples": 20},
        },
        loops={"histogram_refresh_s": 0.1},
    ) as c:
        gw = c.parts
        gate = asyncio.Semaphore(concurrency)

        async def one(i: int, length: int, s: aiohttp.ClientSession) -> None:
            body = _body(f"trace request {i}: tell me something.", cap)
            async with gate:
                got = await _post(s, c, body, f"trace-{i}", {"X-Sim-Output-Tokens": str(length)})
            assert got["usage"]["completion_tokens"] == length

        async with aiohttp.ClientSession() as s:
            await asyncio.gather(*(one(i, n_out, s) for i, n_out in enumerate(lengths)))
        await _drained(c)

        # Every completion was recorded in the shared store, in the request's class.
        probe = RequestInfo(request_id="probe", model=MODEL, prompt_tokens=12, max_tokens=cap)
        keys = gw.estimator.class_keys(probe)
        assert keys[0] == f"m={MODEL}|p=256|a={asked_bucket(cap)}"
        stored = await gw.store.output_histograms(keys)
        assert histogram_quantiles(stored[keys[0]], [0.5])[0] == n
        assert {int(k): int(v) for k, v in stored[keys[0]].items()} == _bucket_counts(lengths)

        true_p50, true_p90 = _true_quantile(lengths, 0.5), _true_quantile(lengths, 0.9)
        estimate = gw.estimator.estimate(probe, stored)
        assert estimate.source == f"class {keys[0]}"
        p90, p50 = estimate.quantiles[0.9], estimate.quantiles[0.5]
        assert p90 == bucket_of(true_p90)  # exactly the true p90's bucket
        assert true_p90 <= p90 <= 1.15 * true_p90, (p90, true_p90)
        assert true_p50 <= p50 <= 1.15 * true_p50, (p50, true_p50)
        assert estimate.reserve_tokens == p90 <= cap // 2  # far below max_tokens

        # The router's own cache (what the request path reads) converges on the same estimate.
        async def cache_agrees() -> bool:
            cached = await gw.histograms.get(keys)
            return gw.estimator.estimate(probe, cached).reserve_tokens == p90

        await _until(cache_agrees, "the router's histogram cache to catch up")

        # A new request through the router reserves for the learned p90, not for max_tokens.
        before = await _predicted_buckets(c)
        assert before["1024.0"] - before["512.0"] >= 1  # the cold requests reserved max_tokens
        async with aiohttp.ClientSession() as s:
            got = await _post(
                s, c, _body("one more question", cap), "after", {"X-Sim-Output-Tokens": "50"}
            )
        assert got["usage"]["completion_tokens"] == 50
        after = await _predicted_buckets(c)
        delta = {le: after[le] - before.get(le, 0.0) for le in after}
        assert delta["+Inf"] == 1
        lowest = min((float(le) for le, d in delta.items() if d == 1), default=math.inf)
        assert p90 <= lowest <= cap // 2, delta
        await _drained(c)


def _bucket_counts(lengths: list[int]) -> dict[int, int]:
    out: dict[int, int] = {}
    for n in lengths:
        out[bucket_of(n)] = out.get(bucket_of(n), 0) + 1
    return out
