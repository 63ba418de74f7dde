"""The real peer routers (PyPI `sglang-router`, `vllm-router`) in PD mode in front of our sim.

Evidence that the simulated worker speaks the real wire protocols: each router is started on
loopback in front of one simulated prefill and one simulated decode worker, and what comes back
through it must be exactly `disagg_tools.sim.textgen.expected_answer`, with the KV really handed
over (the
decode worker counts the pull, nothing mismatched). Install the wheels with
`scripts/install_peers.sh`; a test skips only when its wheel cannot be imported.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest

from disagg_tools.sim.textgen import expected_answer
from disagg_tools.sim.worker import WorkerConfig, running_worker

pytestmark = pytest.mark.peers

MODEL = "llama-3-8b"
STARTUP_POLLS = 600  # x 0.1 s: a cold start of the Rust binary takes well under a second
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
GENERATE = "/generate"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _env() -> dict[str, str]:
    env = dict(os.environ)
    # sglang-router tries to fetch a tokenizer for the model at start-up: make that fail at once.
    env.update(HF_ENDPOINT="http://127.0.0.1:9", HF_HUB_OFFLINE="1", NO_PROXY="*")
    for key in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy", "ALL_PROXY"):
        env.pop(key, None)
    return env


@contextlib.contextmanager
def _process(cmd: list[str], log: Path) -> Iterator[subprocess.Popen[bytes]]:
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, env=_env(), stdout=out, stderr=subprocess.STDOUT)
        try:
            yield proc
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@contextlib.asynccontextmanager
async def _cluster() -> AsyncIterator[tuple[str, str, int, dict[str, str]]]:
    """One sim prefill (with a bootstrap port) and one sim decode: (P url, D url, bootstrap)."""
    common: dict[str, Any] = {"model": MODEL, "kv_blocks": 4096, "time_scale": 500.0}
    p_cfg = WorkerConfig(role="prefill", worker_id="p0", bootstrap_port=0, **common)
    d_cfg = WorkerConfig(role="decode", worker_id="d0", **common)
    async with running_worker(p_cfg) as p_url, running_worker(d_cfg) as d_url:
        async with aiohttp.ClientSession() as s, s.get(p_url + "/server_info") as r:
            bootstrap = int((await r.json())["disaggregation_bootstrap_port"])
        yield p_url, d_url, bootstrap, {"p0": p_url, "d0": d_url}


async def _wait_ready(proc: subprocess.Popen[bytes], url: str, log: Path, probe: str) -> None:
    """Until the router's readiness probe answers 200.

    sglang-router answers `/health` before its background worker registration has finished;
    its `/readiness` turns 200 only with healthy workers. vllm-router waits for its workers
    before it listens, so its `/health` is enough.
    """
    async with aiohttp.ClientSession() as s:
        for _ in range(STARTUP_POLLS):
            if proc.poll() is not None:
                pytest.fail(f"router exited with {proc.returncode}:\n{_tail(log)}")
            with contextlib.suppress(aiohttp.ClientError):
                async with s.get(url + probe) as r:
                    if r.status == 200:
                        return
            await asyncio.sleep(0.1)
    pytest.fail(f"router never became ready:\n{_tail(log)}")


def _tail(log: Path) -> str:
    return log.read_text(errors="replace")[-4000:]


def _body(path: str, stream: bool, prompt: str) -> dict[str, Any]:
    if path == GENERATE:
        return {"text": prompt, "sampling_params": {"max_new_tokens": 12}, "stream": stream}
    if path == CHAT:
        return {
            "model": MODEL,
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": 12,
            "stream": stream,
        }
    return {"model": MODEL, "prompt": prompt, "max_tokens": 12, "stream": stream}


def _text_of(path: str, stream: bool, raw: bytes) -> str:
    if not stream:
        obj = orjson.loads(raw)
        if path == GENERATE:
            return str(obj["text"])
        choice = obj["choices"][0]
        return str(choice["message"]["content"] if path == CHAT else choice["text"])
    events = [
        line[len(b"data:") :].strip() for line in raw.split(b"\n") if line.startswith(b"data:")
    ]
    assert events and events[-1] == b"[DONE]", raw[-400:]
    chunks = [orjson.loads(e) for e in events[:-1]]
    if path == GENERATE:
        return str(chunks[-1]["text"])  # SGLang streams the whole text so far
    out = []
    for chunk in chunks:
        for choice in chunk.get("choices", []):
            piece = choice.get("delta", {}).get("content") if path == CHAT else choice.get("text")
            out.append(piece or "")
    return "".join(out)


async def _check_answers(router_url: str, cases: list[tuple[str, bool]]) -> None:
    async with aiohttp.ClientSession() as s:
        for i, (path, stream) in enumerate(cases):
            body = _body(path, stream, f"peer router case {i} asks about {path} stream={stream}")
            async with s.post(router_url + path, json=body) as r:
                raw = await r.read()
                assert r.status == 200, (path, stream, raw[:800])
            want, _, _ = expected_answer(path, body)
            assert _text_of(path, stream, raw) == want, (path, stream, raw[:800])


async def _counters(url: str) -> dict[str, int]:
    async with aiohttp.ClientSession() as s, s.get(url + "/sim/state") as r:
        return dict((await r.json())["counters"])


async def _check_handoffs(workers: dict[str, str], n: int) -> None:
    decode = await _counters(workers["d0"])
    prefill = await _counters(workers["p0"])
    assert decode.get("kv_pulled", 0) == n, decode
    assert decode.get("requests:remote_decode", 0) == n, decode
    assert prefill.get("requests:prefill", 0) == n, prefill
    assert "kv_params_mismatch" not in decode, decode


async def test_sglang_router_pd(tmp_path: Path) -> None:
    pytest.importorskip("sglang_router", reason="sglang-router wheel not installed")
    port = _free_port()
    cases = [(CHAT, True), (COMPLETIONS, True), (GENERATE, True), (CHAT, False), (GENERATE, False)]
    async with _cluster() as (p_url, d_url, bootstrap, workers):
        cmd = [
            sys.executable, "-m", "sglang_router.launch_router", "--pd-disaggregation",
            "--prefill", p_url, str(bootstrap), "--decode", d_url,
            "--host", "127.0.0.1", "--port", str(port),
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(_free_port()),
            "--log-level", "warn",
        ]  # fmt: skip
        log = tmp_path / "sglang-router.log"
        with _process(cmd, log) as proc:
            url = f"http://127.0.0.1:{port}"
            await _wait_ready(proc, url, log, "/readiness")
            await _check_answers(url, cases)
        await _check_handoffs(workers, len(cases))


async def test_vllm_router_pd(tmp_path: Path) -> None:
    pytest.importorskip("vllm_router", reason="vllm-router wheel not installed")
    port = _free_port()
    cases = [(CHAT, True), (COMPLETIONS, True), (CHAT, False), (COMPLETIONS, False)]
    async with _cluster() as (p_url, d_url, _bootstrap, workers):
        cmd = [
            sys.executable, "-m", "vllm_router.launch_router", "--vllm-pd-disaggregation",
            "--prefill", p_url, "--decode", d_url,
            "--host", "127.0.0.1", "--port", str(port),
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(_free_port()),
            "--log-level", "warning",
        ]  # fmt: skip
        log = tmp_path / "vllm-router.log"
        with _process(cmd, log) as proc:
            url = f"http://127.0.0.1:{port}"
            await _wait_ready(proc, url, log, "/health")
            await _check_answers(url, cases)
        await _check_handoffs(workers, len(cases))
