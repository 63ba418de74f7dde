"""Fixtures for the suite against real vLLM engines (vLLM's CPU build, NIXL over loopback).

One prefill and two decode vLLM servers are started once for this package from the venv and the tiny
model that `scripts/prepare_real_vllm.sh` prepares, and stopped at the end; a router (vLLM adapter,
Redis state under a key prefix of its own) is started in this process for each test. When the
prepared environment is absent every test here is skipped with the reason, so the main test run
costs nothing; `REAL_VLLM=0` skips it even when it is present.

Environment:
  REAL_VLLM_HOME           where the venv and model are (default: <repo>/.real-vllm)
  REAL_VLLM=0              skip this suite
  REAL_VLLM_START_TIMEOUT  seconds to wait for the servers to be ready (default 900)
  REAL_VLLM_KEEP_LOGS=1    print where the server logs are kept
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import shutil
import subprocess
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
from router.adapters.base import ProtocolViolation
from router.adapters.vllm import VllmNixlAdapter
from router.config import merged_settings, settings_from_mapping
from tests.app_parts import AppParts
from tests.conftest import free_port, running_router
from tests.engines import EngineProcess, EngineSuite, http_post_json

HERE = Path(__file__).resolve().parent
ENGINE_SITE = HERE / "engine_site"
REPO = HERE.parents[1]
HOME = Path(os.environ.get("REAL_VLLM_HOME") or REPO / ".real-vllm")
PYTHON = HOME / "venv" / "bin" / "python"
MODEL_DIR = HOME / "model"
SERVED = "tiny-llama"
VLLM_VERSION = "0.32.0"
BLOCK_SIZE = 32
# float32, not the model's bfloat16: with bfloat16 and 32-token blocks vLLM's CPU attention picks
# its AMX kernels wherever the CPU advertises AMX, and on VMs that advertise it without granting
# it the worker dies on its first forward pass. The router does not care; the test is the same.
DTYPE = os.environ.get("REAL_VLLM_DTYPE", "float32")
# Adapters the engines hold at once, and their largest rank (test_lora makes rank-8 ones).
MAX_LORAS = 2
LORA_RANK = 8
MAX_MODEL_LEN = 8192  # the tiny model's positions (scripts/build_tiny_model.py)
START_TIMEOUT_S = float(os.environ.get("REAL_VLLM_START_TIMEOUT", "900"))
# Every test here waits on engines that share 2 cores (NIXL's progress threads included); the
# first one also pays for starting them (pytest-timeout counts fixture set-up), which took from
# ~40 s on an idle machine to 430 s on a loaded one.
TEST_TIMEOUT_S = int(os.environ.get("REAL_VLLM_TEST_TIMEOUT", "1800"))


SUITE = EngineSuite("vLLM", HERE, HOME, TEST_TIMEOUT_S)
missing_reason = SUITE.missing_reason


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    SUITE.mark(items)


# -- the vLLM servers --------------------------------------------------------------------------


def nixl_handshake(prefill: VllmServer, decode: VllmServer, deadline: float) -> int:
    """One direct prefill → decode handoff, repeated until it works; returns the attempts.

    A decode server's first pull from a prefill server opens their NIXL side channel, with a
    hard-coded 5 s answer timeout; on 2 loaded cores the first burst of a test can miss it, and
    then every request of that burst fails inside vLLM ("Internal server error"). Tests measure
    the router, not vLLM's cold start, so each pair shakes hands before the first test."""
    adapter = VllmNixlAdapter()
    body = {
        "model": SERVED,
        "prompt": "a handshake before the tests",
        "max_tokens": 2,
        "temperature": 0,
    }
    attempts, last = 0, ""
    while True:
        attempts += 1
        try:
            status, answer = http_post_json(
                prefill.url + "/v1/completions", adapter.prefill_body(body), timeout=120
            )
            if status == 200:
                params = adapter.kv_params(answer)
                # Patient: the first pull of a pair can take minutes on loaded cores, and giving
                # up aborts it — the next attempt then starts from scratch.
                status, answer = http_post_json(
                    decode.url + "/v1/completions", adapter.decode_body(body, params), timeout=600
                )
                if status == 200 and answer.get("choices"):
                    return attempts
            last = f"{status}: {str(answer)[:200]}"
        except (OSError, ValueError, ProtocolViolation) as exc:
            last = repr(exc)
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"NIXL handshake {decode.name} -> {prefill.name} never worked "
                f"({attempts} attempts; last: {last})\n{decode.log_tail()}"
            )
        time.sleep(2.0)


# Log lines that never explain a failure: probes, and start-up warnings every engine logs here.
_ROUTINE = (
    '"GET /health',
    '"GET /metrics',
    "Found ulimit",
    "Enforce eager",
    "Inductor",
    "Triton",
    "Model Runner V2",
    "Reset SSM",
    "KVConnectorBase_V1",
    "FutureWarning",
    "NUMA binding",
    "LD_PRELOAD",
    "reduce_op",
)


@dataclass
class VllmServer(EngineProcess):
    """One `python -m vllm.entrypoints.openai.api_server` process group on loopback."""

    KIND = "vLLM server"
    ROUTINE = _ROUTINE

    name: str
    kv_role: str | None  # kv_producer | kv_consumer | None (no connector)
    workdir: Path
    port: int = field(default_factory=free_port)
    side_port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None
    started_at: float = 0.0
    ready_after_s: float | None = None

    def command(self) -> list[str]:
        cmd = [
            str(PYTHON),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(MODEL_DIR),
            "--served-model-name",
            SERVED,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--block-size",
            str(BLOCK_SIZE),
            "--enforce-eager",
            "--max-model-len",
            str(MAX_MODEL_LEN),
            "--seed",
            "0",
            "--dtype",
            DTYPE,
            # LoRA on every engine, for test_lora (issue 35): a second engine pair of its own
            # cost 6 minutes of CI on 2 cores. Requests without an adapter run as without it.
            "--enable-lora",
            "--max-loras",
            str(MAX_LORAS),
            "--max-lora-rank",
            str(LORA_RANK),
        ]
        if self.kv_role is not None:
            # P holds a prefilled KV for kv_lease_duration (vLLM's default 30 s, extended by D's
            # heartbeats once D has the request). On 2 loaded cores a queued decode can take
            # longer than 30 s to start; the router gives up at its kv_lease_s (120 s, below
            # this), never after P has freed the blocks (D would decode from garbage).
            cmd += [
                "--kv-transfer-config",
                json.dumps(
                    {
                        "kv_connector": "NixlConnector",
                        "kv_role": self.kv_role,
                        "kv_buffer_device": "cpu",
                        "kv_connector_extra_config": {"kv_lease_duration": 300},
                    }
                ),
            ]
        return cmd

    def environment(self) -> dict[str, str]:
        env = {
            k: v
            for k, v in os.environ.items()
            if k.lower() not in ("http_proxy", "https_proxy", "all_proxy")
            and not k.startswith(("VIRTUAL_ENV", "PYTEST", "DISAGG_"))
        }
        cache = self.workdir / f"{self.name}-cache"
        env.update(
            PATH=f"{PYTHON.parent}:{env.get('PATH', '/usr/bin:/bin')}",
            UCX_NET_DEVICES="lo",
            VLLM_NIXL_SIDE_CHANNEL_HOST="127.0.0.1",
            VLLM_NIXL_SIDE_CHANNEL_PORT=str(self.side_port),
            HF_HUB_OFFLINE="1",
            TRANSFORMERS_OFFLINE="1",
            VLLM_CPU_KVCACHE_SPACE="1",
            # One unpinned OpenMP thread per engine: three engines and NIXL's polling threads
            # share 2 cores, and OpenMP threads pinned to the same cores spin in barriers
            # waiting for each other (engine steps that hung for minutes).
            OMP_NUM_THREADS="1",
            VLLM_CPU_OMP_THREADS_BIND="nobind",
            # NIXL's progress thread spins a core per engine unless given a poll timeout
            # (engine_site/sitecustomize.py explains).
            PYTHONPATH=os.pathsep.join(p for p in (str(ENGINE_SITE), env.get("PYTHONPATH")) if p),
            REAL_VLLM_NIXL_POLL_US=os.environ.get("REAL_VLLM_NIXL_POLL_US", "1000"),
            VLLM_CACHE_ROOT=str(cache / "vllm"),
            TORCHINDUCTOR_CACHE_DIR=str(cache / "inductor"),
            XDG_CACHE_HOME=str(cache),
            VLLM_NO_USAGE_STATS="1",
            VLLM_ALLOW_RUNTIME_LORA_UPDATING="True",  # the router loads adapters (test_lora)
            DO_NOT_TRACK="1",
            NO_PROXY="*",
        )
        return env

    def prompt_tokens_by_source(self) -> dict[str, float]:
        m = self.metrics()
        return {
            dict(lbl)["source"]: v
            for (name, lbl), v in m.items()
            if name == "vllm:prompt_tokens_by_source_total"
        }

    def num_gpu_blocks(self) -> int:
        for (name, labels), _ in self.metrics().items():
            if name == "vllm:cache_config_info":
                return int(dict(labels)["num_gpu_blocks"])
        raise AssertionError(f"{self.name}: no vllm:cache_config_info in /metrics")


@dataclass
class VllmCluster:
    prefill: VllmServer
    decodes: list[VllmServer]
    workdir: Path
    startup_s: float = 0.0
    restarts: int = 0

    @property
    def servers(self) -> list[VllmServer]:
        return [self.prefill, *self.decodes]

    def ensure_running(self) -> None:
        """Restart any server a previous test killed (the resume test kills a decode server) or
        that stopped answering /health: vLLM's API server lingers for a while after its engine
        core died, its port already closed."""
        dead = [s for s in self.servers if not s.alive() or not s.answers_health()]
        for s in dead:
            if s.alive():
                print(
                    f"\nreal vLLM: {s.name} is running but not healthy; restarting it:\n"
                    f"{s.log_excerpt()}"
                )
        for s in dead:
            s.stop()
            s.side_port = free_port()
            s.start()
            self.restarts += 1
        deadline = time.monotonic() + START_TIMEOUT_S
        for s in dead:
            s.wait_ready(deadline)
        if dead:
            self.handshake(deadline)

    def handshake(self, deadline: float) -> None:
        for d in self.decodes:
            n = nixl_handshake(self.prefill, d, deadline)
            if n > 1:
                print(
                    f"\nreal vLLM: NIXL handshake {d.name} -> {self.prefill.name} took {n} attempts"
                )

    def stop(self) -> None:
        for s in self.servers:
            s.stop()


# The cluster of this run, for the failure report below.
_CLUSTERS: list[VllmCluster] = []


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """A failed test here shows what the engines logged: CI keeps no files, and most failures
    on a loaded machine are an engine's, not the router's."""
    outcome = yield
    report = outcome.get_result()  # type: ignore[attr-defined]
    if report.failed and _CLUSTERS and HERE in Path(str(item.path)).parents:
        for s in _CLUSTERS[-1].servers:
            state = "running" if s.alive() else f"exited {s.proc.returncode if s.proc else None}"
            report.sections.append((f"vLLM {s.name} ({state}) log excerpt", s.log_excerpt()))


@pytest.fixture(scope="package")
def vllm_cluster() -> Iterator[VllmCluster]:
    """p0 (kv_producer), d0 and d1 (kv_consumer), started together and waited for; stopped
    as soon as this package's tests are done (three engines hold ~7 GB of memory, which the
    rest of the test run should not pay for)."""
    reason = missing_reason()
    if reason is not None:
        pytest.skip(reason)
    workdir = Path(tempfile.mkdtemp(prefix="real-vllm-"))
    cluster = VllmCluster(
        prefill=VllmServer("p0", "kv_producer", workdir),
        decodes=[
            VllmServer("d0", "kv_consumer", workdir),
            VllmServer("d1", "kv_consumer", workdir),
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
        cluster.handshake(deadline)
        cluster.startup_s = time.monotonic() - t0
        print(
            f"\nreal vLLM: 3 servers ready in {cluster.startup_s:.1f} s "
            f"({', '.join(f'{s.name} {s.ready_after_s:.1f} s' for s in cluster.servers)}); "
            f"logs in {workdir}"
        )
        _CLUSTERS.append(cluster)
        yield cluster
    finally:
        if cluster in _CLUSTERS:
            _CLUSTERS.remove(cluster)
        cluster.stop()
        if os.environ.get("REAL_VLLM_KEEP_LOGS") == "1":
            print(f"real vLLM: logs kept in {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)


# -- the router in front of them ---------------------------------------------------------------


@dataclass
class RealRouter:
    url: str
    app: web.Application
    cluster: VllmCluster

    @property
    def parts(self) -> AppParts:
        return AppParts(self.app)

    async def reserved_blocks(self) -> dict[str, int]:
        """The decode reservations the store holds, once the router owes it nothing: an
        end-of-request release the store did not take in time (three engines on two cores can
        slow Redis past its timeout) is owed and retried within a second (router/leases.py),
        and is not a leak. One that is still owed after 10 s is reported as held."""
        leases = self.parts.leases
        for _ in range(100):
            if not leases.owed:
                break
            await asyncio.sleep(0.1)
        usage = await self.parts.store.decode_usage([s.name for s in self.cluster.decodes])
        return {wid: u.reserved_blocks for wid, u in usage.items()}

    async def settled_reserved_blocks(self) -> dict[str, int]:
        """`reserved_blocks` once every request the router admitted has ended: the client has
        the whole answer as soon as its last byte is written, and the handler settles (the
        release) after that, on the same loop a moment later (a clean-clone run read 2 blocks
        still reserved right after a whole answer). Bounded: 10 s."""
        admission = self.parts.admission
        for _ in range(100):
            if admission.inflight == 0:
                break
            await asyncio.sleep(0.1)
        return await self.reserved_blocks()

    async def stranded(self) -> dict[str, int]:
        return dict(await self.parts.store.stranded_bytes([self.cluster.prefill.name]))

    def client(self, timeout: float = 300.0) -> AsyncOpenAI:
        return AsyncOpenAI(
            base_url=self.url + "/v1", api_key="none", max_retries=0, timeout=timeout
        )


def router_settings(cluster: VllmCluster, key_prefix: str, **overrides: Any) -> dict[str, Any]:
    kv_blocks = cluster.decodes[0].num_gpu_blocks()
    workers: list[dict[str, Any]] = [
        {
            "id": cluster.prefill.name,
            "url": cluster.prefill.url,
            "role": "prefill",
            "adapter": "vllm",
        }
    ]
    workers += [
        {"id": d.name, "url": d.url, "role": "decode", "adapter": "vllm", "kv_blocks": kv_blocks}
        for d in cluster.decodes
    ]
    raw: dict[str, Any] = {
        "model": SERVED,
        "perf": {"model": "tiny-llama", "gpu": "h100", "block_size": BLOCK_SIZE},
        "layout": {"engine": "vllm", "engine_version": VLLM_VERSION},
        "max_model_len": MAX_MODEL_LEN,
        # Read when used: the session may have started a private Redis (tests/conftest.py).
        "store": {"url": top_conftest.REDIS_URL, "key_prefix": key_prefix},
        "workers": workers,
        # Three engines share 2 cores: /health can take seconds.
        "loops": {"health_interval_s": 0.5, "health_timeout_s": 10, "state_refresh_s": 0.05},
        # Below the engines' kv_lease_duration (300 s, see VllmServer.command): a decode that
        # has not started by then is given up while P still holds the KV.
        "leases": {"kv_s": 120},
        "timeouts": {"connect_s": 10, "prefill_s": 180, "ttft_s": 240, "idle_s": 120},
    }
    if os.environ.get("DR_TEST_RELAY"):  # as tests/conftest.py's sim_cluster
        raw["upstream"] = {"relay": os.environ["DR_TEST_RELAY"]}
    raw = merged_settings(raw, overrides)  # a group's given settings replace only their own
    return raw


@contextlib.asynccontextmanager
async def real_router(
    cluster: VllmCluster, key_prefix: str, **overrides: Any
) -> AsyncIterator[RealRouter]:
    cluster.ensure_running()
    settings = settings_from_mapping(router_settings(cluster, key_prefix, **overrides))
    async with running_router(settings) as (url, app):
        yield RealRouter(url=url, app=app, cluster=cluster)


@pytest.fixture
async def router(vllm_cluster: VllmCluster, redis_prefix: str) -> AsyncIterator[RealRouter]:
    async with real_router(vllm_cluster, redis_prefix) as r:
        yield r


# -- requests and references -------------------------------------------------------------------


def unique_prompt(words: int = 12, tag: str = "") -> str:
    """A prompt no earlier request shares a block with: a fresh random word sequence."""

    rng = random.Random(uuid.uuid4().int)
    vocab = (
        "router prefill decode cache block token stream request model server engine "
        "transfer handoff latency queue batch lease reserve release worker cluster gateway "
        "policy place replica memory bandwidth compute layer head attention vector hello "
        "world quick brown fox jumps over lazy dog red green blue story poem"
    ).split()
    body = " ".join(rng.choice(vocab) for _ in range(words))
    return f"{tag} {body}".strip()


def chat_messages(prompt: str, parts: bool = False) -> list[dict[str, Any]]:
    content: Any = [{"type": "text", "text": prompt}] if parts else prompt
    return [
        {"role": "system", "content": "answer the question"},
        {"role": "user", "content": content},
    ]


async def reference(
    server: VllmServer, kind: str, prompt: str, max_tokens: int, *, parts: bool = False
) -> str:
    """The answer computed by one server alone, no disaggregation, its prefix cache bypassed
    (`cache_salt`), greedy."""
    async with AsyncOpenAI(
        base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=300
    ) as client:
        salt = {"cache_salt": f"ref-{uuid.uuid4().hex}"}
        if kind == "chat":
            r = await client.chat.completions.create(
                model=SERVED,
                messages=chat_messages(prompt, parts),  # type: ignore[arg-type]
                max_tokens=max_tokens,
                temperature=0,
                extra_body=salt,
            )
            return r.choices[0].message.content or ""
        c = await client.completions.create(
            model=SERVED, prompt=prompt, max_tokens=max_tokens, temperature=0, extra_body=salt
        )
        return c.choices[0].text


async def ask(
    client: AsyncOpenAI,
    kind: str,
    prompt: str,
    max_tokens: int,
    *,
    stream: bool,
    parts: bool = False,
    **extra: Any,
) -> tuple[str, Any]:
    """(text, usage or None) of one request through `client`, greedy."""
    if kind == "chat":
        if stream:
            text, usage = [], None
            s = await client.chat.completions.create(
                model=SERVED,
                messages=chat_messages(prompt, parts),  # type: ignore[arg-type]
                max_tokens=max_tokens,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
                **extra,
            )
            async for chunk in s:
                if chunk.choices and chunk.choices[0].delta.content:
                    text.append(chunk.choices[0].delta.content)
                if chunk.usage is not None:
                    usage = chunk.usage
            return "".join(text), usage
        r = await client.chat.completions.create(
            model=SERVED,
            messages=chat_messages(prompt, parts),  # type: ignore[arg-type]
            max_tokens=max_tokens,
            temperature=0,
            **extra,
        )
        return r.choices[0].message.content or "", r.usage
    if stream:
        text, usage = [], None
        cs = await client.completions.create(
            model=SERVED,
            prompt=prompt,
            max_tokens=max_tokens,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            **extra,
        )
        async for chunk in cs:
            if chunk.choices and chunk.choices[0].text:
                text.append(chunk.choices[0].text)
            if chunk.usage is not None:
                usage = chunk.usage
        return "".join(text), usage
    c = await client.completions.create(
        model=SERVED, prompt=prompt, max_tokens=max_tokens, temperature=0, **extra
    )
    return c.choices[0].text, c.usage


async def wait_for(predicate: Any, within_s: float, what: str, interval: float = 0.2) -> None:
    """Poll an async or sync predicate until true; fail with `what` after `within_s` s."""
    import asyncio
    import inspect

    deadline = time.monotonic() + within_s
    last: Any = None
    while time.monotonic() < deadline:
        last = predicate()
        if inspect.isawaitable(last):
            last = await last
        if last is True:
            return
        await asyncio.sleep(interval)
    raise AssertionError(f"{what} (still {last!r} after {within_s} s)")
