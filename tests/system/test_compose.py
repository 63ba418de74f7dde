"""docker-compose.yml, proven without a Docker engine (issue 13).

Every service built from this repository (both router replicas and the four simulated workers)
runs its `command` and `environment` from the file as a local process, with `redis` as a private
`redis-server` running its command (tests/compose_services.py says how each part maps). A
streaming chat request through each router replica, with the official `openai` client, must
bring back the simulated workers' exact text; afterwards the shared Redis holds no reservation,
lease or stranded KV. The file's Grafana provisioning must point at what the file runs.
"""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import pytest
import redis.asyncio as aioredis
import yaml
from openai import AsyncOpenAI

from disagg_tools.sim.textgen import expected_answer
from state import Keys
from tests.compose_services import ROOT, ComposeCluster, ComposeError, load_compose

CHAT = "/v1/chat/completions"
OURS = [name for name, svc in load_compose().items() if "build" in svc]
ROUTERS = [name for name in OURS if load_compose()[name]["command"][0] == "serve"]


def test_the_file_runs_our_image_for_routers_and_workers() -> None:
    services = load_compose()
    assert ROUTERS == ["router-a", "router-b"]
    assert {services[n]["command"][0] for n in OURS} == {"serve", "worker"}
    # The router's config is the mounted deploy file, and every worker it names is a service.
    config = yaml.safe_load((ROOT / "deploy" / "cluster.yaml").read_text())
    hosts = {w["url"].split("//", 1)[1].split(":")[0] for w in config["workers"]}
    assert hosts <= set(services), hosts - set(services)


async def _leftovers(redis_url: str, config: dict[str, object]) -> dict[str, int]:
    keys = Keys(str(config.get("key_prefix", "dr:")))
    workers = config["workers"]
    assert isinstance(workers, list)
    out: dict[str, int] = {}
    client = aioredis.from_url(redis_url)
    try:
        for w in workers:
            wid = w["id"]
            if w["role"] == "decode":
                out[f"{wid} sum"] = int(await client.get(keys.decode_sum(wid)) or 0)
                out[f"{wid} res"] = int(await client.hlen(keys.decode_blocks(wid)))
                out[f"{wid} lease"] = int(await client.zcard(keys.decode_leases(wid)))
            else:
                out[f"{wid} stranded"] = int(await client.get(keys.stranded_sum(wid)) or 0)
                out[f"{wid} entries"] = int(await client.hlen(keys.stranded_bytes(wid)))
    finally:
        await client.aclose()
    return out


async def test_every_service_of_the_compose_file_serves(tmp_path: Path) -> None:
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed (.ci/run installs it)")
    services = [*OURS, "redis"]
    with ComposeCluster(tmp_path, services=services) as cluster:
        assert set(cluster.running) == set(services)
        redis_url = cluster.env["router-a"]["DISAGG_ROUTER_STORE_URL"]
        assert redis_url == f"redis://127.0.0.1:{cluster.ports['redis']}/0"
        config = yaml.safe_load(cluster.mounts["deploy/cluster.yaml"].read_text())
        for i, router in enumerate(ROUTERS):
            body = {
                "model": config["model"],
                "messages": [{"role": "user", "content": f"hello through {router} ({i})"}],
                "max_tokens": 24,
                "stream": True,
            }
            want, n_tokens, finish = expected_answer(CHAT, body)
            client = AsyncOpenAI(base_url=cluster.url(router) + "/v1", api_key="unused")
            try:
                stream = await client.chat.completions.create(
                    model=body["model"],
                    messages=body["messages"],  # type: ignore[arg-type]
                    max_tokens=body["max_tokens"],
                    stream=True,
                    timeout=30,
                )
                pieces: list[str] = []
                reasons: list[str] = []
                async for chunk in stream:
                    for choice in chunk.choices:
                        pieces.append(choice.delta.content or "")
                        if choice.finish_reason:
                            reasons.append(choice.finish_reason)
            finally:
                await client.close()
            assert "".join(pieces) == want, (router, cluster.tail(router))
            assert reasons == [finish], (router, reasons)
            assert n_tokens > 0

        # Releases land as each handler unwinds, a moment after the last byte.
        for _ in range(100):
            left = await _leftovers(redis_url, config)
            if not any(left.values()):
                break
            await asyncio.sleep(0.05)
        assert not any(left.values()), left


def test_grafana_provisioning_points_at_the_files_services() -> None:
    services = load_compose()
    grafana = services["grafana"]
    mounts = dict(v.split(":")[:2] for v in grafana["volumes"])
    datasources = yaml.safe_load(
        (ROOT / "deploy/grafana/provisioning/datasources/prometheus.yml").read_text()
    )["datasources"]
    assert [d["url"] for d in datasources] == ["http://prometheus:9090"]
    assert "prometheus" in services and "9090:9090" in services["prometheus"]["ports"]
    providers = yaml.safe_load(
        (ROOT / "deploy/grafana/provisioning/dashboards/dashboards.yml").read_text()
    )["providers"]
    dashboards_dir = {dst: src for src, dst in mounts.items()}[providers[0]["options"]["path"]]
    dashboards = sorted((ROOT / dashboards_dir).glob("*.json"))
    assert dashboards, dashboards_dir
    for path in dashboards:
        doc = json.loads(path.read_text())
        assert doc["uid"] and doc["panels"], path


@pytest.mark.parametrize("name", OURS)
def test_our_services_have_healthchecks(name: str) -> None:
    assert load_compose()[name]["healthcheck"]["test"][0] == "CMD"


def test_the_mapping_rewrites_service_addresses_and_refuses_wrong_ports(tmp_path: Path) -> None:
    cluster = ComposeCluster(tmp_path)
    p, r = cluster.ports["prefill-0"], cluster.ports["redis"]
    assert cluster.rewrite("http://prefill-0:8000/x") == f"http://127.0.0.1:{p}/x"
    assert cluster.rewrite("redis://redis:6379/0") == f"redis://127.0.0.1:{r}/0"
    # A healthcheck runs inside its container: its own 127.0.0.1 is the service.
    assert cluster.rewrite("http://127.0.0.1:8000/health", own="prefill-0").endswith(f":{p}/health")
    with pytest.raises(ComposeError, match="does not listen on 9999"):
        cluster.rewrite("http://decode-0:9999")
