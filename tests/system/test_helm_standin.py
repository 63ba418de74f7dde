"""The rendered router Deployment starts the router against the stand-in API server: the
chart's own arguments (`serve --config ... --host ... --port ...`, the image's entrypoint
`disagg-router`), its ConfigMap's file and its environment, with only what a cluster would give
changed — the API server's address (`KUBECONFIG`, as no service account is mounted here), the
Redis the test runs on, a free port. The sim-quickstart example's pods are simulated workers
labelled as its selectors want; the router discovers them and serves a request through them.

Skipped without helm (scripts/install_k8s_tools.sh), as tests/system/test_helm.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from disagg_tools.kubeapi.kubeconfig import write_kubeconfig
from disagg_tools.kubeapi.server import running_kubeapi
from disagg_tools.sim.textgen import expected_answer
from disagg_tools.sim.worker import WorkerConfig, running_worker
from tests.conftest import MODEL, REDIS_URL, free_port
from tests.router.request.test_faults import sse_text
from tests.system.test_helm import (
    EXAMPLES,
    _container_env,
    of_kind,
    render,
    router_deployment,
)
from tests.system.test_helm import pytestmark as pytestmark  # skipped without helm

CHAT = "/v1/chat/completions"


async def test_the_rendered_deployment_discovers_and_serves(
    tmp_path: Path, redis_prefix: str
) -> None:
    objects = render(str(EXAMPLES / "sim-quickstart.values.yaml"))
    config = yaml.safe_load(of_kind(objects, "ConfigMap")[0]["data"]["config.yaml"])
    discovery = config["discovery"]
    container = router_deployment(objects)["spec"]["template"]["spec"]["containers"][0]
    args: list[str] = list(container["args"])
    config_path = tmp_path / "config.yaml"
    config_path.write_text(yaml.safe_dump(config))
    port = free_port()
    args[args.index("--config") + 1] = str(config_path)
    args[args.index("--host") + 1] = "127.0.0.1"
    args[args.index("--port") + 1] = str(port)

    def labels(selector: str) -> dict[str, str]:
        return dict(term.split("=", 1) for term in selector.split(","))

    async with contextlib.AsyncExitStack() as stack, asyncio.timeout(60):
        kube = await stack.enter_async_context(running_kubeapi())
        for role, name in (("prefill", "sim-prefill-0"), ("decode", "sim-decode-0")):
            cfg = WorkerConfig(role=role, worker_id=name, model=MODEL, time_scale=500.0,
                               kv_lease_s=15000.0)  # fmt: skip
            url = await stack.enter_async_context(running_worker(cfg))
            kube.add_pod(
                name,
                namespace=discovery["namespace"],
                labels={**labels(discovery[f"{role}_selector"]), "pod-template-hash": "abc"},
                ports={discovery["port_name"]: int(url.rsplit(":", 1)[1])},
                pod_ip="127.0.0.1",
            )
        env = {
            **os.environ,
            **_container_env(router_deployment(objects)),
            # What the cluster would give instead: the API server, the Redis, a prefix.
            "KUBECONFIG": str(write_kubeconfig(tmp_path / "kubeconfig", kube.url)),
            "DISAGG_ROUTER_STORE_URL": REDIS_URL,
            "DISAGG_ROUTER_STORE_KEY_PREFIX": redis_prefix,
        }
        router = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "disagg_tools.launcher.main", *args, env=env,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        )  # fmt: skip
        try:
            await _served(f"http://127.0.0.1:{port}", router)
        finally:
            router.terminate()
            out, _ = await router.communicate()
        assert router.returncode == 0, out.decode(errors="replace")[-3000:]


async def _served(url: str, router: asyncio.subprocess.Process) -> None:
    """Both pods in rotation (from the router's own /admin/workers), then one exact answer."""
    async with aiohttp.ClientSession() as s:
        workers: dict[str, Any] = {}
        while {w for w, v in workers.items() if v["healthy"] and v["layout"]} != {
            "sim-prefill-0",
            "sim-decode-0",
        }:
            assert router.returncode is None, "the router exited"
            await asyncio.sleep(0.1)
            with contextlib.suppress(aiohttp.ClientError):
                async with s.get(url + "/admin/workers") as r:
                    workers = {w["id"]: w for w in (await r.json())["workers"]}
        assert workers["sim-decode-0"]["pod"].endswith("/sim-decode-0")
        assert workers["sim-decode-0"]["revision"] == "abc"
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": "from the chart"}],
            "max_tokens": 12,
            "ignore_eos": True,
            "stream": True,
        }
        async with s.post(url + CHAT, json=body) as r:
            assert r.status == 200
            text, _, errors = sse_text(await r.read())
        assert not errors and text == expected_answer(CHAT, body)[0]
