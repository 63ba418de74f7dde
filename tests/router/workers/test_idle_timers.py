"""An idle router's own timers (issue 36; docs/benchmarks-overhead.md, idle): the LoRA poll and
aiohttp's TLS clean-up wake it only when a worker needs them, which may join at run time.
Live routers in front of simulated workers; workers join through the admin API."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp

from disagg_tools.sim.lora import LoraConfig
from disagg_tools.sim.worker import WorkerConfig, running_worker
from router.config import settings_from_mapping
from router.edge.wiring import TLS_CLOSE_LEAKS, UpstreamConnector
from router.workers.loras import LoraBook
from router.workers.membership import Membership
from tests.conftest import MODEL, SimCluster, sim_cluster

TOKEN = "s3cret-admin"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
POLL_S = 0.2
LORA = LoraConfig(
    enabled=True, max_loras=4, modules=(("sql", "/loras/sql"),), runtime_loading=True, load_s=0.5
)


def _loras(c: SimCluster) -> LoraBook:
    return c.parts.pools.placement.loras


def _lora_worker() -> Any:
    return running_worker(
        WorkerConfig(
            role="decode",
            worker_id="d-lora",
            model=MODEL,
            time_scale=500.0,
            kv_blocks=4096,
            kv_lease_s=30.0 * 500,
            lora=LORA,
        )
    )


async def _until(check: Any, within_s: float) -> float:
    """Seconds until `check()` holds; AssertionError past `within_s`."""
    start = time.monotonic()
    while not check():
        assert time.monotonic() - start < within_s, f"not within {within_s} s"
        await asyncio.sleep(0.01)
    return time.monotonic() - start


async def test_no_lora_poll_without_lora_workers_and_one_joining_later_is_polled() -> None:
    """No worker has `max_loras`: the LoRA poll has not run again over 6 of its periods. A LoRA
    engine registered through the admin API wakes it: its adapters are read from the engine
    (not at start-up: it was not there), one loaded on the engine afterwards is seen within
    `lora.poll_s`; once the engine is removed, the poll stops again."""
    settings: dict[str, Any] = {"auth": {"admin_token": TOKEN}, "lora": {"poll_s": POLL_S}}
    async with (
        sim_cluster(redis_prefix=None, **settings) as c,
        _lora_worker() as url,
        aiohttp.ClientSession() as s,
    ):
        loras = _loras(c)
        await asyncio.sleep(6 * POLL_S)
        assert loras.rounds == 1  # its start, then asleep without a timer
        assert loras.adapters() == {}

        entry = {"id": "d-lora", "url": url, "role": "decode", "adapter": "sim"}
        entry |= {"kv_blocks": 4096, "max_loras": LORA.max_loras}
        async with s.post(c.router_url + "/admin/workers", json=entry, headers=AUTH) as r:
            assert r.status == 201, await r.text()
        # In rotation on its first passing probe, read at the next poll.
        await _until(lambda: "sql" in loras.adapters(), within_s=POLL_S + 5.0)
        assert loras.rounds > 1
        assert loras.held_by(c.parts.pools.workers["d-lora"].spec) == {"sql": MODEL}

        # The promise: an adapter registered on the engine is seen within lora.poll_s (the
        # slack: a loaded test machine's scheduling).
        body = {"lora_name": "fr", "lora_path": "/loras/fr"}
        async with s.post(url + "/v1/load_lora_adapter", json=body) as r:
            assert r.status == 200, await r.text()
        seen_s = await _until(lambda: "fr" in loras.adapters(), within_s=POLL_S + 1.0)
        assert seen_s <= POLL_S + 0.25, seen_s

        async with s.delete(c.router_url + "/admin/workers/d-lora", headers=AUTH) as r:
            assert r.status == 200, await r.text()
        await _until(lambda: loras.adapters() == {}, within_s=POLL_S + 2.0)
        rounds = loras.rounds
        await asyncio.sleep(6 * POLL_S)
        assert loras.rounds == rounds  # asleep again without a timer


async def test_tls_clean_up_only_once_a_worker_over_https_may_be_called() -> None:
    """http:// workers: no clean-up timer (on Python < 3.12.8 it would wake the router every
    2 s). A registration of an https worker turns it on before the router first calls it,
    already for the layout read of `discover_layout` (which fails here: nothing listens), and
    it stays on. Where CPython no longer leaks closed TLS connections, it stays off."""
    async with (
        sim_cluster(redis_prefix=None, auth={"admin_token": TOKEN}) as c,
        aiohttp.ClientSession() as s,
    ):
        connector = c.parts.requests.legs.session.connector
        assert isinstance(connector, UpstreamConnector)
        assert not connector.cleans_closed_tls
        assert connector._cleanup_closed_handle is None

        # 127.0.0.1:9 (discard): nothing answers, the layout read fails, nothing is added.
        entry = {"id": "d-tls", "url": "https://127.0.0.1:9", "role": "decode", "adapter": "sim"}
        entry |= {"kv_blocks": 4096, "discover_layout": True}
        async with s.post(c.router_url + "/admin/workers", json=entry, headers=AUTH) as r:
            assert r.status == 400, await r.text()
        assert "d-tls" not in c.parts.pools.workers
        assert connector.cleans_closed_tls is TLS_CLOSE_LEAKS
        assert (connector._cleanup_closed_handle is not None) is TLS_CLOSE_LEAKS

        # Joined (out of rotation: it does not answer its probe), then removed: still on.
        entry.pop("discover_layout")
        entry |= {"layout": {"engine_version": "0.0.0-sim"}}
        async with s.post(c.router_url + "/admin/workers", json=entry, headers=AUTH) as r:
            assert r.status == 201, await r.text()
        async with s.delete(c.router_url + "/admin/workers/d-tls", headers=AUTH) as r:
            assert r.status == 200, await r.text()
        assert connector.cleans_closed_tls is TLS_CLOSE_LEAKS


async def test_a_configured_https_worker_has_it_on_from_the_start() -> None:
    raw = {
        "model": MODEL,
        "workers": [
            {"id": "p0", "url": "http://127.0.0.1:9", "role": "prefill"},
            {"id": "d0", "url": "HTTPS://127.0.0.1:9", "role": "decode", "kv_blocks": 64},
        ],
    }
    plain = UpstreamConnector(4)
    members = Membership(settings_from_mapping({**raw, "workers": raw["workers"][:1]}))
    members.on_join(plain.reach)
    tls = UpstreamConnector(4)
    Membership(settings_from_mapping(raw)).on_join(tls.reach)
    try:
        assert not plain.cleans_closed_tls
        assert tls.cleans_closed_tls is TLS_CLOSE_LEAKS
    finally:
        await plain.close()
        await tls.close()
