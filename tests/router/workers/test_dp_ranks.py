"""Data-parallel ranks as placement targets (issue 35; docs/data-parallel.md).

The entry's parsing and expansion, the rank on the wire per engine, KV events per rank (a batch
of a rank its publisher is not: ignored, counted), and live: simulated DP servers (one URL, four
independent engines: disagg_tools/sim/dp_front.py) behind the router under a skewed load, a
fault on one rank, a stream cut on a rank and resumed.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import replace
from pathlib import Path
from typing import Any

import aiohttp
import msgpack
import pytest
import redis.asyncio as aioredis
import zmq.asyncio

from disagg_tools.sim.dp_front import running_dp_worker
from disagg_tools.sim.textgen import expected_answer
from disagg_tools.sim.worker import WorkerConfig
from policies.base import KVLayout
from router.adapters.base import prefill_target
from router.adapters.dp_rank import RANK_HEADER, rank_body, rank_headers
from router.adapters.sglang import SglangAdapter
from router.config import settings_from_mapping
from router.metrics import RouterMetrics
from router.worker_spec import ConfigError, KvEventsSpec, parse_worker
from router.workers.dp_loads import assign_rank_loads, split_sglang_loads, split_vllm_metrics
from router.workers.kv_events import KvEventSubscriber
from router.workers.membership import Membership
from state import Keys, RedisStore
from tests.conftest import MODEL, REDIS_URL, SimCluster, running_router, sim_cluster
from tests.redis_dump import delete_prefix
from tests.router.edge.test_admin import TOKEN, _workers, two_replicas_with_prefill_only
from tests.router.request.test_faults import (
    FAST_RETRY,
    assert_quiet,
    body_for,
    call,
    check_exact,
)
from tests.router.workers.test_kube_discovery import (
    CHAT,
    admin_workers,
    serving_exactly,
    until,
)
from tests.router.workers.test_kube_discovery import Engine as KubeEngine
from tests.router.workers.test_kube_discovery import body as kube_body
from tests.router.workers.test_kube_discovery import chat as kube_chat
from tests.router.workers.test_kube_discovery import fleet as kube_fleet
from tests.router.workers.test_kube_discovery import router_settings as kube_router_settings

RANKS = 4
BLOCKS_PER_RANK = 40  # small: a rank's room binds, and a URL-wide view would overfill one


def _settings(*workers: dict[str, Any]) -> Any:
    return settings_from_mapping(
        {"model": MODEL, "perf": {"model": MODEL, "gpu": "h100"}, "workers": list(workers)}
    )


# --- the entry and its targets ----------------------------------------------------------------


def test_a_dp_entry_expands_into_one_target_per_rank() -> None:
    events = {"endpoint": "tcp://127.0.0.1:5557", "replay_endpoint": "tcp://127.0.0.1:5600"}
    settings = _settings(
        {"id": "p", "url": "http://h:1", "role": "prefill", "dp_size": 2, "kv_events": events},
        {"id": "d", "url": "http://h:2", "role": "decode", "data_parallel_size": 4, "kv_blocks": 9},
        {"id": "solo", "url": "http://h:3", "role": "decode", "kv_blocks": 5},
    )
    members = Membership(settings)
    assert sorted(members.workers) == ["d@0", "d@1", "d@2", "d@3", "p@0", "p@1", "solo"]
    assert members.entry_ids() == {"p", "d", "solo"}
    # kv_blocks is each rank's own pool
    assert [w.capacity_blocks for w in members.ranks_of("d")] == [9, 9, 9, 9]
    assert {w.spec.url for w in members.ranks_of("d")} == {"http://h:2"}
    # each rank's publisher: the entry's ports + rank (vLLM's offset_endpoint_port)
    rank1 = members.workers["p@1"].spec.kv_events
    assert rank1 is not None
    assert (rank1.endpoint, rank1.replay_endpoint) == (
        "tcp://127.0.0.1:5558",
        "tcp://127.0.0.1:5601",
    )
    # one health probe per URL
    assert sorted(w.spec.id for w in members.probe_targets()) == ["d@0", "p@0", "solo"]
    lead = members.workers["d@0"]
    lead.healthy, lead.consecutive_failures = False, 2
    members.follow_lead(lead)
    assert not any(w.healthy for w in members.ranks_of("d"))
    # a rank's breaker is its own: its siblings stay available
    members.follow_lead(lead := members.workers["d@0"])
    lead.healthy = True
    members.follow_lead(lead)
    for _ in range(3):
        members.workers["d@2"].breaker.on_failure()
    assert [w.available for w in members.ranks_of("d")] == [True, True, False, True]
    # an entry re-added with other ranks replaces all of its targets
    spec = members.workers["solo"].spec
    members.add(replace(spec, dp_size=2))
    assert {"solo@0", "solo@1"} <= set(members.workers) and "solo" not in members.workers
    members.add(spec)
    assert "solo" in members.workers and "solo@0" not in members.workers
    # the entry leaves as one; requests still on a rank find it
    assert members.remove("d")
    assert "d@1" not in members.workers and members.worker("d@1").spec.dp_parent == "d"


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ({"dp_size": 0}, "dp_size"),
        ({"data_parallel_size": 2000}, "data_parallel_size"),
        ({"dp_size": 2, "data_parallel_size": 2}, "not both"),
        ({"dp_size": 2, "id": "a@b"}, "'@'"),
        ({"dp_size": 2, "adapter": "sglang", "role": "both"}, "SGLang `both`"),
    ],
)
def test_bad_dp_entries_are_refused(entry: dict[str, Any], message: str) -> None:
    raw = {"id": "w", "url": "http://h:1", "role": "decode", "kv_blocks": 4, **entry}
    with pytest.raises(ConfigError, match=message):
        parse_worker(raw, None, KVLayout())


# --- the rank on the wire ---------------------------------------------------------------------


def test_each_engine_is_told_the_rank_its_own_way() -> None:
    assert rank_headers("vllm", 3) == {RANK_HEADER: "3"}
    assert rank_headers("mooncake", 0) == {RANK_HEADER: "0"}
    assert rank_headers("sim", None) == {}
    assert rank_headers("sglang", 2) == {}  # SGLang reads it from the body
    assert rank_body("sglang", {"a": 1, "data_parallel_rank": 7}, 2) == {
        "a": 1,
        "data_parallel_rank": 2,
    }
    body = {"a": 1}
    assert rank_body("vllm", body, 2) is body
    # SGLang rooms fall on the prefill's rank: the decode finds it as room % dp_size
    adapter = SglangAdapter()
    target = prefill_target("http://10.0.0.1:30000", 8998, None, 3, 4)
    for _ in range(50):
        p, d = adapter.legs({"prompt": "x"}, target)
        assert p["bootstrap_room"] % 4 == 3 and 0 <= p["bootstrap_room"] < 2**63
        assert d["bootstrap_room"] == p["bootstrap_room"]
    p, _ = adapter.legs({"prompt": ["a", "b", "c"]}, target)
    assert [room % 4 for room in p["bootstrap_room"]] == [3, 3, 3]


# --- KV events per rank -----------------------------------------------------------------------


def _batch(rank: int | None, block_hash: int) -> bytes:
    stored = {
        "type": "BlockStored",
        "block_hashes": [block_hash],
        "parent_block_hash": None,
        "token_ids": list(range(16)),
        "block_size": 16,
        "medium": "GPU",
    }
    return bytes(msgpack.packb([1.0, [stored], rank]))


@pytest.mark.parametrize("rank", [None, 1])
async def test_a_batch_of_another_rank_is_ignored_and_counted(rank: int | None) -> None:
    ctx = zmq.asyncio.Context()
    try:
        sub = KvEventSubscriber(
            "w", KvEventsSpec("tcp://127.0.0.1:1"), ctx, RouterMetrics(), rank=rank
        )
        own = rank or 0
        await sub._apply(0, _batch(own, 11))  # its own rank's: applied
        await sub._apply(1, _batch(5, 12))  # a rank it was not declared with: ignored
        await sub._apply(2, _batch(None, 13))  # no rank said (an older engine): applied
        assert len(sub.index) == 2
        assert sub.describe()["foreign_rank"] == 1
        assert sub.batches == 2
    finally:
        ctx.term()


# --- live: simulated DP servers behind the router ---------------------------------------------


async def _rank_states(c: SimCluster, wid: str) -> list[dict[str, Any]]:
    return list((await c.worker_state(wid))["ranks"])


async def _rank_requests(c: SimCluster, wid: str) -> list[dict[str, Any]]:
    return await c.worker_requests(wid)


def _dp_cluster(**settings: Any) -> Any:
    return sim_cluster(
        prefill=1,
        decode=2,
        dp={"p0": RANKS, "d0": RANKS, "d1": RANKS},
        kv_blocks=BLOCKS_PER_RANK,
        **settings,
    )


def _skewed(i: int) -> dict[str, Any]:
    """Every fifth request long (its answer fills most of a rank), the rest short."""
    return body_for(i, max_tokens=400 if i % 5 == 0 else 24)


async def test_a_skewed_load_uses_every_rank_within_its_room(redis_prefix: str) -> None:
    async with _dp_cluster(redis_prefix=redis_prefix, retry=FAST_RETRY) as c:
        targets = sorted(w.spec.id for w in c.parts.pools.decode_workers)
        assert targets == [f"d{i}@{r}" for i in range(2) for r in range(RANKS)]
        bodies = [_skewed(i) for i in range(48)]
        results = await asyncio.gather(*(call(c, b, i % 2 == 0) for i, b in enumerate(bodies)))
        for i, ((status, result), body) in enumerate(zip(results, bodies, strict=True)):
            check_exact(status, result, body, i % 2 == 0)
        for wid in ("d0", "d1"):
            served = await _rank_requests(c, wid)
            # every rank took requests, each told its own rank by the header
            assert {r["dp_rank"] for r in served} == set(range(RANKS))
            for r in served:
                assert r["headers"].get(RANK_HEADER) == str(r["dp_rank"])
            for state in await _rank_states(c, wid):
                # the router's reservations kept each rank within its own pool: no rank ever
                # ran out of KV (the sim preempts a sequence when it does)
                assert state["capacity_blocks"] == BLOCKS_PER_RANK
                assert state["counters"].get("preemptions", 0) == 0, state
        prefill_ranks = {r["dp_rank"] for r in await _rank_requests(c, "p0")}
        assert len(prefill_ranks) > 1  # the prefill's ranks are targets too
        await assert_quiet(c)


async def test_a_failing_rank_is_left_alone_and_its_siblings_serve(redis_prefix: str) -> None:
    breaker = {"failures_to_open": 2, "cooldown_s": 600.0}
    async with _dp_cluster(redis_prefix=redis_prefix, retry=FAST_RETRY, breaker=breaker) as c:
        async with (
            aiohttp.ClientSession() as s,
            s.post(c.workers["d0"] + "/sim/faults?rank=2", json={"error_rate": 1.0}) as r,
        ):
            assert r.status == 200, await r.text()
        pools, concurrency = c.parts.pools, 4

        async def wave(start: int) -> None:
            bodies = [body_for(i, max_tokens=16) for i in range(start, start + concurrency)]
            results = await asyncio.gather(*(call(c, b, True) for b in bodies))
            for (status, result), body in zip(results, bodies, strict=True):
                check_exact(status, result, body, True)  # retried on another rank: exact

        n = 0
        while pools.worker("d0@2").breaker.allows() and n < 400:  # until placement found it
            await wave(n)
            n += concurrency
        assert not pools.worker("d0@2").breaker.allows()
        assert all(pools.worker(f"d0@{r}").available for r in (0, 1, 3))
        before = len([r for r in await _rank_requests(c, "d0") if r["dp_rank"] == 2])
        assert before <= breaker["failures_to_open"] + concurrency - 1
        for start in range(n, n + 40, concurrency):
            await wave(start)
        served = await _rank_requests(c, "d0")
        # nothing reached the rank while its breaker was open; its siblings kept serving
        assert len([r for r in served if r["dp_rank"] == 2]) == before
        assert {r["dp_rank"] for r in served[-20:]} & {0, 1, 3}
        await assert_quiet(c)


async def test_a_stream_cut_on_a_rank_resumes_with_exact_text(redis_prefix: str) -> None:
    async with _dp_cluster(redis_prefix=redis_prefix, retry=FAST_RETRY) as c:
        for wid in ("d0", "d1"):  # each rank's first stream dies after 7 tokens
            async with (
                aiohttp.ClientSession() as s,
                s.post(
                    c.workers[wid] + "/sim/faults", json={"decode_die_after_tokens": 7, "count": 1}
                ) as r,
            ):
                assert r.status == 200, await r.text()
        bodies = [body_for(i, max_tokens=40) for i in range(16)]
        results = await asyncio.gather(*(call(c, b, True) for b in bodies))
        for (status, result), body in zip(results, bodies, strict=True):
            check_exact(status, result, body, True)
        cut = 0
        for wid in ("d0", "d1"):
            for state in await _rank_states(c, wid):
                cut += state["counters"].get("faults:decode_die_after_tokens", 0)
        assert cut >= 1  # streams were cut on ranks, and their clients got the exact text
        await assert_quiet(c)


# --- one registry path: a DP worker registered through the admin API --------------------------


async def test_a_registered_dp_worker_joins_every_replica_as_its_ranks(redis_prefix: str) -> None:
    auth = {"Authorization": f"Bearer {TOKEN}"}
    config = WorkerConfig(
        role="decode",
        worker_id="dd",
        model=MODEL,
        time_scale=500.0,
        kv_blocks=512,
        kv_lease_s=30.0 * 500,
    )
    async with (
        two_replicas_with_prefill_only(redis_prefix, loops={"registry_quiet_wait_s": 0.5}) as (
            a,
            b,
            _,
        ),
        running_dp_worker(config, 2) as d_url,
        aiohttp.ClientSession() as s,
    ):
        entry: dict[str, Any] = {"id": "dd", "url": d_url, "role": "decode", "adapter": "sim"}
        entry |= {"kv_blocks": 512, "dp_size": 2}
        async with s.post(a + "/admin/workers", json=entry, headers=auth) as r:
            assert r.status == 201, await r.text()
            assert (await r.json())["dp_parent"] == "dd"

        def in_rotation(workers: dict[str, dict[str, Any]]) -> bool:
            ranks = [workers.get(f"dd@{r}") for r in range(2)]
            return all(w and w["healthy"] and w["layout"] and w["dp_rank"] == r
                       for r, w in enumerate(ranks))  # fmt: skip

        for _ in range(200):
            if in_rotation(await _workers(s, b)):
                break
            await asyncio.sleep(0.05)
        assert in_rotation(await _workers(s, b)), await _workers(s, b)
        assert "dd" not in await _workers(s, b)  # the entry is its ranks
        body = {"model": MODEL, "messages": [{"role": "user", "content": "dp"}], "max_tokens": 9}
        for _ in range(4):
            async with s.post(b + "/v1/chat/completions", json=body) as r:
                assert r.status == 200, await r.text()
        # the entry's id drains every rank (the only decode worker: forced)
        async with s.post(a + "/admin/workers/dd/drain", headers=auth) as r:
            assert r.status == 409, await r.text()
        async with s.post(a + "/admin/workers/dd/drain", headers=auth, json={"force": True}) as r:
            assert r.status == 200, await r.text()
        workers = await _workers(s, a)
        assert workers["dd@0"]["drained"] and workers["dd@1"]["drained"]
        async with s.post(a + "/admin/workers/dd/undrain", headers=auth) as r:
            assert r.status == 200, await r.text()
        # a rank is not removed alone; the entry leaves with its ranks, on every replica
        async with s.delete(a + "/admin/workers/dd@1", headers=auth) as r:
            assert r.status == 400, await r.text()
        async with s.delete(a + "/admin/workers/dd", headers=auth, json={"force": True}) as r:
            assert r.status == 200, await r.text()
        for _ in range(100):
            if not {"dd@0", "dd@1"} & set(await _workers(s, b)):
                break
            await asyncio.sleep(0.05)
        assert not {"dd@0", "dd@1"} & set(await _workers(s, b))


# --- load reports per rank --------------------------------------------------------------------

VLLM_METRICS = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 0.0
vllm:num_requests_waiting{engine="0",model_name="m"} 2.0
vllm:num_requests_waiting{engine="1",model_name="m"} 0.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.75
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.125
vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="800"} 1.0
vllm:cache_config_info{block_size="16",engine="1",num_gpu_blocks="800"} 1.0
"""


def test_a_dp_servers_report_is_split_by_rank_and_an_undeclared_rank_ignored() -> None:
    loads = split_vllm_metrics(VLLM_METRICS, 1.0)
    assert {r: (x.running, x.waiting, x.kv_usage, x.num_gpu_blocks) for r, x in loads.items()} == {
        0: (3, 2, 0.75, 800),
        1: (0, 0, 0.125, 800),
    }
    sglang = {
        "loads": [
            {"dp_rank": 1, "num_running_reqs": 4, "num_waiting_reqs": 1, "num_used_tokens": 64,
             "max_total_num_tokens": 256},
            {"dp_rank": 0, "num_running_reqs": 0, "num_waiting_reqs": 0, "num_used_tokens": 0,
             "max_total_num_tokens": 256},
        ]
    }  # fmt: skip
    split = split_sglang_loads(sglang, {"page_size": 16}, 1.0)
    assert (split[1].running, split[1].kv_usage, split[1].num_gpu_blocks) == (4, 0.25, 16)
    assert split[0].running == 0
    members = Membership(
        _settings({"id": "d", "url": "http://h:2", "role": "decode", "dp_size": 2, "kv_blocks": 9})
    )
    ranks = members.ranks_of("d")
    hostile = {**loads, 7: loads[0]}  # a server with more ranks than its entry declares
    assert assign_rank_loads(ranks, hostile) == [7]
    assert [w.load for w in ranks] == [loads[0], loads[1]]


def test_the_rank_split_reads_labels_as_the_format_quotes_them() -> None:
    """A `}` or an `engine="…"` inside a quoted label value does not end the labels or name a
    rank (the split used to cut a line at its first `}`); a rank with only histograms in the
    text gets no reading rather than one of 0 running; other families' lines are not read."""
    text = (
        'vllm:num_requests_running{model_name="m}x",engine="0"} 3.0\n'
        'vllm:num_requests_running{model_name="a,engine=\\"5\\"",engine="1"} 4.0\n'
        'vllm:num_requests_waiting{engine="1",model_name="m"} 2.0\n'
        'vllm:time_to_first_token_seconds_bucket{engine="2",le="0.1"} 7.0\n'
        'vllm:num_requests_running{model_name="m"} 9.0\n'
    )
    loads = split_vllm_metrics(text, 1.0)
    assert {r: (x.running, x.waiting) for r, x in loads.items()} == {0: (3, 0), 1: (4, 2)}


async def test_ranks_are_learned_from_the_server_and_polled_each_its_own(
    redis_prefix: str,
) -> None:
    auth = {"Authorization": f"Bearer {TOKEN}"}
    config = WorkerConfig(
        role="decode",
        worker_id="dd",
        model=MODEL,
        time_scale=500.0,
        kv_blocks=300,
        kv_lease_s=30.0 * 500,
    )
    async with (
        two_replicas_with_prefill_only(redis_prefix) as (a, _, _),
        running_dp_worker(config, 3) as d_url,
        aiohttp.ClientSession() as s,
    ):
        # no dp_size given: discover_layout reads it from the server (its engines in /metrics)
        entry = {"id": "dd", "url": d_url, "role": "decode", "adapter": "sim", "kv_blocks": 300}
        async with s.post(
            a + "/admin/workers",
            # its engine version as the prefill's is configured: the pair's layouts match
            json={**entry, "discover_layout": True, "layout": {"engine_version": "0"}},
            headers=auth,
        ) as r:
            assert r.status == 201, await r.text()
        workers = await _workers(s, a)
        assert [workers[f"dd@{r}"]["dp_rank"] for r in range(3)] == [0, 1, 2]
        assert "dd@3" not in workers
        body = {"model": MODEL, "messages": [{"role": "user", "content": "dp"}], "max_tokens": 400}
        # the loads are polled while the replica is busy: requests go on until a poll has come

        async def busy() -> None:
            while True:
                async with s.post(a + "/v1/chat/completions", json=body) as r:
                    assert r.status == 200, await r.text()

        load = asyncio.gather(*(busy() for _ in range(4)))
        try:
            for _ in range(400):
                workers = await _workers(s, a)
                if all(workers[f"dd@{rank}"]["reported_load"] for rank in range(3)):
                    break
                await asyncio.sleep(0.05)
        finally:
            load.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await load
        # one poll of the URL, each rank its own report
        for rank in range(3):
            assert workers[f"dd@{rank}"]["reported_load"] is not None, workers


# --- SGLang: the rank in the body, the room on the prefill's rank -----------------------------


async def test_sglang_dp_pairs_meet_on_the_prefill_rank_the_room_names(redis_prefix: str) -> None:
    def config(role: str, wid: str, **extra: Any) -> WorkerConfig:
        fields: dict[str, Any] = {"model": MODEL, "time_scale": 500.0, "kv_blocks": 256}
        return WorkerConfig(role=role, worker_id=wid, kv_lease_s=30.0 * 500, **fields, **extra)

    async with contextlib.AsyncExitStack() as stack:
        p_url = await stack.enter_async_context(
            running_dp_worker(config("prefill", "p0", bootstrap_port=0), RANKS)
        )
        d_url = await stack.enter_async_context(running_dp_worker(config("decode", "d0"), 2))
        workers = [  # the prefill's bootstrap port read from its /server_info: the front's
            {"id": "p0", "url": p_url, "role": "prefill", "adapter": "sglang", "dp_size": RANKS},
            {"id": "d0", "url": d_url, "role": "decode", "adapter": "sglang", "dp_size": 2,
             "kv_blocks": 256},
        ]  # fmt: skip
        raw = {
            "model": MODEL,
            "perf": {"model": MODEL, "gpu": "h100"},
            "store": {"url": REDIS_URL, "key_prefix": redis_prefix},
            "loops": {"health_interval_s": 0.5},
            "workers": workers,
        }
        url, _ = await stack.enter_async_context(running_router(settings_from_mapping(raw)))
        s = await stack.enter_async_context(aiohttp.ClientSession())
        bodies = [body_for(i, max_tokens=12) for i in range(24)]

        async def one(body: dict[str, Any]) -> tuple[int, Any]:
            async with s.post(url + "/v1/chat/completions", json=body) as r:
                return r.status, await r.json()

        for (status, result), body in zip(
            await asyncio.gather(*(one(b) for b in bodies)), bodies, strict=True
        ):
            check_exact(status, result, body, False)
        for wid, base, size in (("p0", p_url, RANKS), ("d0", d_url, 2)):
            async with s.get(base + "/sim/requests") as r:
                served = await r.json()
            assert {r["dp_rank"] for r in served} == set(range(size)), wid
            for r in served:  # each leg sent to the rank the router chose, told in the body
                assert r["body"]["data_parallel_rank"] == r["dp_rank"]
                if wid == "p0":  # and every room falls on the prefill's rank
                    assert r["body"]["bootstrap_room"] % RANKS == r["dp_rank"]


# --- Kubernetes discovery: a data-parallel pod ------------------------------------------------


async def test_a_dp_pod_is_discovered_as_its_ranks_and_leaves_as_one(
    tmp_path: Path, redis_prefix: str
) -> None:
    async with asyncio.timeout(60), kube_fleet(tmp_path) as f:
        await f.pod("p0", "prefill")
        cfg = WorkerConfig(
            role="decode", worker_id="d0", model=MODEL, kv_blocks=512, time_scale=500.0,
            kv_lease_s=30.0 * 500,
        )  # fmt: skip
        url = await f.stack.enter_async_context(running_dp_worker(cfg, 2))
        f.engines["d0"] = KubeEngine("d0", "decode", url, cfg)
        await f.pod("d0", "decode")
        # discover_layout: the pod's server tells its 2 ranks (its engines in /metrics)
        settings = kube_router_settings(f, redis_prefix, discovery={"discover_layout": True})
        async with running_router(settings) as (router, _), aiohttp.ClientSession() as s:
            await serving_exactly(router, {"p0", "d0@0", "d0@1"})
            for i in range(6):
                b = kube_body(f"dp pod {i}")
                assert await kube_chat(s, router, b) == (200, expected_answer(CHAT, b)[0])
            f.kube.set_ready("d0", False)  # its pod out of rotation: every rank
            await serving_exactly(router, {"p0"}, within_s=5)
            f.kube.set_ready("d0", True)
            await serving_exactly(router, {"p0", "d0@0", "d0@1"})
            f.kube.delete_pod("d0")
            await serving_exactly(router, {"p0"}, within_s=5)

            async def gone() -> bool:
                return not {"d0@0", "d0@1"} & set(await admin_workers(router))

            await until(gone, 5, "d0's ranks removed")


async def test_a_dp_registration_survives_a_store_that_lost_its_data(redis_prefix: str) -> None:
    """The store lost its data: each replica puts back the entry's one registration (not one
    per rank), and the ranks stay in the pools of both. The keys are deleted under a Redis that
    keeps running, which a quiet replica notices within `loops.registry_quiet_wait_s` (a
    restart breaks its change feed's connection: at once); the wait is short here, as the
    test's bound."""
    auth = {"Authorization": f"Bearer {TOKEN}"}
    config = WorkerConfig(
        role="decode", worker_id="dd", model=MODEL, time_scale=500.0, kv_blocks=512,
        kv_lease_s=30.0 * 500,
    )  # fmt: skip
    async with (
        two_replicas_with_prefill_only(redis_prefix, loops={"registry_quiet_wait_s": 0.5}) as (
            a,
            b,
            _,
        ),
        running_dp_worker(config, 2) as d_url,
        aiohttp.ClientSession() as s,
    ):
        entry = {"id": "dd", "url": d_url, "role": "decode", "adapter": "sim", "kv_blocks": 512}
        async with s.post(a + "/admin/workers", json={**entry, "dp_size": 2}, headers=auth) as r:
            assert r.status == 201, await r.text()
        ranks = {"dd@0", "dd@1"}

        async def both_serve() -> bool:
            for replica in (a, b):
                workers = await _workers(s, replica)
                if not all(w in workers and workers[w]["healthy"] for w in ranks):
                    return False
            return True

        await until(both_serve, 10, "both replicas serve dd's ranks")
        await delete_prefix(REDIS_URL, redis_prefix)  # the store lost everything
        client = aioredis.Redis.from_url(REDIS_URL)
        store = RedisStore(client, Keys(redis_prefix))
        try:

            async def put_back() -> bool:
                return set(await store.registered_workers()) == {"dd"}

            await until(put_back, 30, "the registration put back under the entry's id")
            for _ in range(10):  # and it stays so, a few registry syncs later
                assert set(await store.registered_workers()) == {"dd"}
                assert await both_serve()
                await asyncio.sleep(0.1)
        finally:
            await client.aclose()
        body = {"model": MODEL, "messages": [{"role": "user", "content": "dp"}], "max_tokens": 5}
        async with s.post(b + "/v1/chat/completions", json=body) as r:
            assert r.status == 200, await r.text()
