"""Fixtures for the suite against real SGLang engines (SGLang 0.5.23 on CPU, Mooncake over TCP).

Four engines are started once for this package from the venv and the tiny model that
`scripts/prepare_real_sglang.sh` prepares, and stopped at the end: `ref` (a plain server, the
single-engine reference), `p0` (prefill, with its bootstrap server) and `d0`, `d1` (decode),
the pairs speaking Mooncake's `mooncake_tcp` transfer. A router (SGLang adapter, Redis state
under a key prefix of its own) is started in this process for each test. When the prepared
environment is absent every test here is skipped with the reason; `REAL_SGLANG=0` skips it even
when it is present.

The engine-side workarounds (docs/real-sglang.md) are in `engine_site/`, put first on the
engines' PYTHONPATH: a stand-in `sgl_kernel` for the two CPU ops this path calls, and the
Mooncake sender's host-tensor path switched off at load time. `--sleep-on-idle`: an idle SGLang
scheduler otherwise polls its queues and takes a whole core per engine.

Environment:
  REAL_SGLANG_HOME           where the venv and model are (default: <repo>/.real-sglang)
  REAL_SGLANG=0              skip this suite
  REAL_SGLANG_START_TIMEOUT  seconds to wait for the servers to be ready (default 600)
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from openai import AsyncOpenAI

import tests.conftest as top_conftest
from router.config import merged_settings, settings_from_mapping
from tests.app_parts import AppParts
from tests.conftest import free_port, running_router
from tests.engines import EngineProcess, EngineSuite, http_get

HERE = Path(__file__).resolve().parent
ENGINE_SITE = HERE / "engine_site"
REPO = HERE.parents[1]
HOME = Path(os.environ.get("REAL_SGLANG_HOME") or REPO / ".real-sglang")
PYTHON = HOME / "venv" / "bin" / "python"
MODEL_DIR = HOME / "model"
SERVED = "tiny-llama"
SGLANG_VERSION = "0.5.23"
MAX_TOTAL_TOKENS = 8192  # each engine's KV pool, in tokens (page size 1)
START_TIMEOUT_S = float(os.environ.get("REAL_SGLANG_START_TIMEOUT", "600"))
TEST_TIMEOUT_S = 900


SUITE = EngineSuite("SGLang", HERE, HOME, TEST_TIMEOUT_S)
missing_reason = SUITE.missing_reason


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    SUITE.mark(items)


@dataclass
class SglangServer(EngineProcess):
    """One `python -m sglang.launch_server` process group on loopback; `mode` prefill or
    decode (a PD pair over mooncake_tcp) or None (a plain server)."""

    KIND = "SGLang server"
    ROUTINE = ('"GET /health', '"GET /metrics', "UserWarning", "warnings.warn")

    name: str
    mode: str | None
    workdir: Path
    # --enable-pd-role-switch: POST /pd_role_switch flips it at run time; it then runs its
    # bootstrap server in decode mode too (so it needs a port of its own there as well).
    role_switch: bool = False
    port: int = field(default_factory=free_port)
    bootstrap_port: int = field(default_factory=free_port)
    proc: Any = None
    started_at: float = 0.0
    ready_after_s: float | None = None

    def command(self) -> list[str]:
        cmd = [
            str(PYTHON),
            "-m",
            "sglang.launch_server",
            "--model-path",
            str(MODEL_DIR),
            "--served-model-name",
            SERVED,
            "--device",
            "cpu",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            # The CPU path: no overlap scheduler (it needs CUDA streams), no grammar backend.
            "--disable-overlap-schedule",
            "--grammar-backend",
            "none",
            "--max-total-tokens",
            str(MAX_TOTAL_TOKENS),
            "--random-seed",
            "0",
            "--sleep-on-idle",
            "--enable-metrics",
            # SGLang's own pick for its torch.distributed store is a random port below the
            # ephemeral range, checked free in the launcher and bound seconds later by the
            # scheduler: with four engines starting at once, one's was taken by then (a
            # clean-clone run: "EADDRINUSE" on port 27917, server d1 exited, the suite's 14
            # tests errored). A fresh port of ours at each start, never one this process
            # handed out before (tests/ports.py).
            "--nccl-port",
            str(free_port()),
        ]
        if self.mode is not None:
            cmd += [
                "--disaggregation-mode",
                self.mode,
                "--disaggregation-transfer-backend",
                "mooncake_tcp",
            ]
        if self.mode == "prefill" or self.role_switch:
            cmd += ["--disaggregation-bootstrap-port", str(self.bootstrap_port)]
        if self.role_switch:
            cmd += ["--enable-pd-role-switch"]
        if self.mode == "decode":
            # The default retraction backup registers CUDA host memory at start-up.
            cmd += ["--disaggregation-decode-retraction-backup", "cpu_tensor"]
        return cmd

    def environment(self) -> dict[str, str]:
        env = {
            k: v
            for k, v in os.environ.items()
            if k.lower() not in ("http_proxy", "https_proxy", "all_proxy")
            and not k.startswith(("VIRTUAL_ENV", "PYTEST", "DISAGG_", "REAL_VLLM"))
        }
        cache = self.workdir / f"{self.name}-cache"
        env.update(
            PATH=f"{PYTHON.parent}:{env.get('PATH', '/usr/bin:/bin')}",
            SGLANG_USE_CPU_ENGINE="1",
            PYTHONPATH=os.pathsep.join(p for p in (str(ENGINE_SITE), env.get("PYTHONPATH")) if p),
            # One OpenMP thread per engine: four engines share 2 cores.
            OMP_NUM_THREADS="1",
            HF_HUB_OFFLINE="1",
            TRANSFORMERS_OFFLINE="1",
            XDG_CACHE_HOME=str(cache),
            TRITON_CACHE_DIR=str(cache / "triton"),
            NO_PROXY="*",
        )
        return env

    def running_requests(self) -> int:
        """Requests the engine holds right now, from its scheduler (`/v1/loads`): running,
        waiting, and in the PD queues (bootstrap, prealloc, transfer, retracted). Its
        Prometheus gauges are set only at each log interval, so they lag."""
        import json

        status, body = http_get(self.url + "/v1/loads", timeout=10.0)
        assert status == 200, body[:200]
        total = 0
        for load in json.loads(body)["loads"]:
            total += int(load.get("num_running_reqs", 0)) + int(load.get("num_waiting_reqs", 0))
            queues = load.get("disaggregation") or {}
            total += sum(int(v) for k, v in queues.items() if k.endswith("_queue_reqs"))
        return total


@dataclass
class SglangCluster:
    ref: SglangServer
    prefill: SglangServer
    decodes: list[SglangServer]
    workdir: Path
    restarts: int = 0

    @property
    def servers(self) -> list[SglangServer]:
        return [self.ref, self.prefill, *self.decodes]

    @property
    def pd(self) -> list[SglangServer]:
        return [self.prefill, *self.decodes]

    def ensure_running(self) -> None:
        """Restart any server a previous test killed (new ports: a killed engine's bootstrap
        and Mooncake ports may linger)."""
        dead = [s for s in self.servers if not s.answers_health()]
        for s in dead:
            s.stop()
            s.port, s.bootstrap_port = free_port(), free_port()
            s.start()
            self.restarts += 1
        deadline = time.monotonic() + START_TIMEOUT_S
        for s in dead:
            s.wait_ready(deadline)

    def flush_prefix_caches(self) -> None:
        """Empty the radix cache of the engines that prefill (the reference and the PD prefill),
        so a test's prompts are computed from scratch on both. A cached prefix takes another
        compute path (its KV read back, the rest prefilled in a chunk), and on this tiny random
        model's near-tied logits a different float order can turn a greedy answer: CI saw the
        reference reuse 2 cached tokens of an earlier test's prompt while a restarted prefill
        engine had none, and the two answers part after 68 characters."""
        for s in (self.ref, self.prefill):
            status, body = http_get(s.url + "/flush_cache?timeout=60", timeout=70.0)
            assert status == 200, f"{s.name}: flush_cache answered {status}: {body[:200]!r}"

    def stop(self) -> None:
        for s in self.servers:
            s.stop()


_CLUSTERS: list[SglangCluster] = []


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """A failed test here shows what the engines logged (CI keeps no files)."""
    outcome = yield
    report = outcome.get_result()  # type: ignore[attr-defined]
    if report.failed and _CLUSTERS and HERE in Path(str(item.path)).parents:
        for s in _CLUSTERS[-1].servers:
            state = "running" if s.alive() else f"exited {s.proc.returncode if s.proc else None}"
            report.sections.append((f"SGLang {s.name} ({state}) log excerpt", s.log_excerpt()))


@pytest.fixture(scope="package")
def sglang_cluster() -> Iterator[SglangCluster]:
    """ref, p0, d0 and d1, started together and waited for; stopped when this package's tests
    are done (~2.6 GB of memory each)."""
    reason = missing_reason()
    if reason is not None:
        pytest.skip(reason)
    workdir = Path(tempfile.mkdtemp(prefix="real-sglang-"))
    cluster = SglangCluster(
        ref=SglangServer("ref", None, workdir),
        prefill=SglangServer("p0", "prefill", workdir),
        decodes=[
            SglangServer("d0", "decode", workdir),
            # d1 can switch roles (test_role_switch.py); the other tests use it as a decode.
            SglangServer("d1", "decode", workdir, role_switch=True),
        ],
        workdir=workdir,
    )
    t0 = time.monotonic()
    try:
        for s in cluster.servers:
            s.start()
        deadline = t0 + START_TIMEOUT_S
        for s in cluster.servers:
            s.wait_ready(deadline)
        print(
            f"\nreal SGLang: 4 servers ready in {time.monotonic() - t0:.1f} s "
            f"({', '.join(f'{s.name} {s.ready_after_s:.1f} s' for s in cluster.servers)})"
        )
        _CLUSTERS.append(cluster)
        yield cluster
    finally:
        if cluster in _CLUSTERS:
            _CLUSTERS.remove(cluster)
        cluster.stop()
        shutil.rmtree(workdir, ignore_errors=True)


# -- the router in front of them ---------------------------------------------------------------


@dataclass
class SglangRouter:
    url: str
    app: web.Application
    cluster: SglangCluster

    @property
    def parts(self) -> AppParts:
        return AppParts(self.app)

    async def reserved_blocks(self) -> dict[str, int]:
        usage = await self.parts.store.decode_usage([s.name for s in self.cluster.decodes])
        return {wid: u.reserved_blocks for wid, u in usage.items()}

    def client(self, timeout: float = 300.0) -> AsyncOpenAI:
        return AsyncOpenAI(
            base_url=self.url + "/v1", api_key="none", max_retries=0, timeout=timeout
        )


def router_settings(
    cluster: SglangCluster,
    key_prefix: str,
    worker_extra: dict[str, Any] | None = None,
    **overrides: Any,
) -> dict[str, Any]:
    """The router in front of p0, d0 and d1 as an operator writes it: URLs, roles and the
    decode engines' KV pool (`--max-total-tokens`, page size 1); the prefill's bootstrap port
    is read from its `/server_info`."""
    workers: list[dict[str, Any]] = [
        {"id": cluster.prefill.name, "url": cluster.prefill.url, "role": "prefill"},
        *(
            {"id": d.name, "url": d.url, "role": "decode", "kv_blocks": MAX_TOTAL_TOKENS}
            for d in cluster.decodes
        ),
    ]
    for w in workers:
        w.update(adapter="sglang", **(worker_extra or {}))
    raw: dict[str, Any] = {
        "model": SERVED,
        "perf": {"model": "tiny-llama", "gpu": "h100", "block_size": 1},
        "max_model_len": 8192,
        "store": {"url": top_conftest.REDIS_URL, "key_prefix": key_prefix},
        "loops": {"health_interval_s": 0.5, "health_timeout_s": 10, "state_refresh_s": 0.05},
        "workers": workers,
        # The model's own tokenizer: exact prompt counts, and the resume's count of what was sent.
        "estimates": {"tokenizers": {SERVED: str(MODEL_DIR)}},
        "timeouts": {"connect_s": 10, "prefill_s": 120, "ttft_s": 180, "idle_s": 60},
    }
    raw = merged_settings(raw, overrides)  # a group's given settings replace only their own
    return raw


@contextlib.asynccontextmanager
async def sglang_router(
    cluster: SglangCluster,
    key_prefix: str,
    worker_extra: dict[str, Any] | None = None,
    **overrides: Any,
) -> AsyncIterator[SglangRouter]:
    cluster.ensure_running()
    cluster.flush_prefix_caches()
    raw = router_settings(cluster, key_prefix, worker_extra, **overrides)
    settings = settings_from_mapping(raw)
    async with running_router(settings) as (url, app):
        yield SglangRouter(url=url, app=app, cluster=cluster)


@pytest.fixture
async def router(sglang_cluster: SglangCluster, redis_prefix: str) -> AsyncIterator[SglangRouter]:
    async with sglang_router(sglang_cluster, redis_prefix) as r:
        yield r


# -- requests and references -------------------------------------------------------------------


def unique_prompt(words: int = 12) -> str:
    """A prompt in the tiny model's vocabulary words, fresh each call."""
    import random

    rng = random.Random(uuid.uuid4().int)
    vocab = (
        "router prefill decode cache block token stream request model server engine "
        "transfer handoff latency queue batch lease reserve release worker cluster gateway"
    ).split()
    return " ".join(rng.choice(vocab) for _ in range(words))


def server_info(server: SglangServer) -> dict[str, Any]:
    import json

    status, body = http_get(server.url + "/server_info", timeout=10.0)
    assert status == 200, body[:200]
    info: dict[str, Any] = json.loads(body)
    return info
