"""SIGTERM on `disagg-router serve`: no new work, running streams finish up to
`shutdown_grace_s`, the rest end with an SSE error frame and [DONE], everything is released,
exit 0."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import yaml

from disagg_tools.sim.textgen import expected_answer
from disagg_tools.sim.worker import WorkerConfig, running_worker
from state import open_store
from tests.conftest import MODEL, REDIS_URL

CHAT = "/v1/chat/completions"
GRACE_S = 3.0


def _command(config: Path) -> list[str]:
    script = Path(sys.executable).with_name("disagg-router")
    entry = [str(script)] if script.exists() else [sys.executable, "-m", "router.edge.serve_cli"]
    return [*entry, "serve", "--config", str(config)]


@contextlib.asynccontextmanager
async def _router_process(
    config: Path,
) -> AsyncIterator[tuple[asyncio.subprocess.Process, str]]:
    proc = await asyncio.create_subprocess_exec(
        *_command(config), stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    try:
        assert proc.stdout is not None
        async with asyncio.timeout(30):
            line = (await proc.stdout.readline()).decode()
        assert "serving on http://" in line, line
        url = line.split("serving on ", 1)[1].split()[0]
        yield proc, url
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def _stream(
    s: aiohttp.ClientSession,
    url: str,
    tokens: int,
    started: asyncio.Event,
) -> tuple[dict[str, Any], list[bytes]]:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": f"shutdown {tokens}"}],
        "max_tokens": tokens,
        "stream": True,
    }
    headers = {"X-Sim-Output-Tokens": str(tokens)}
    async with s.post(url + CHAT, json=body, headers=headers) as r:
        assert r.status == 200, await r.text()
        events: list[bytes] = []
        async for line in r.content:
            if line.startswith(b"data: "):
                events.append(line.strip()[6:])
                started.set()
    return {"body": body, "headers": headers}, events


async def test_sigterm_finishes_short_streams_and_ends_long_ones(
    redis_prefix: str, tmp_path: Path
) -> None:
    async with contextlib.AsyncExitStack() as stack:
        workers = []
        for role, wid, scale in (("prefill", "p0", 500.0), ("decode", "d0", 1.0)):
            cfg = WorkerConfig(
                role=role,
                worker_id=wid,
                model=MODEL,
                time_scale=scale,
                kv_blocks=8192,
                kv_lease_s=30.0 * scale,
            )
            url = await stack.enter_async_context(running_worker(cfg))
            entry: dict[str, Any] = {"id": wid, "url": url, "role": role, "adapter": "sim"}
            if role == "decode":
                entry["kv_blocks"] = 8192
            workers.append(entry)
        config = tmp_path / "cluster.yaml"
        config.write_text(
            yaml.safe_dump(
                {
                    "model": MODEL,
                    "perf": {"model": MODEL, "gpu": "h100"},
                    "server": {"host": "127.0.0.1", "port": 0, "shutdown_grace_s": GRACE_S},
                    "store": {"url": REDIS_URL, "key_prefix": redis_prefix},
                    "workers": workers,
                }
            )
        )
        proc, url = await stack.enter_async_context(_router_process(config))
        s = await stack.enter_async_context(aiohttp.ClientSession())
        # One kept-alive connection that stays open through the shutdown.
        kept = await stack.enter_async_context(
            aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1))
        )
        async with kept.get(url + "/ready") as r:
            assert r.status == 200

        lengths = [12, 16, 20, 4000, 4000, 4000]  # three short, three far past the grace period
        started = [asyncio.Event() for _ in lengths]
        streams = [
            asyncio.ensure_future(_stream(s, url, n, ev))
            for n, ev in zip(lengths, started, strict=True)
        ]
        async with asyncio.timeout(30):
            await asyncio.gather(*(ev.wait() for ev in started))

        proc.send_signal(signal.SIGTERM)
        for _ in range(200):  # the signal is handled: /ready says 503 on the open connection
            async with kept.get(url + "/ready") as r:
                if r.status == 503:
                    assert (await r.json())["shutting_down"] is True
                    break
            await asyncio.sleep(0.02)
        else:
            raise AssertionError("/ready never said 503 after SIGTERM")
        body = {"model": MODEL, "messages": [{"role": "user", "content": "late"}]}
        async with kept.post(url + CHAT, json=body) as r:
            assert r.status == 503
            assert int(r.headers["Retry-After"]) >= 1
            assert r.headers.get("Connection", "").lower() == "close"
            assert (await r.json())["error"]["code"] == "shutting_down"
        # The listening socket is closed: a new connection is refused.
        fresh = await stack.enter_async_context(aiohttp.ClientSession())
        try:
            async with fresh.get(url + "/health") as r:
                raise AssertionError(f"a new connection was accepted: {r.status}")
        except aiohttp.ClientConnectionError:
            pass

        async with asyncio.timeout(60):
            results = await asyncio.gather(*streams)
            code = await proc.wait()
        assert code == 0
        assert proc.stderr is not None
        stderr = (await proc.stderr.read()).decode()
        assert "Traceback" not in stderr, stderr
        logged = [orjson.loads(line) for line in stderr.splitlines() if line.strip()]  # JSON
        messages = [r["message"] for r in logged]
        assert any("ending 3 requests still running" in m for m in messages), messages

        for n, (req, events) in zip(lengths, results, strict=True):
            assert events[-1] == b"[DONE]"
            parsed = [orjson.loads(e) for e in events[:-1]]  # every frame is valid JSON
            if n < 100:  # finished within the grace period, exactly
                text = "".join(p["choices"][0]["delta"].get("content") or "" for p in parsed)
                assert text == expected_answer(CHAT, req["body"], req["headers"])[0]
                assert all("error" not in p for p in parsed)
            else:  # cut at the deadline: an error frame, then [DONE]
                assert parsed[-1]["error"]["code"] == "shutting_down", parsed[-1]
                assert all("error" not in p for p in parsed[:-1])

    # Redis after the exit: nothing held under this prefix.
    store = await open_store(REDIS_URL, redis_prefix)
    try:
        usage = await store.decode_usage(["d0"])
        assert usage["d0"].reserved_blocks == 0 and usage["d0"].reservations == 0
        assert await store.stranded_bytes(["p0"]) == {"p0": 0}
    finally:
        await store.close()
