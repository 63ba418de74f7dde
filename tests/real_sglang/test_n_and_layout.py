"""Issue 23 on real SGLang engines: `n` > 1, which SGLang's PD pairs do not serve (refused with a
400, not a hang), and
the KV layout each engine reports in `/server_info` (engine, version, model, dtype, page size,
transfer backend) read by the router, which pairs only workers whose layouts match."""

from __future__ import annotations

import aiohttp
import orjson
import pytest

from tests.real_sglang.conftest import (
    SERVED,
    SGLANG_VERSION,
    SglangCluster,
    server_info,
    sglang_router,
    unique_prompt,
)
from tests.real_sglang.test_outputs import ask

pytestmark = pytest.mark.real_sglang


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
async def test_n_above_one_is_refused_clearly(
    sglang_cluster: SglangCluster, redis_prefix: str, stream: bool
) -> None:
    """SGLang 0.5.23 serves n > 1 by sending a prefix warm-up and the n samples under the
    request's one bootstrap room (`tokenizer_manager.py`, parallel sampling); on a PD pair the
    decode then waits for KV that never comes (seen here: each attempt timed out). The router
    refuses it up front with a 400 on `n`, sends nothing and holds nothing."""
    body = {
        "model": SERVED,
        "prompt": unique_prompt(14),
        "max_tokens": 24,
        "temperature": 0,
        "n": 2,
        "stream": stream,
    }
    async with (
        sglang_router(sglang_cluster, redis_prefix) as r,
        aiohttp.ClientSession() as s,
        s.post(r.url + "/v1/completions", json=body) as resp,
    ):
        assert resp.status == 400, await resp.text()
        error = orjson.loads(await resp.read())["error"]
        assert error["param"] == "n"
        assert set((await r.reserved_blocks()).values()) == {0}
    assert sum(s.running_requests() for s in sglang_cluster.pd) == 0


async def test_the_layout_is_read_from_server_info_and_pairs_the_engines(
    sglang_cluster: SglangCluster, redis_prefix: str
) -> None:
    info = server_info(sglang_cluster.prefill)
    assert info["version"] == SGLANG_VERSION
    # discover_layout: each engine's own report is its layout (nothing configured).
    discovering = {"discover_layout": True}
    async with sglang_router(sglang_cluster, redis_prefix, worker_extra=discovering) as r:
        workers = r.parts.pools.workers
        layouts = {wid: w.spec.layout for wid, w in workers.items()}
        for wid, layout in layouts.items():
            assert (layout.engine, layout.engine_version, layout.model) == (
                "sglang",
                SGLANG_VERSION,
                SERVED,
            ), wid
            assert (layout.block_size, layout.connector) == (1, "mooncake"), (
                wid
            )  # SGLang reports mooncake_tcp as "mooncake"
        assert len({layout.key for layout in layouts.values()}) == 1
        assert r.parts.pools.members.unpaired() == []
        assert workers["p0"].spec.bootstrap_port == info["disaggregation_bootstrap_port"]
        async with r.client() as client:
            text, _ = await ask(client, "chat", unique_prompt(8), stream=True)
        assert text
