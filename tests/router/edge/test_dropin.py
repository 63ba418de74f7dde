"""The drop-in command line: `disagg-router serve --prefill URL [PORT] --decode URL`, no file.

The router runs as a subprocess in front of simulated workers (vLLM's and SGLang's protocol
forms), on ephemeral loopback ports; the official `openai` client talks to it. The workers
serve a model name nothing configures and a KV capacity only they report: both must be read
from them. Bad flags end with a message and exit code 2.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from openai import AsyncOpenAI
from openai.types.chat import ChatCompletionMessageParam

from disagg_tools.sim.textgen import expected_answer
from disagg_tools.sim.worker import WorkerConfig, running_worker
from router.config import ConfigError
from router.edge.dropin import FlagWorker, dropin_mapping
from router.workers.discovery import WorkerFacts
from tests.conftest import REDIS_URL

SERVED = "acme/drop-in-8b"  # what the workers serve; configured nowhere
DECODE_BLOCKS = 3072
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
pytestmark = pytest.mark.timeout(120)


def _entry() -> list[str]:
    script = Path(sys.executable).with_name("disagg-router")
    return [str(script)] if script.exists() else [sys.executable, "-m", "router.edge.serve_cli"]


@contextlib.asynccontextmanager
async def _workers(bootstrap: bool) -> AsyncIterator[tuple[str, str, int | None]]:
    """One simulated prefill and one decode: (prefill URL, decode URL, bootstrap port)."""
    common: dict[str, Any] = {"served_model_name": SERVED, "time_scale": 500.0}
    p_cfg = WorkerConfig(role="prefill", bootstrap_port=0 if bootstrap else None, **common)
    d_cfg = WorkerConfig(role="decode", kv_blocks=DECODE_BLOCKS, **common)
    async with running_worker(p_cfg) as p_url, running_worker(d_cfg) as d_url:
        port = None
        if bootstrap:
            async with aiohttp.ClientSession() as s, s.get(p_url + "/server_info") as r:
                port = int((await r.json())["disaggregation_bootstrap_port"])
        yield p_url, d_url, port


@contextlib.asynccontextmanager
async def _router(args: list[str], env: dict[str, str]) -> AsyncIterator[tuple[str, Path]]:
    """`disagg-router serve ARGS` on an ephemeral port: (its URL, its stderr log)."""
    log = Path(os.environ.get("TMPDIR", "/tmp")) / f"dropin-{os.getpid()}-{id(args)}.log"
    with log.open("wb") as err:
        proc = await asyncio.create_subprocess_exec(
            *_entry(),
            "serve",
            "--port",
            "0",
            "--log-format",
            "text",
            *args,
            stdout=asyncio.subprocess.PIPE,
            stderr=err,
            env={**os.environ, **env},
        )
    try:
        assert proc.stdout is not None
        async with asyncio.timeout(60):
            line = (await proc.stdout.readline()).decode()
        assert "serving on http://" in line, (line, log.read_text()[-3000:])
        yield line.split("serving on ", 1)[1].split()[0], log
    finally:
        if proc.returncode is None:
            proc.terminate()
            try:
                async with asyncio.timeout(20):
                    await proc.wait()
            except TimeoutError:
                proc.kill()
                await proc.wait()
        log.unlink(missing_ok=True)


async def _get(url: str) -> Any:
    async with aiohttp.ClientSession() as s, s.get(url) as r:
        assert r.status == 200, await r.text()
        return await r.json()


async def _serve_all_four(url: str) -> int:
    """Chat and completions, streamed and not, through the official client; each answer must
    be the simulated worker's, token for token. Returns how many requests were sent."""
    async with AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=30) as c:
        for stream in (False, True):
            prompt = f"drop-in chat stream={stream}"
            messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": prompt}]
            want = expected_answer(CHAT, {"model": SERVED, "messages": messages, "max_tokens": 9})
            if stream:
                got = ""
                async for chunk in await c.chat.completions.create(
                    model=SERVED, messages=messages, max_tokens=9, stream=True
                ):
                    got += "".join(ch.delta.content or "" for ch in chunk.choices)
            else:
                answer = await c.chat.completions.create(
                    model=SERVED, messages=messages, max_tokens=9
                )
                got = answer.choices[0].message.content or ""
                assert answer.model == SERVED
            assert got == want[0], (stream, got, want)

            prompt = f"drop-in completion stream={stream}"
            want = expected_answer(
                COMPLETIONS, {"model": SERVED, "prompt": prompt, "max_tokens": 7}
            )
            if stream:
                got = ""
                async for part in await c.completions.create(
                    model=SERVED, prompt=prompt, max_tokens=7, stream=True
                ):
                    got += "".join(ch.text for ch in part.choices)
            else:
                done = await c.completions.create(model=SERVED, prompt=prompt, max_tokens=7)
                got = done.choices[0].text
            assert got == want[0], (stream, got, want)
    return 4


async def _check_discovered(url: str) -> None:
    models = await _get(url + "/v1/models")
    assert [m["id"] for m in models["data"]] == [SERVED]  # not the built-in default name
    workers = {w["role"]: w for w in (await _get(url + "/admin/workers"))["workers"]}
    assert workers["decode"]["capacity_blocks"] == DECODE_BLOCKS  # as the worker reports it
    assert workers["prefill"]["paired"] and workers["decode"]["paired"]


async def _check_handoffs(p_url: str, d_url: str, n: int) -> None:
    """Every request went prefill -> KV handoff -> decode (disaggregated, not local)."""
    decode = (await _get(d_url + "/sim/state"))["counters"]
    prefill = (await _get(p_url + "/sim/state"))["counters"]
    assert decode.get("kv_pulled", 0) == n, decode
    assert prefill.get("requests:prefill", 0) == n, prefill
    assert "kv_params_mismatch" not in decode, decode


async def test_vllm_form_with_only_flags(redis_prefix: str) -> None:
    async with _workers(bootstrap=False) as (p_url, d_url, _):
        args = [
            "--vllm-pd-disaggregation",
            "--prefill",
            p_url,
            "--decode",
            d_url,
            "--redis-url",
            REDIS_URL,
        ]
        async with _router(args, {"DISAGG_ROUTER_STORE_KEY_PREFIX": redis_prefix}) as (url, log):
            await _check_discovered(url)
            n = await _serve_all_four(url)
            assert "state is kept in this process" not in log.read_text()
        await _check_handoffs(p_url, d_url, n)


async def test_sglang_form_with_bootstrap_port() -> None:
    async with _workers(bootstrap=True) as (p_url, d_url, port):
        args = ["--pd-disaggregation", "--prefill", p_url, str(port), "--decode", d_url]
        async with _router(args, {}) as (url, log):
            await _check_discovered(url)
            workers = (await _get(url + "/admin/workers"))["workers"]
            assert {w["adapter"] for w in workers} == {"sglang"}
            n = await _serve_all_four(url)
            # No Redis URL: the in-process store, and the log says so.
            assert "state is kept in this process" in log.read_text()
        await _check_handoffs(p_url, d_url, n)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--prefill", "http://127.0.0.1:9"], "at least one --prefill and one --decode"),
        (["--prefill", "ftp://x:1", "--decode", "http://127.0.0.1:9"], "not an http"),
        (["--prefill", "http://127.0.0.1:9", "abc", "--decode", "http://127.0.0.1:9"], "abc"),
        (
            ["--prefill", "http://127.0.0.1:9", "1", "2", "--decode", "http://127.0.0.1:9"],
            "optional bootstrap port",
        ),
        (
            [
                "--prefill",
                "http://127.0.0.1:9",
                "--decode",
                "http://127.0.0.1:10",
                "--worker-startup-timeout-secs",
                "0.2",
            ],
            "--kv-blocks",
        ),
        (
            ["--prefill", "http://127.0.0.1:9", "--decode", "http://127.0.0.1:9/"],
            "given more than once",
        ),
        (["--decode", "http://127.0.0.1:9", "--kv-blocks", "many"], "invalid int value"),
        (
            [
                "--vllm-pd-disaggregation",
                "--pd-disaggregation",
                "--prefill",
                "http://h:1",
                "--decode",
                "http://h:2",
            ],
            "exclude each other",
        ),
    ],
)
def test_bad_flags_exit_2_with_a_message(flags: list[str], message: str) -> None:
    done = subprocess.run(
        [*_entry(), "serve", *flags], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 2, (done.returncode, done.stderr)
    assert message in done.stderr, done.stderr
    assert "Traceback" not in done.stderr, done.stderr


# --- the precedence of flags and file (pure) ---------------------------------------------------

P = FlagWorker("http://p:1", "prefill")
D = FlagWorker("http://d:1", "decode")
FACTS = WorkerFacts(models=("m-a", "m-b"), kv_blocks=900, max_model_len=4096, bootstrap_port=7)


def test_flags_alone_take_what_workers_report() -> None:
    out = dropin_mapping({}, [P, D], [FACTS, FACTS], "sglang", None)
    assert out["models"] == ["m-a", "m-b"] and out["max_model_len"] == 4096
    p, d = out["workers"]
    assert (p["id"], p["bootstrap_port"], p["discover_layout"]) == ("p0", 7, True)
    assert (d["id"], d["kv_blocks"], d["adapter"]) == ("d0", 900, "sglang")
    assert "bootstrap_port" not in d


def test_kv_blocks_flag_beats_the_reported_capacity() -> None:
    out = dropin_mapping({}, [P, D], [FACTS, FACTS], "vllm", 123)
    assert out["workers"][1]["kv_blocks"] == 123


def test_the_file_wins_for_its_workers_models_and_context() -> None:
    file_worker = {"id": "d0", "url": "http://d:1", "role": "decode", "kv_blocks": 5}
    raw = {"model": "from-file", "max_model_len": 100, "workers": [file_worker]}
    extra = FlagWorker("http://d:2", "decode")
    out = dropin_mapping(raw, [P, D, extra], [FACTS, FACTS, FACTS], "vllm", None)
    assert "models" not in out and "max_model_len" not in out  # the file's stay
    ids = [(w["id"], w["url"], w.get("kv_blocks")) for w in out["workers"]]
    # The file's entry for http://d:1 is kept as written; new ids do not collide with it.
    assert ids == [("d0", "http://d:1", 5), ("p0", "http://p:1", None), ("d1", "http://d:2", 900)]


def test_a_silent_decode_needs_kv_blocks_or_a_perf_profile() -> None:
    with pytest.raises(ConfigError, match="did not answer"):
        dropin_mapping({}, [P, D], [FACTS, None], "vllm", None)
    assert dropin_mapping({}, [P, D], [FACTS, None], "vllm", 64)["workers"][1]["kv_blocks"] == 64
    with_perf = dropin_mapping(
        {"perf": {"model": "llama-3-8b", "gpu": "h100"}}, [P, D], [FACTS, None], "vllm", None
    )
    assert "kv_blocks" not in with_perf["workers"][1]  # the profile's capacity applies
    with pytest.raises(ConfigError, match="served model name"):
        dropin_mapping({}, [P, D], [None, None], "vllm", 64)


def test_the_file_and_flags_together_end_to_end(tmp_path: Path) -> None:
    """`--config` plus flags through the real loader: the file's scalars stay unless a flag
    sets them, the file's worker keeps its entry."""
    from router.edge.dropin import add_dropin_arguments, load_serve_settings

    cfg = tmp_path / "cluster.yaml"
    worker = {"id": "d9", "url": "http://127.0.0.1:9", "role": "decode", "kv_blocks": 11}
    cfg.write_text(
        yaml.safe_dump({"model": "m-file", "policy": "round_robin", "workers": [worker]})
    )
    parser = argparse.ArgumentParser()
    parser.add_argument("--config")
    add_dropin_arguments(parser)
    ns = parser.parse_args(
        [
            "--config",
            str(cfg),
            "--prefill",
            "http://127.0.0.1:10",
            "--worker-startup-timeout-secs",
            "0",
        ]
    )
    settings = load_serve_settings(ns, {}, {"server": {"port": 8123}, "policy": None})
    assert settings.models == ("m-file",) and settings.policy == "round_robin"
    assert settings.server.port == 8123
    assert [(w.id, w.role, w.kv_blocks) for w in settings.workers] == [
        ("d9", "decode", 11),
        ("p0", "prefill", None),
    ]


# --- what the workers' answers say (pure parsers, router/workers/discovery.py) --------------------

VLLM_METRICS = """\
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",cache_dtype="auto",enable_prefix_caching="True",\
gpu_memory_utilization="0.9",num_cpu_blocks="None",num_gpu_blocks="24795",\
num_gpu_blocks_override="None",sliding_window="None",swap_space_bytes="4294967296"} 1.0
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.0
"""


def test_vllm_facts_from_models_and_cache_config() -> None:
    from router.workers.discovery import worker_facts_sglang, worker_facts_vllm

    models = {
        "data": [
            {"id": "llama-8b", "root": "/w/llama", "max_model_len": 8192},
            {"id": "lora-a", "max_model_len": 4096},
        ]
    }
    facts = worker_facts_vllm(models, VLLM_METRICS)
    assert facts.models == ("llama-8b", "lora-a") and facts.max_model_len == 4096
    assert (facts.kv_blocks, facts.block_size) == (24795, 16)
    assert worker_facts_vllm(models, None).kv_blocks is None  # no /metrics: models only
    info = {
        "served_model_name": "qwen",
        "model_path": "/m/qwen",
        "page_size": 64,
        "max_total_num_tokens": 640_000,
        "context_length": 32768,
        "disaggregation_bootstrap_port": 8998,
    }
    got = worker_facts_sglang(info)
    assert (got.models, got.kv_blocks, got.block_size) == (("qwen",), 10_000, 64)
    assert (got.max_model_len, got.bootstrap_port) == (32768, 8998)
    assert worker_facts_sglang({"model_path": "/m/x"}).kv_blocks is None
